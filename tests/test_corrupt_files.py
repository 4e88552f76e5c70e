"""Corrupt model files are refused, never loaded as garbage (issue 25, defects 4 and 7): truncated or
garbled GGUF files, the embedded default's digest, corrupt cache entries (rebuilt), corrupt config.json."""
import shutil
import warnings

import numpy as np
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.model import gguf_convert, pretrained
from test_gguf_loading import write_gguf
from test_llama_vs_transformers import make_hf


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    hf = make_hf("mha-untied", seed=11, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    write_gguf(hf, tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def garble(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_random_bytes_inside_a_gguf_are_refused_and_not_cached(tiny_gguf):  # 4
    size = tiny_gguf.stat().st_size
    rnd = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    rnd[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # at least one NaN among the fp32 weights
    garble(tiny_gguf, size // 2, rnd.tobytes())
    for weights in (None, "fp32", None):  # the quantized default reads the file's blocks, fp32 its conversion
        with pytest.raises(ValueError, match="non-finite values.*corrupt"):
            hk.load_model(tiny_gguf, device="cpu", weights=weights)
    # no weights cached (the quantized load caches the header's config and tokenizer only, before reading them)
    assert not any(gguf_convert.cache_root().glob("tiny-*/model.safetensors"))
    assert not any(gguf_convert.cache_root().glob("tiny-*-v?/manifest.json"))


def test_truncated_gguf_says_it_is_truncated(tiny_gguf):  # 4
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="tiny.gguf is truncated: tensor .* ends at byte"):
        hk.load_model(tiny_gguf, device="cpu")
    tiny_gguf.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(ValueError, match="tiny.gguf is not a readable GGUF file"):
        hk.load_model(tiny_gguf, device="cpu")


def test_embedded_gguf_is_verified_against_its_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / pretrained.EMBEDDED_GGUF
    shutil.copyfile(pretrained.embedded_gguf_path(), copy)
    assert gguf_convert.sha256_of(copy) == pretrained.EMBEDDED_SHA256  # the pinned digest is the installed file's
    garble(copy, copy.stat().st_size // 2, bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)))
    monkeypatch.setattr(pretrained, "embedded_gguf_path", lambda: copy)
    with pytest.raises(ValueError, match="does not have its known sha256 digest"):
        hk.load_model(device="cpu")


@pytest.mark.parametrize("damage", ["truncate safetensors", "garble safetensors header", "nan in safetensors",
                                    "garble config.json", "delete config.json"])
def test_corrupt_cache_entry_is_rebuilt(tiny_gguf, damage):
    model, _ = hk.load_model(tiny_gguf, device="cpu", weights="fp32")  # the load that reads the cached fp32 copy
    want = model(torch.tensor([[1, 2, 3]]))
    entry = next(gguf_convert.cache_root().glob("tiny-*"))
    st, cfg = entry / "model.safetensors", entry / "config.json"
    if damage == "truncate safetensors":
        st.write_bytes(st.read_bytes()[:-1000])
    elif damage == "garble safetensors header":
        garble(st, 8, b"\x00" * 16)
    elif damage == "nan in safetensors":
        garble(st, st.stat().st_size - 400, np.full(4, np.nan, np.float32).tobytes())
    elif damage == "garble config.json":
        cfg.write_bytes(b"{" * cfg.stat().st_size)  # same size: only reading it finds the damage
    else:
        cfg.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again, _ = hk.load_model(tiny_gguf, device="cpu", weights="fp32")
    assert torch.equal(again(torch.tensor([[1, 2, 3]])), want)
    assert gguf_convert.cache_entry_complete(entry)


def test_corrupt_model_config_json_names_the_file(tmp_path):  # 7
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON .*corrupt"):
        hk.load_model(tmp_path, device="cpu")


def test_corrupt_drafter_config_json_names_the_file(tmp_path):  # 7
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON .*corrupt"):
        hk.load_drafter(tmp_path)


def test_hf_dir_with_a_non_finite_weight_is_refused(tmp_path):
    from safetensors.torch import save_file

    from hydra_kernels.model.hf_checkpoint import read_safetensors_dir, save_hf_dir

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=2))
    save_hf_dir(model, tmp_path)
    sd = read_safetensors_dir(tmp_path)
    name = next(n for n in sd if n.endswith("q_proj.weight"))
    sd[name][0, 0] = float("inf")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"weight '{name}' holds 1 non-finite"):
        hk.load_model(tmp_path, device="cpu")
