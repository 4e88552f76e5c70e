"""HF <-> our parameter names, from the config alone (no model is built here).

HF keeps q/k/v and gate/up as separate matrices; we fuse them (model/attention.py, model/layers.py):
our `attention.wqkv` is HF's q_proj, k_proj, v_proj concatenated along the output dimension, and
`feed_forward.w13` is gate_proj, up_proj. Every load goes through `hf_to_ours`; `ours_to_hf` goes back
(save_hf_dir, which also caches converted GGUF files as HF dirs).
"""
from __future__ import annotations

import torch

from .config import LlamaConfig


def _hf_layer_keys(i: int) -> dict[str, list[str]]:
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    ours = f"layers.{i}."
    return {
        ours + "attention.wqkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        ours + "attention.wqkv.bias": [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
        ours + "attention.wo.weight": [a + "o_proj.weight"],
        ours + "attention.wo.bias": [a + "o_proj.bias"],
        ours + "feed_forward.w13.weight": [m + "gate_proj.weight", m + "up_proj.weight"],
        ours + "feed_forward.w13.bias": [m + "gate_proj.bias", m + "up_proj.bias"],
        ours + "feed_forward.w2.weight": [m + "down_proj.weight"],
        ours + "feed_forward.w2.bias": [m + "down_proj.bias"],
        ours + "attention_norm.weight": [p + "input_layernorm.weight"],
        ours + "ffn_norm.weight": [p + "post_attention_layernorm.weight"],
    }


def _key_map(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF names concatenated (along dim 0) to make it, biases included."""
    keys = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        keys["output.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        keys.update(_hf_layer_keys(i))
    return keys


def expected_keys(cfg: LlamaConfig) -> set[str]:
    """Names of the parameters a Llama with this config holds (a tied model has no output.weight)."""
    # the map lists every bias; the config says which exist (attention: wqkv, wo; MLP: w13, w2)
    has_bias = lambda k: cfg.attention_bias if ".attention." in k else cfg.mlp_bias
    return {k for k in _key_map(cfg) if not k.endswith(".bias") or has_bias(k)}


def hf_to_ours(cfg: LlamaConfig, hf_sd: dict[str, torch.Tensor], allow_missing=()) -> dict[str, torch.Tensor]:
    """HF-named tensors -> ours (q/k/v and gate/up fused). A ValueError names any missing or unused
    HF tensor; allow_missing: our names not to build (their HF tensors are ignored if present)."""
    out, used = {}, set()
    expected = expected_keys(cfg)
    for ours, names in _key_map(cfg).items():
        if ours not in expected or ours in allow_missing:
            used.update(n for n in names if n in hf_sd)
            continue
        missing = [n for n in names if n not in hf_sd]
        if missing:
            raise ValueError(f"checkpoint is missing {missing} (needed for {ours}); is it a complete Llama?")
        parts = [hf_sd[n] for n in names]
        out[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        used.update(names)
    # A tied checkpoint may still store lm_head.weight; rotary inv_freq buffers are recomputed.
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [k for k in hf_sd if k not in used and k not in ignorable and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ValueError(f"checkpoint has weights this Llama config does not use: {unexpected[:5]}...")
    return out


def ours_to_hf(cfg: LlamaConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> HF-named contiguous tensors (fused matrices split back)."""
    out = {}
    for ours, names in _key_map(cfg).items():
        if ours not in sd:
            continue
        t = sd[ours]
        if len(names) == 1:
            out[names[0]] = t.contiguous()
            continue
        if "wqkv" in ours:
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        else:
            sizes = [cfg.intermediate_size] * 2
        for n, part in zip(names, t.split(sizes, dim=0)):
            out[n] = part.contiguous()
    return out
