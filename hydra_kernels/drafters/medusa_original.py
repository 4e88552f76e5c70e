"""Original Medusa heads (github.com/FasterDecoding/Medusa, medusa/model/medusa_model.py) as a MedusaDrafter.

A checkpoint is a directory: config.json with medusa_num_heads and medusa_num_layers (MedusaConfig's default: 1)
and the heads' state dict, medusa_lm_head.safetensors (train_legacy.py's save_file) or medusa_lm_head.pt
(torch.save). Head i is nn.Sequential(*[ResBlock(H)] * L, nn.Linear(H, V, bias=False)): its keys are
{i}.{j}.linear.weight [H, H] and {i}.{j}.linear.bias [H] for j < L (one ResBlock object repeated, so the L
positions hold one tensor: x <- x + SiLU(W x + b)) and {i}.{L}.weight [V, H] (a {i}.{L}.bias [V] on every head
is taken too). H and V are read from head 0's LM head. Medusa's own loader is load_state_dict(strict=False);
here a missing, unexpected or mis-shaped tensor is a ValueError naming it, and the config's fields it
contradicts (a hub config that says fewer heads than its weights hold).
"""
from __future__ import annotations

import re
from pathlib import Path

from .checkpoint import config_int, fill_head, original_blocks, read_weights, tensor_problems
from .config import DrafterConfig

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def recognizes(cfg_dict: dict) -> bool:
    return "medusa_num_heads" in cfg_dict


def load_original(cls, path: Path, cfg_dict: dict, model=None):
    """A MedusaDrafter (class `cls`) from an original Medusa checkpoint directory, strictly."""
    cfg_file = path / "config.json"
    n = config_int(cfg_dict, "medusa_num_heads", cfg_file)
    L = config_int(cfg_dict, "medusa_num_layers", cfg_file, default=1)
    sd, name = read_weights(path, WEIGHT_FILES, "an original Medusa config.json (medusa_num_heads)")
    lm = f"0.{L}.weight"
    if lm not in sd or sd[lm].dim() != 2:
        raise ValueError(f"{path / name} has no {lm} [vocab, hidden] (head 0's LM head after medusa_num_layers={L} "
                         f"ResBlocks, {cfg_file}): {_hint(sd, n, L) or 'not Medusa heads'}")
    V, H = sd[lm].shape
    bias = f"0.{L}.bias" in sd
    expected = {}
    for i in range(n):
        for j in range(L):
            expected.update({f"{i}.{j}.linear.weight": (H, H), f"{i}.{j}.linear.bias": (H,)})
        expected[f"{i}.{L}.weight"] = (V, H)
        if bias:
            expected[f"{i}.{L}.bias"] = (V,)
    problems = tensor_problems(sd, expected)
    if problems:
        hint = _hint(sd, n, L)
        raise ValueError(f"{path / name} does not match {cfg_file}{f' ({hint})' if hint else ''}: " + "; ".join(problems))
    blocks, shared = original_blocks(sd, r"(?P<head>\d+)\.(?P<pos>\d+)\.(?P<name>linear\.(weight|bias))", n, L)
    cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=False,
                        lm_head="per_head", lm_head_bias=bias, shared_resblocks=shared)
    drafter = cls(cfg)
    for i in range(n):
        fill_head(drafter, i, blocks[i])
        drafter.heads[i].lm_head.load_state_dict({k.split(".", 2)[2]: v for k, v in sd.items()
                                                  if k.startswith(f"{i}.{L}.")})
    return drafter


def _hint(sd: dict, n: int, L: int) -> str:
    """The config fields the weights contradict: heads and ResBlock positions they hold."""
    keys = [m for k in sd if (m := re.fullmatch(r"(\d+)\.(\d+)\.(.*)", k))]
    heads = 1 + max((int(m[1]) for m in keys), default=-1)
    layers = 1 + max((int(m[2]) for m in keys if m[3].startswith("linear.")), default=-1)
    said = [("medusa_num_heads", n, heads), ("medusa_num_layers", L, layers)]
    return "; ".join(f"{k} is {ours}, the weights hold {theirs}: fix config.json" for k, ours, theirs in said
                     if theirs > 0 and theirs != ours)
