"""GGUF reading: a synthetic llama.cpp-style file (Q/K rows permuted, Q8_0 blocks) round-trips."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

import hydra_kernels as hk
from helpers import assert_close_rel
from test_llama_vs_transformers import make_hf

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (written independently of the package)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def parts_of(name):
    return name.split(".")


def random_k_quant(rows: int, cols: int, type_name: str, seed: int) -> np.ndarray:
    """Random raw blocks of a K-quant or an IQ4 type (gguf's numpy code cannot quantise to them) with finite
    fp16 scales."""
    from gguf import GGML_QUANT_SIZES

    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * cols // block_size, block_bytes), dtype=np.uint8)
    f16 = lambda k: rng.normal(0, 0.01, (b.shape[0], k)).astype(np.float16).view(np.uint8)  # noqa: E731
    if type_name in ("IQ4_NL", "IQ4_XS"):  # d first
        b[:, :2] = f16(1)
    elif type_name in ("Q4_K", "Q5_K"):  # d, dmin first
        b[:, :4] = f16(2)
    elif type_name == "Q2_K":  # d, dmin last
        b[:, -4:] = f16(2)
    else:  # Q6_K, Q3_K: d last
        b[:, -2:] = f16(1)
    return b.reshape(rows, -1)


def write_gguf(hf, path, arch="llama", quantise=False):
    """hf's weights as a llama.cpp GGUF. quantise: False (F32), True (Q8_0 where rows hold blocks of 32), or
    {GGUF role, e.g. "attn_q" / "token_embd" / "output": GGML type name} (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
    quantised by gguf, K-quants random blocks, which then replace the weight). Returns the values the file holds, by
    HF name, in HF row order."""
    cfg = hf.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    used = {}  # HF name -> the values the file holds, in HF row order
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp stores no output.weight, and the reader ties the LM head to the embedding
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        stored = a
        if parts_of(name)[-2:-1] == ["q_proj"]:
            stored = llama_cpp_permute(a, cfg.num_attention_heads)
        elif parts_of(name)[-2:-1] == ["k_proj"]:
            stored = llama_cpp_permute(a, cfg.num_key_value_heads)
        kind = quantise.get(g.split(".")[-2]) if isinstance(quantise, dict) else ("Q8_0" if quantise else None)
        if kind is not None and (kind.endswith("_K") or kind.startswith("IQ")):
            q = random_k_quant(*stored.shape, kind, seed=len(g))
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[kind])
            stored = dequantize(q, GGMLQuantizationType[kind]).reshape(stored.shape)
            a = stored
            if parts_of(name)[-2:-1] in (["q_proj"], ["k_proj"]):  # HF order: undo the permutation
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                a = stored.reshape(heads, -1, 2, *stored.shape[1:]).swapaxes(1, 2).reshape(stored.shape)
        elif kind and a.ndim == 2 and a.shape[1] % 32 == 0:  # Q8_0 / Q4_0 / Q4_1: blocks of 32 within a row
            q = quantize(stored, GGMLQuantizationType[kind])
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[kind])
            # rows are quantised independently, so the permutation commutes with the rounding
            a = dequantize(quantize(a, GGMLQuantizationType[kind]), GGMLQuantizationType[kind])
        else:
            w.add_tensor(g, stored)
        used[name] = torch.from_numpy(np.array(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return used


@pytest.mark.parametrize("quantise", [False, True])
def test_synthetic_gguf_matches_transformers(tmp_path, monkeypatch, quantise):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    # GQA 2 and widths that are multiples of 32, so that Q8_0 (blocks of 32 in a row) applies
    hf = make_hf("mha-untied", seed=11, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    dequantised = write_gguf(hf, tmp_path / "tiny.gguf", quantise=quantise)
    from gguf import GGUFReader

    kinds = {t.tensor_type for t in GGUFReader(str(tmp_path / "tiny.gguf")).tensors}
    assert (GGMLQuantizationType.Q8_0 in kinds) == quantise
    with torch.no_grad():  # the reference holds exactly the values the file stores
        for n, p in hf.named_parameters():
            p.copy_(dequantised[n])
    model, tok = hk.load_model(tmp_path / "tiny.gguf", device="cpu")
    assert tok is None  # no tokenizer metadata in this file
    ids = torch.randint(0, 101, (2, 15), generator=torch.Generator().manual_seed(0))
    assert_close_rel(model(ids), hf(ids).logits, 1e-4, "synthetic GGUF")
    # the default (quantized) load caches the config only: its weights are read from the GGUF, no fp32 copy
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and cached[0].name.endswith("-config") and (cached[0] / "config.json").exists()
    assert not (cached[0] / "model.safetensors").exists()
    hk.load_model(tmp_path / "tiny.gguf", device="cpu")  # second load reuses the cache
    assert list((tmp_path / "cache").iterdir()) == cached
    fp32, _ = hk.load_model(tmp_path / "tiny.gguf", device="cpu", weights="fp32")  # the fp32 copy, once
    assert_close_rel(fp32(ids), hf(ids).logits, 1e-4, "synthetic GGUF, fp32 load")
    full = sorted(set((tmp_path / "cache").iterdir()) - set(cached))
    assert len(full) == 1 and (full[0] / "model.safetensors").exists()
    hk.load_model(tmp_path / "tiny.gguf", device="cpu")  # a complete entry with weights serves any load
    hk.load_model(tmp_path / "tiny.gguf", device="cpu", weights="fp32")
    assert sorted((tmp_path / "cache").iterdir()) == sorted(cached + full)


def test_non_llama_gguf_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    w = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="not a Llama-family GGUF"):
        hk.load_model(tmp_path / "gpt2.gguf", device="cpu")
    assert not any((tmp_path / "cache").glob("*")), "a failed conversion must leave no cache entry"
