"""Medusa heads as vLLM stores them (vllm/model_executor/models/medusa.py, `Medusa`; its config class
vllm/transformers_utils/configs/medusa.py, `MedusaConfig`) as a MedusaDrafter.

config.json: model_type "medusa" or architectures ["MedusaModel"] (how vLLM picks the class), num_heads (default
5), num_hidden_layers (ResBlock layers per head, default 1), hidden_size (4096), vocab_size (32001),
truncated_vocab_size (default vocab_size), medusa_fc_bias (false), original_lm_head (false: an LM head per
head; true: one shared by every head), logit_scale (1.0). As MedusaConfig.from_pretrained does, a key holding
"num" and "heads" (e.g. medusa_num_heads) is read as num_heads, one holding "num" and "layers" as
num_hidden_layers.

Weights: model.safetensors or pytorch_model.bin (or a sharded .index.json of either), names optionally with
"medusa_heads." (dropped, as vLLM does):
- blocks.{i}.layers.{j}.weight [H, H] (+ .bias [H] with medusa_fc_bias): head i's hidden state is h after
  x <- x + SiLU(W_j x + b_j) for each of its layers in turn (each layer its own Linear). h is the base model's
  last hidden state after its final norm, as here.
- lm_heads.{i}.weight [Vt, H], no bias (original_lm_head: one LM head, lm_heads.0.weight or lm_head.weight).
- token_map [Vt] (draft index -> token id) when truncated_vocab_size Vt < vocab_size V: head logits are
  scattered to those ids (every other id -inf); an LM head stored with V rows is cut to token_map's rows, as
  vLLM does. With Vt == V, vLLM ignores a token_map, and so does this loader.
Logits are multiplied by logit_scale; the scale is folded into the LM-head weights (exact: a linear map).
vLLM's own loader skips names it does not know; here a missing, unexpected or mis-shaped tensor is a
ValueError naming it.
"""
from __future__ import annotations

import math
import numbers
from pathlib import Path

import torch

from .checkpoint import config_int, read_weights, tensor_problems
from .config import DrafterConfig
from .fit import draft_vocab_ids

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PREFIX = "medusa_heads."
# vLLM MedusaConfig's defaults, for fields a config.json leaves out
DEFAULTS = dict(hidden_size=4096, vocab_size=32001, num_heads=5, num_hidden_layers=1)


def recognizes(cfg_dict: dict) -> bool:
    archs = cfg_dict.get("architectures") or []
    return "format" not in cfg_dict and (cfg_dict.get("model_type") == "medusa"
                                         or (isinstance(archs, list) and "MedusaModel" in archs))


def vllm_config(cfg_dict: dict) -> dict:
    """config.json's fields as vLLM's MedusaConfig.from_pretrained reads them (renamed head and layer counts)."""
    d = dict(cfg_dict)
    for k in list(d):
        if "num" in k:
            if "heads" in k:
                d["num_heads"] = d.pop(k)
            elif "layers" in k:
                d["num_hidden_layers"] = d.pop(k)
    return {**DEFAULTS, **d}


