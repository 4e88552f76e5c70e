"""A GGUF file loaded with its projection weights kept as stored (4-8-bit blocks) for the CPU.

The layer projections of a GGUF in a format model/gguf_blocks.py decodes (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) go
straight from the file's blocks into quantized panels (ops/quantized_linear.py), the only copy of each weight:
no fp32 copy is made of them, in RAM or on disk. A fused weight (q / k / v, gate / up) whose parts differ in
format takes the widest layout (lossless); one with a part in another type (F16, Q5_K, ...) loads as fp32.
Norms and the token embedding load as fp32; the LM head keeps its fp32 weight (the embedding, when tied: the
drafters and ops read it) and runs on quantized panels of the same values.

Every dequantized value equals gguf's, so this model's logits are bit-identical to the fp32 model
convert_gguf_cached makes of the same file (tests/test_quantized_model.py).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..ops.quantized_linear import QuantizedPanels
from .config import LlamaConfig
from .gguf_blocks import DECODERS, BlockWeight, concat_rows, decode_blocks
from .gguf_convert import check_finite, gguf_config, hf_name, open_gguf, unpermute_rope_rows
from .hf_names import _key_map, hf_to_ours
from .llama import Llama

_PROJECTIONS = (".wqkv.weight", ".wo.weight", ".w13.weight", ".w2.weight")


def _rope_heads(name: str, cfg: LlamaConfig) -> int | None:
    """The head count whose rows llama.cpp reordered in this weight (Q, K), else None."""
    if name.endswith("q_proj.weight"):
        return cfg.num_heads
    return cfg.num_kv_heads if name.endswith("k_proj.weight") else None


def read_gguf_blocks(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """Config, the HF-named fp32 tensors (norms, embedding, and weights in formats not decoded here) and the
    HF-named decoded blocks of the quantized weights. The token embedding and LM head come both ways (fp32
    for the lookup and the drafters, blocks for the LM head's panels). Non-finite scales or weights are refused, naming file and tensor."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    dense, blocks = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        heads = _rope_heads(name, cfg)
        kind = t.tensor_type.name
        head_or_embedding = name in ("model.embed_tokens.weight", "lm_head.weight")
        if kind in DECODERS and len(shape) == 2 and (name.endswith("_proj.weight") or head_or_embedding):
            bw = decode_blocks(t.data, kind, shape)
            check_finite(t.name, bw.s, path)
            if bw.o is not None:
                check_finite(t.name, bw.o, path)
            if heads is not None:
                bw = bw.rows(unpermute_rope_rows(np.arange(shape[0]), heads))
            blocks[name] = bw
            if head_or_embedding:  # also fp32: the embedding lookup, and the LM head the drafters read
                dense[name] = torch.from_numpy(bw.dequantize())
            continue
        w = np.asarray(t.data, dtype=np.float32) if kind in ("F32", "F16") else \
            dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        check_finite(t.name, w, path)
        w = w.reshape(shape)
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        dense[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return cfg, dense, blocks


def load_gguf_quantized(path: str | os.PathLike) -> Llama:
    """An fp32 CPU Llama whose projections (and LM head) run on the GGUF's own blocks (see the module doc)."""
    cfg, dense, blocks = read_gguf_blocks(path)
    panels = {}
    for ours, names in _key_map(cfg).items():
        if not ours.endswith(_PROJECTIONS) and ours != "output.weight":
            continue
        if all(n in blocks for n in names):
            panels[ours] = concat_rows([blocks[n] for n in names]).panels()
        else:  # a part in a format not decoded here: the whole fused weight as fp32
            for n in names:
                if n in blocks:
                    dense[n] = torch.from_numpy(blocks[n].dequantize())
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in blocks:
        panels["output.weight"] = blocks["model.embed_tokens.weight"].panels()
    quantized_layers = {k for k in panels if k != "output.weight"}
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(hf_to_ours(cfg, dense, allow_missing=quantized_layers), strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and n not in quantized_layers]
    if still_meta:
        raise ValueError(f"{path}: the GGUF did not provide {still_meta[:5]}")
    model.use_input_major_weights()
    model.use_packed_cpu_weights()  # the fp32 layers (formats not decoded here)
    model.use_quantized_cpu_weights(panels)
    return model.eval()
