"""Our drafter checkpoint format, and what the original formats' loaders share.

Ours: config.json ({"format": "hydra_kernels.drafter", "version": 1, "kind": ..., ...config}) +
model.safetensors + tree_<device>.json for each tree searched for the heads + budget_<device>.json for
each budget table searched (hydra_kernels/budget.py). Checkpoints written before
"kind" was recorded (the shipped heads among them) name their family through the config's fields.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..budget import save_tables

FORMAT = "hydra_kernels.drafter"


def save_ours(drafter, path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors (floating tensors stored as `dtype` when given, e.g. bf16 to
    halve a shipped checkpoint) + tree_<device>.json for each tree in drafter.trees."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, "version": 1, "kind": drafter.kind, **drafter.config.to_dict()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    cast = lambda v: v.to(dtype) if dtype is not None and v.is_floating_point() else v  # noqa: E731
    sd = {k: cast(v.detach()).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    for device_kind, tree in getattr(drafter, "trees", {}).items():
        tree.save(path / f"tree_{device_kind}.json")
    save_tables(drafter, path)


def load_ours(cls, path: Path, cfg_dict: dict):
    """A `cls` drafter from our format: config fields -> cls.config_class, weights strictly by name."""
    from safetensors.torch import load_file

    fields = {k: v for k, v in cfg_dict.items() if k not in ("format", "version", "kind")}
    drafter = cls(cls.config_class(**fields))
    sd = load_file(str(path / "model.safetensors"))
    own = drafter.state_dict()
    drafter.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in sd.items()})
    return drafter


def resblock_schedule(blocks: dict[int, dict[str, torch.Tensor]]) -> tuple[list[dict], list[int]]:
    """Sequential positions -> (distinct blocks, schedule); positions holding identical tensors share
    one module (the original Hydra and Medusa code repeat one ResBlock object)."""
    distinct, schedule = [], []
    for pos in sorted(blocks):
        p = blocks[pos]
        for i, q in enumerate(distinct):
            if p.keys() == q.keys() and all(p[k].shape == q[k].shape and torch.equal(p[k], q[k]) for k in p):
                schedule.append(i)
                break
        else:
            distinct.append(p)
            schedule.append(len(distinct) - 1)
    return distinct, schedule


def original_blocks(sd: dict[str, torch.Tensor], pattern: str, num_heads: int, num_layers: int):
    """An original checkpoint's ResBlock tensors by head and position: `pattern` matches a key with the
    named groups head, pos and name (the parameter's name inside the block, e.g. "linear.weight").
    Returns ({head: {pos: {name: tensor}}}, shared): shared when some head repeats one block object."""
    blocks = {i: {} for i in range(num_heads)}
    for k, v in sd.items():
        m = re.fullmatch(pattern, k)
        if m:
            blocks[int(m["head"])].setdefault(int(m["pos"]), {})[m["name"]] = v
    shared = max(len(resblock_schedule(blocks[i])[0]) for i in range(num_heads)) < num_layers
    return blocks, shared


def fill_head(drafter, i: int, blocks: dict[int, dict[str, torch.Tensor]]) -> None:
    """Load head i's ResBlocks from an original checkpoint's per-position tensors."""
    distinct, schedule = resblock_schedule(blocks)
    head = drafter.heads[i]
    if schedule != head.schedule:  # sharing in a pattern neither original code nor we produce
        raise ValueError(f"head {i}: ResBlock sharing {schedule} differs from the expected {head.schedule}")
    for b, params in enumerate(distinct):
        head.blocks[b].load_state_dict(params)
