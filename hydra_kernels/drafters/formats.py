"""Drafter checkpoints: our format, the original Hydra format and the original Medusa format.

Ours: config.json ({"format": "hydra_kernels.drafter", ...DrafterConfig}) + model.safetensors.
Hydra (github.com/zankner/Hydra): config.json with hydra_num_heads, hydra_num_layers, hydra_head_arch
("mlp" | "prefix-mlp"), grounded_heads; hydra_lm_head.pt holding hydra_mlp.{i}.{j}.(linear|res_connection).*,
hydra_lm_head.{i}[.1].weight/bias and, for prefix-mlp, prefix_embeding_layer.* (a one-layer LlamaModel).
Medusa: config.json with medusa_num_heads, medusa_num_layers; medusa_lm_head.(pt|safetensors) holding
{head}.{layer}.linear.weight/bias and {head}.{num_layers}.weight.
In both originals a head's repeated ResBlocks are one module object, so several keys hold one tensor.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .config import DrafterConfig
from .heads import Drafter

FORMAT = "hydra_kernels.drafter"


def save_drafter(drafter: Drafter, path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors (floating tensors stored as `dtype` when given, e.g. bf16 to
    halve a shipped checkpoint) + tree_<device>.json for each tree in drafter.trees."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"format": FORMAT, "version": 1, **drafter.config.to_dict()}, indent=2))
    cast = lambda v: v.to(dtype) if dtype is not None and v.is_floating_point() else v  # noqa: E731
    sd = {k: cast(v.detach()).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    for device_kind, tree in getattr(drafter, "trees", {}).items():
        tree.save(path / f"tree_{device_kind}.json")


def _load_ours(path: Path, cfg_dict: dict) -> Drafter:
    from safetensors.torch import load_file

    cfg = DrafterConfig(**{k: v for k, v in cfg_dict.items() if k not in ("format", "version")})
    drafter = Drafter(cfg)
    sd = load_file(str(path / "model.safetensors"))
    own = drafter.state_dict()
    drafter.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in sd.items()})
    return drafter


def _base_config(cfg_dict: dict, model) -> dict:
    if model is not None:
        return model.config.to_hf_dict(include_extra=False)
    if "num_attention_heads" in cfg_dict and "hidden_size" in cfg_dict:
        return {"model_type": "llama", **cfg_dict}
    raise ValueError("this Hydra checkpoint has a prefix layer but its config.json lacks the base model's "
                     "Llama fields; pass the base model: hk.load_drafter(path, model=model)")


def _resblock_schedule(blocks: dict[int, dict[str, torch.Tensor]]) -> tuple[list[dict], list[int]]:
    """Sequential positions -> (distinct blocks, schedule); positions holding identical tensors share."""
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


def _fill_head(drafter: Drafter, i: int, blocks: dict[int, dict[str, torch.Tensor]]) -> None:
    distinct, schedule = _resblock_schedule(blocks)
    head = drafter.heads[i]
    if schedule != head.schedule:  # sharing in a pattern neither original code nor we produce
        raise ValueError(f"head {i}: ResBlock sharing {schedule} differs from the expected {head.schedule}")
    for b, params in enumerate(distinct):
        head.blocks[b].load_state_dict(params)


def _load_hydra(path: Path, cfg_dict: dict, model) -> Drafter:
    n, L = cfg_dict["hydra_num_heads"], cfg_dict["hydra_num_layers"]
    arch = cfg_dict.get("hydra_head_arch", "mlp")
    if arch not in ("mlp", "prefix-mlp"):
        raise NotImplementedError(f"hydra_head_arch {arch!r} is not supported (only 'mlp' and 'prefix-mlp')")
    grounded = bool(cfg_dict.get("grounded_heads", True))
    sd = torch.load(path / "hydra_lm_head.pt", map_location="cpu", weights_only=True)
    lm_key = "hydra_lm_head.{}.1" if arch == "prefix-mlp" else "hydra_lm_head.{}"  # Dropout at index 0
    lm_w = sd[lm_key.format(0) + ".weight"]
    V, H = lm_w.shape
    blocks = {i: {} for i in range(n)}
    for k, v in sd.items():
        m = re.fullmatch(r"hydra_mlp\.(\d+)\.(\d+)\.(linear|res_connection)\.(weight|bias)", k)
        if m:
            blocks[int(m[1])].setdefault(int(m[2]), {})[f"{m[3]}.{m[4]}"] = v
    distinct_counts = {len(_resblock_schedule(blocks[i])[0]) for i in range(n)}
    shared = max(distinct_counts) < L
    cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=grounded,
                        prefix_layer=arch == "prefix-mlp", lm_head="per_head", lm_head_bias=lm_key.format(0) + ".bias" in sd,
                        shared_resblocks=shared,
                        base_config=_base_config(cfg_dict, model) if arch == "prefix-mlp" else None)
    drafter = Drafter(cfg)
    for i in range(n):
        _fill_head(drafter, i, blocks[i])
        lm = drafter.heads[i].lm_head
        lm.weight.data.copy_(sd[lm_key.format(i) + ".weight"])
        if lm.bias is not None:
            lm.bias.data.copy_(sd[lm_key.format(i) + ".bias"])
    if drafter.prefix is not None:
        from ..model.hf_names import hf_to_ours

        pre = {k[len("prefix_embeding_layer."):]: v for k, v in sd.items() if k.startswith("prefix_embeding_layer.")}
        hf = {"model." + k: v for k, v in pre.items() if not k.startswith("embed_tokens")}
        ours = hf_to_ours(drafter.prefix.config, {**hf, "model.embed_tokens.weight": torch.zeros(1)},
                          allow_missing={"tok_embeddings.weight", "output.weight"})
        drafter.prefix.block.load_state_dict({k[len("layers.0."):]: v for k, v in ours.items() if k.startswith("layers.0.")})
        drafter.prefix.norm.load_state_dict({"weight": ours["norm.weight"]})
    return drafter


def _load_medusa(path: Path, cfg_dict: dict) -> Drafter:
    n, L = cfg_dict["medusa_num_heads"], cfg_dict["medusa_num_layers"]
    if (path / "medusa_lm_head.safetensors").exists():
        from safetensors.torch import load_file

        sd = load_file(str(path / "medusa_lm_head.safetensors"))
    else:
        sd = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    V, H = sd[f"0.{L}.weight"].shape
    blocks = {i: {} for i in range(n)}
    for k, v in sd.items():
        m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", k)
        if m:
            blocks[int(m[1])].setdefault(int(m[2]), {})[f"linear.{m[3]}"] = v
    shared = max(len(_resblock_schedule(blocks[i])[0]) for i in range(n)) < L
    cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=False,
                        lm_head="per_head", lm_head_bias=f"0.{L}.bias" in sd, shared_resblocks=shared)
    drafter = Drafter(cfg)
    for i in range(n):
        _fill_head(drafter, i, blocks[i])
        drafter.heads[i].lm_head.load_state_dict({k.split(".", 2)[2]: v for k, v in sd.items()
                                                  if k.startswith(f"{i}.{L}.")})
    return drafter


def load_drafter_dir(path, model=None) -> Drafter:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json: expected a drafter directory")
    cfg_dict = json.loads(cfg_file.read_text())
    if cfg_dict.get("format") == FORMAT:
        drafter = _load_ours(path, cfg_dict)
    elif "hydra_num_heads" in cfg_dict:
        drafter = _load_hydra(path, cfg_dict, model)
    elif "medusa_num_heads" in cfg_dict:
        drafter = _load_medusa(path, cfg_dict)
    else:
        raise ValueError(f"{cfg_file} is neither a hydra_kernels drafter, a Hydra checkpoint (hydra_num_heads) "
                         "nor a Medusa checkpoint (medusa_num_heads)")
    drafter.eval()
    from ..tree import Tree

    drafter.trees = {f.stem[len("tree_"):]: Tree.load(f) for f in sorted(path.glob("tree_*.json"))}
    if model is not None:
        drafter.to(model.device, model.dtype)
    return drafter