def load_original(cls, path: Path, cfg_dict: dict, model=None):
    """A MedusaDrafter (class `cls`) from a checkpoint in vLLM's Medusa layout, strictly."""
    cfg_file = path / "config.json"
    c = vllm_config(cfg_dict)
    n, L = config_int(c, "num_heads", cfg_file), config_int(c, "num_hidden_layers", cfg_file)
    H, V = config_int(c, "hidden_size", cfg_file), config_int(c, "vocab_size", cfg_file)
    Vt = c.get("truncated_vocab_size")
    Vt = V if Vt is None else config_int(c, "truncated_vocab_size", cfg_file)
    if Vt > V:
        raise ValueError(f"{cfg_file}: truncated_vocab_size ({Vt}) exceeds vocab_size ({V})")
    scale = c.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{cfg_file}: logit_scale must be a finite number, got {scale!r}")
    flags = {k: c.get(k, False) for k in ("medusa_fc_bias", "original_lm_head")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{cfg_file}: {k} must be true or false, got {v!r}")
    fc_bias, shared = flags["medusa_fc_bias"], flags["original_lm_head"]

    raw, name = read_weights(path, WEIGHT_FILES, "a vLLM Medusa config.json (MedusaModel)")
    source = path / name
    sd = {}
    for k, v in raw.items():
        key = k.replace(PREFIX, "")
        if key in sd:
            raise ValueError(f"{source}: weight {key!r} appears twice (with and without {PREFIX!r})")
        sd[key] = v
    truncated = Vt < V
    if truncated and "token_map" not in sd:
        raise ValueError(f"{source}: truncated_vocab_size {Vt} < vocab_size {V} in {cfg_file} needs a token_map "
                         "tensor (the draft vocabulary's token ids); add it or drop truncated_vocab_size")
    lm_names = _lm_head_names(sd, n, shared, source)
    lm0 = sd.get(lm_names[0])
    rows = V if truncated and lm0 is not None and lm0.shape[0] == V else Vt  # V rows: cut to token_map's, as vLLM does
    expected = {}
    for i in range(n):
        for j in range(L):
            expected[f"blocks.{i}.layers.{j}.weight"] = (H, H)
            if fc_bias:
                expected[f"blocks.{i}.layers.{j}.bias"] = (H,)
    expected.update({k: (rows, H) for k in lm_names})
    if truncated:
        expected["token_map"] = (Vt,)
    ignored = {"token_map": tuple(sd["token_map"].shape)} if not truncated and "token_map" in sd else {}
    problems = tensor_problems(sd, expected, optional=ignored)
    if problems:
        raise ValueError(f"{source} does not match {cfg_file} (num_heads {n}, num_hidden_layers {L}, hidden_size {H}, "
                         f"truncated_vocab_size {Vt}, medusa_fc_bias {fc_bias}, original_lm_head {shared}): "
                         + "; ".join(problems))

    token_map = None
    if truncated:
        tm = sd["token_map"]
        if tm.dtype.is_floating_point or tm.dtype == torch.bool:
            raise ValueError(f"{source}: token_map must hold integer token ids, got {tm.dtype}")
        try:
            token_map = draft_vocab_ids(tm, V)
        except ValueError as e:
            raise ValueError(f"{source}: token_map: {e}") from e
    cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=False,
                        lm_head="shared" if shared else "per_head", draft_vocab_size=Vt if truncated else None)
    drafter = cls(cfg)
    own = drafter.state_dict()
    state = {}
    for i in range(n):
        for j in range(L):
            w = sd[f"blocks.{i}.layers.{j}.weight"]
            state[f"heads.{i}.blocks.{j}.linear.weight"] = w
            state[f"heads.{i}.blocks.{j}.linear.bias"] = sd[f"blocks.{i}.layers.{j}.bias"] if fc_bias else w.new_zeros(H)
    ours = ["shared_lm_head.weight"] if shared else [f"heads.{i}.lm_head.weight" for i in range(n)]
    for k, name in zip(ours, lm_names):
        w = sd[name].float()
        if w.shape[0] != Vt:  # V rows: the draft vocabulary's rows, as vLLM cuts them
            w = w[token_map]
        state[k] = w * scale
    if token_map is not None:
        state["draft_vocab"] = token_map
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})  # strict: every tensor of ours set
    return drafter


def _lm_head_names(sd: dict, n: int, shared: bool, source: Path) -> list[str]:
    """The stored LM-head names: one per head, or the shared one (lm_heads.0.weight or lm_head.weight)."""
    if not shared:
        return [f"lm_heads.{i}.weight" for i in range(n)]
    names = [k for k in ("lm_heads.0.weight", "lm_head.weight") if k in sd]
    if len(names) > 1:
        raise ValueError(f"{source}: original_lm_head stores one LM head, but both lm_heads.0.weight and "
                         "lm_head.weight are present")
    return names or ["lm_heads.0.weight"]
