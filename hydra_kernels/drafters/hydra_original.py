"""Original Hydra heads (github.com/zankner/Hydra: hydra/model/hydra_model.py, hydra_heads/mlp_head.py and
prefix_mlp_head.py) as a HydraDrafter (grounded heads) or a MedusaDrafter (grounded_heads false).

A checkpoint is a directory: config.json (HydraConfig: hydra_num_heads, default 4; hydra_num_layers, default 1;
hydra_head_arch "mlp" (default) | "prefix-mlp" ("cross-attn" and "eagle-attn" are not supported);
grounded_heads, default false) and hydra_lm_head.pt, torch.save of the hydra_head module's state dict:
- hydra_mlp.{i}: head i's ResBlocks, y = R x + SiLU(W x + b). Grounded, the first reads cat(h, E(x_0..x_i))
  ((i + 2) H wide: linear and res_connection [H, (i + 2) H] + biases), then one ResBlock(H) object repeated
  L - 1 times (linear [H, H] + bias; R the identity); ungrounded, one ResBlock(H) repeated L times. "prefix-mlp"
  puts a Dropout before each ResBlock, so the blocks sit at positions 1, 3, ..., 2L - 1 (else 0 .. L - 1).
- hydra_lm_head.{i}: nn.Linear(H, V) (weight [V, H], bias [V]); "prefix-mlp": hydra_lm_head.{i}.1 (a Dropout at 0).
- "prefix-mlp" also: prefix_embeding_layer.*, a one-layer transformers LlamaModel of the base config
  (embed_tokens, layers.0, norm; drafters/prefix.py).
HydraConfig's hidden_state_offset only selects training data; inference reads the last hidden state, as here.
Hydra's own loader is load_state_dict(strict=False); here a missing, unexpected or mis-shaped tensor is a
ValueError naming it.
"""
from __future__ import annotations

from pathlib import Path

from .checkpoint import config_int, fill_head, original_blocks, read_weights, tensor_problems
from .config import DrafterConfig

WEIGHT_FILES = ("hydra_lm_head.pt",)
ARCHS = ("mlp", "prefix-mlp")
PREFIX = "prefix_embeding_layer."  # sic: the original attribute's spelling


def recognizes(cfg_dict: dict) -> bool:
    return "hydra_num_heads" in cfg_dict


def load_original(hydra_cls, medusa_cls, path: Path, cfg_dict: dict, model=None):
    """A drafter from an original Hydra checkpoint directory, strictly: `hydra_cls` for grounded heads,
    `medusa_cls` (Medusa heads, with the prefix layer for "prefix-mlp") for grounded_heads false."""
    cfg_file = path / "config.json"
    n = config_int(cfg_dict, "hydra_num_heads", cfg_file, default=4)
    L = config_int(cfg_dict, "hydra_num_layers", cfg_file, default=1)
    arch = cfg_dict.get("hydra_head_arch", "mlp")
    if arch not in ARCHS:
        raise ValueError(f"{cfg_file}: hydra_head_arch {arch!r} is not supported (only {ARCHS})")
    grounded = cfg_dict.get("grounded_heads", False)
    if not isinstance(grounded, bool):
        raise ValueError(f"{cfg_file}: grounded_heads must be true or false, got {grounded!r}")
    sd, name = read_weights(path, WEIGHT_FILES, "an original Hydra config.json (hydra_num_heads)")
    source = path / name
    prefix = arch == "prefix-mlp"
    lm_key = "hydra_lm_head.{}.1" if prefix else "hydra_lm_head.{}"  # Dropout at index 0
    lm0 = lm_key.format(0) + ".weight"
    if lm0 not in sd or sd[lm0].dim() != 2:
        raise ValueError(f"{source} has no {lm0} [vocab, hidden] (head 0's LM head for hydra_head_arch {arch!r}, "
                         f"{cfg_file}): not Hydra heads of that architecture")
    V, H = sd[lm0].shape
    step, first = (2, 1) if prefix else (1, 0)  # block positions: first + step * j
    expected = {}
    for i in range(n):
        for j in range(L):
            pos, wide = first + step * j, grounded and j == 0
            width = (i + 2) * H if wide else H
            for part in ("linear", "res_connection") if wide else ("linear",):
                expected.update({f"hydra_mlp.{i}.{pos}.{part}.weight": (H, width), f"hydra_mlp.{i}.{pos}.{part}.bias": (H,)})
        expected[lm_key.format(i) + ".weight"] = (V, H)
        if lm_key.format(0) + ".bias" in sd:
            expected[lm_key.format(i) + ".bias"] = (V,)
    heads_sd = {k: v for k, v in sd.items() if not k.startswith(PREFIX)}
    problems = tensor_problems(heads_sd, expected)
    if prefix and not any(k.startswith(PREFIX) for k in sd):
        problems.append(f"missing {PREFIX}* (the prefix layer of hydra_head_arch 'prefix-mlp')")
    if not prefix and len(heads_sd) < len(sd):
        problems.append(f"unexpected {PREFIX}* (a prefix layer, but hydra_head_arch is {arch!r})")
    if problems:
        hint = _hint(sd, grounded, first, n)
        raise ValueError(f"{source} does not match {cfg_file}{f' ({hint})' if hint else ''}: " + "; ".join(problems))
    pattern = r"hydra_mlp\.(?P<head>\d+)\.(?P<pos>\d+)\.(?P<name>(linear|res_connection)\.(weight|bias))"
    blocks, shared = original_blocks(sd, pattern, n, L)
    cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=grounded,
                        prefix_layer=prefix, lm_head="per_head", lm_head_bias=lm_key.format(0) + ".bias" in sd,
                        shared_resblocks=shared, base_config=_base_config(cfg_dict, model, cfg_file) if prefix else None)
    drafter = (hydra_cls if grounded else medusa_cls)(cfg)
    for i in range(n):
        fill_head(drafter, i, blocks[i])
        lm = drafter.heads[i].lm_head
        lm.weight.data.copy_(sd[lm_key.format(i) + ".weight"])
        if lm.bias is not None:
            lm.bias.data.copy_(sd[lm_key.format(i) + ".bias"])
    if drafter.prefix is not None:
        try:
            drafter.prefix.load_hf_layer({k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)})
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"{source}: the prefix layer ({PREFIX}*) is not a one-layer Llama of the base model's "
                             f"shape: {e}") from e
    return drafter


def _hint(sd: dict, grounded: bool, first: int, n: int) -> str:
    """The config fields the weights contradict: grounded_heads (a first block over the path's embeddings) and
    hydra_num_heads."""
    hints = []
    if (f"hydra_mlp.0.{first}.res_connection.weight" in sd) != grounded:
        hints.append(f"grounded_heads is {str(grounded).lower()} (HydraConfig's default when absent: false), the "
                     f"weights' heads are {'' if not grounded else 'not '}grounded: fix config.json")
    heads = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("hydra_mlp.")), default=-1)
    if heads > 0 and heads != n:
        hints.append(f"hydra_num_heads is {n}, the weights hold {heads}: fix config.json")
    return "; ".join(hints)


def _base_config(cfg_dict: dict, model, cfg_file: Path) -> dict:
    if model is not None:
        return model.config.to_hf_dict(include_extra=False)
    if "num_attention_heads" in cfg_dict and "hidden_size" in cfg_dict:
        return {"model_type": "llama", **cfg_dict}
    raise ValueError(f"this Hydra checkpoint has a prefix layer but {cfg_file} lacks the base model's Llama fields; "
                     "pass the base model: hk.load_drafter(path, model=model)")
