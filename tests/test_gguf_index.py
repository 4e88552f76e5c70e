"""model/gguf_index.GGUFIndex against gguf's own GGUFReader (the format's reference): the same fields (scalars,
strings, small arrays' values, every array's length), the same tensors (name, type, dims, bytes typed and
shaped alike), on the embedded model and on a file holding every block format the loader decodes; its
refusals of files that are not GGUF or run short. Also what the quantized load keeps out of memory: no
meta-initialisation detour through torch._dynamo (Llama.empty), the tokenizer as AutoTokenizer gives it."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import hydra_kernels as hk
from hydra_kernels.model.gguf_convert import gguf_config
from hydra_kernels.model.gguf_index import GGUFIndex
from hydra_kernels.model.pretrained import embedded_gguf_path
from test_gguf_loading import write_gguf
from test_llama_vs_transformers import make_hf
from test_quantized_model import MIXED


def assert_same_as_gguf(path):
    ix, ref = GGUFIndex(path), GGUFReader(str(path))
    assert gguf_config(ix) == gguf_config(ref)
    assert list(ix.fields) == list(ref.fields)
    for key, f in ref.fields.items():
        g = ix.fields[key]
        assert len(g.data) == len(f.data), key
        is_array = f.types[0].name == "ARRAY"
        if not is_array or (len(f.data) <= 64 and f.types[1].name != "STRING"):
            assert g.contents() == f.contents(), key
        else:
            assert g.contents() is None, key  # long or string arrays: their length only
    assert [t.name for t in ix.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ix.tensors, ref.tensors):
        data = a.data
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert data.dtype == b.data.dtype and data.shape == b.data.shape and np.array_equal(data, b.data), a.name
    return ix


def test_the_embedded_model_reads_as_ggufs_reader_reads_it():
    ix = assert_same_as_gguf(embedded_gguf_path())
    assert len(ix.fields["tokenizer.ggml.tokens"].data) == 49152  # a string array: its length, not its items


def test_every_block_format_reads_as_ggufs_reader_reads_it(tmp_path):
    # widths that are multiples of 256 (K-quant super-blocks); untied: an output.weight of its own
    hf = make_hf("mha-untied", seed=3, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512)
    write_gguf(hf, tmp_path / "mixed.gguf", quantise=MIXED)
    ix = assert_same_as_gguf(tmp_path / "mixed.gguf")
    assert {t.tensor_type.name for t in ix.tensors} >= set(MIXED.values()) | {"F32"}


def test_files_that_are_not_whole_ggufs_are_refused(tmp_path):
    hf = make_hf("mha-untied", seed=11, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="cut.gguf is truncated: tensor .* ends at byte"):
        GGUFIndex(cut)
    cut.write_bytes(data[:100])  # inside the header
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        GGUFIndex(cut)
    cut.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFIndex(cut)
    cut.write_bytes(data[:4] + (3 << 24).to_bytes(4, "little") + data[8:])  # version 3 written big-endian
    with pytest.raises(ValueError, match="big-endian"):
        GGUFIndex(cut)
    cut.write_bytes(data[:10])
    with pytest.raises(ValueError, match="not a readable GGUF file .* 10 bytes"):
        GGUFIndex(cut)
    ref = GGUFReader(str(path))
    t = ref.tensors[0]
    type_at = int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts[:4])  # the tensor's type field
    bad = bytearray(data)
    bad[type_at:type_at + 4] = (999).to_bytes(4, "little")
    cut.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="has unknown type 999"):
        GGUFIndex(cut)


def test_empty_llama_is_meta_without_the_dynamo_import():
    cfg = hk.NAMED_CONFIGS["smollm2-135m"]
    init = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_)
    m = hk.Llama.empty(cfg)
    assert all(p.is_meta for p in m.parameters())
    assert (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_) == init  # restored
    code = ("import sys, hydra_kernels as hk; hk.Llama.empty(hk.NAMED_CONFIGS['smollm2-135m']); "
            "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], "building the meta model imported torch._dynamo / triton (~90 MB resident)"


def test_tokenizer_is_the_one_autotokenizer_gives(tmp_path):
    from transformers import AutoTokenizer

    from hydra_kernels.model.gguf_convert import convert_gguf_cached
    from hydra_kernels.model.pretrained import load_tokenizer

    d = convert_gguf_cached(embedded_gguf_path())
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert type(ours) is type(auto)
    msgs = [{"role": "user", "content": "Explain how a hash map works, in two sentences."}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == \
        auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    text = "def f(x):\n    return x ** 2  # ünïcödé"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    ids = auto(text)["input_ids"] + [auto.eos_token_id]
    assert ours.decode(ids) == auto.decode(ids) and ours.special_tokens_map == auto.special_tokens_map
