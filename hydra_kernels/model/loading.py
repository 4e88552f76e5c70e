"""Weights in: HF directories (config.json + *.safetensors, sharded too) and transformers objects.

HF keeps q/k/v and gate/up as separate matrices; we fuse them (model/layers.py), so every load goes
through `hf_to_ours`, and `ours_to_hf` goes back (used to cache converted GGUF files as HF dirs).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import LlamaConfig
from .llama import Llama


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
    """Our parameter name -> the HF names concatenated (along dim 0) to make it."""
    keys = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        keys["output.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        keys.update(_hf_layer_keys(i))
    return keys


def hf_to_ours(cfg: LlamaConfig, hf_sd: dict[str, torch.Tensor], allow_missing=()) -> dict[str, torch.Tensor]:
    out, used = {}, set()
    expected = Llama.expected_keys(cfg)
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


def ours_to_hf(model: Llama) -> dict[str, torch.Tensor]:
    cfg, sd = model.config, model.state_dict()
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


def build_model(cfg: LlamaConfig, hf_sd: dict[str, torch.Tensor], *, dtype=None, device=None) -> Llama:
    """A Llama holding the given HF-named weights, without a throwaway random initialisation."""
    with torch.device("meta"):
        model = Llama(cfg)
    sd = hf_to_ours(cfg, hf_sd)
    if dtype is not None or device is not None:
        sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter
    if model.device.type == "cpu":
        # Input-major weights: MKL's M = 1 GEMV streams them ~2x faster (the fallback where the packed
        # kernel is unavailable). Then the packed small-M kernel for decode and verify steps: as fast as
        # MKL at M = 1 (~24 GB/s on 2 cores) and ~1.1x, not ~2x, the M = 1 time at M = 6 (a 6-node tree
        # verify step), with every row bit-identical to its M = 1 result (model/packed_linear.py).
        model.use_input_major_weights()
        model.use_packed_cpu_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"checkpoint did not provide {still_meta[:5]}")
    return model.eval()


def llama_from_hf_model(hf_model) -> Llama:
    cfg = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return build_model(cfg, sd)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors checkpoints are read)")
    sd = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    return sd


def load_hf_dir(path: str | os.PathLike, *, dtype=None, device=None) -> Llama:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json: expected an HF model directory or a .gguf file")
    cfg = LlamaConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    return build_model(cfg, read_safetensors_dir(path), dtype=dtype, device=device)


def save_hf_dir(model: Llama, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors readable by load_hf_dir and by transformers."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file(ours_to_hf(model), str(path / "model.safetensors"), metadata={"format": "pt"})
