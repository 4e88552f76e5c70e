"""Our drafter checkpoint format, and what every format's loader shares: reading a drafter directory's files
(each refused by name when it is unreadable) and strict weight checks (every missing, unexpected or
mis-shaped tensor named).

Ours: config.json ({"format": "hydra_kernels.drafter", "version": 1, "kind": ..., ...config}) +
model.safetensors + tree_<device>.json for each tree searched for the heads + budget_<device>.json for
each budget table searched (hydra_kernels/budget.py). Checkpoints written before
"kind" was recorded (the shipped heads among them) name their family through the config's fields.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from ..budget import save_tables
from .config import DrafterConfig

FORMAT = "hydra_kernels.drafter"
VERSION = 1
WEIGHTS = "model.safetensors"
OUR_KEYS = ("format", "version", "kind")  # config.json's keys that are not config fields
CORRUPT = "the checkpoint is corrupt: save or download it again"


# ---- reading a drafter directory's files --------------------------------------------------------------
def read_json(file) -> object:
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(Path(file).read_text())
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{file} is not valid JSON ({e}); {CORRUPT}") from e


def read_config(file) -> dict:
    """A checkpoint's config.json: a JSON object (FileNotFoundError when absent, ValueError naming the file)."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent} has no config.json: expected a drafter directory")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} holds JSON {type(cfg).__name__}, not an object of config fields; {CORRUPT}")
    return cfg


def read_tensors(file) -> dict[str, torch.Tensor]:
    """Every tensor of one weights file: safetensors (.safetensors) or a torch.save'd state dict (.pt, .bin;
    tensors only). ValueError naming the file when it is unreadable (truncated, garbled), holds anything but
    named tensors, or a floating tensor holds NaN or inf; FileNotFoundError when it is absent."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: the checkpoint in {file.parent} is incomplete")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(file))
        else:
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' SafetensorError; torch.load's pickle, zip and EOF errors
        raise ValueError(f"{file} is not a readable weights file ({type(e).__name__}: {e}); {CORRUPT}") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{file} does not hold a state dict (names -> tensors); {CORRUPT}")
    for k, v in sd.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            n = int((~torch.isfinite(v)).sum())
            raise ValueError(f"{file}: weight {k!r} holds {n} non-finite value(s) (NaN or inf); {CORRUPT}")
    return sd


def read_weights(path: Path, names: tuple[str, ...], what: str) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint directory: the first of `names` present, or its sharded form (<name>.index.json
    and the shard files its weight_map names) -> (tensors, the file read). FileNotFoundError saying which files
    `what` (e.g. "an mlp_speculator config.json") needs when there is none."""
    for name in names:
        if (path / name).exists():
            return read_tensors(path / name), name
        index = path / f"{name}.index.json"
        if index.exists():
            meta = read_json(index)
            weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{index} has no weight_map (tensor name -> shard file); {CORRUPT}")
            sd = {}
            for f in sorted(set(weight_map.values())):
                sd.update(read_tensors(path / f))
            return sd, index.name
    raise FileNotFoundError(f"{path} has {what} but no weights: expected {' or '.join(names)} (or a sharded "
                            ".index.json of either)")


def config_int(cfg_dict: dict, key: str, cfg_file: Path, default: int | None = None, low: int = 1) -> int:
    """An integer field of an original checkpoint's config.json (`default` where absent, as its own config class
    has it); ValueError naming the file and the field."""
    if key not in cfg_dict and default is None:
        raise ValueError(f"{cfg_file} has no {key!r}: add it (an int >= {low})")
    v = cfg_dict.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{cfg_file}: {key} must be an int >= {low}, got {v!r}")
    return v


# ---- strict weights -----------------------------------------------------------------------------------
def _names(keys: list[str], most: int = 6) -> str:
    shown = ", ".join(keys[:most])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > most else "")


def tensor_problems(found: dict[str, torch.Tensor], expected: dict[str, tuple], optional: dict[str, tuple] | None = None,
                    ) -> list[str]:
    """Every tensor of `found` missing from `expected`, unexpected (in neither `expected` nor `optional`) or
    mis-shaped, as phrases ("missing a, b"; "unexpected c"; "mis-shaped d [3, 4] (expected [4, 4])")."""
    optional = optional or {}
    shapes = {**optional, **expected}
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in shapes]
    bad = [f"{k} {list(found[k].shape)} (expected {list(shapes[k])})" for k in found
           if k in shapes and tuple(found[k].shape) != tuple(shapes[k])]
    return ([f"missing {_names(missing)}"] if missing else []) + ([f"unexpected {_names(unexpected)}"] if unexpected
                                                                  else []) + ([f"mis-shaped {_names(bad)}"] if bad else [])


# ---- our format -----------------------------------------------------------------------------------------
def init_fields(config_class) -> dict[str, dataclasses.Field]:
    """A config dataclass's constructor fields by name."""
    return {f.name: f for f in dataclasses.fields(config_class) if f.init}


def config_from(cls, cfg_dict: dict, cfg_file: Path):
    """cls.config_class from config.json's fields; ValueError naming the file and the unknown, missing or bad field."""
    fields = {k: v for k, v in cfg_dict.items() if k not in OUR_KEYS}
    known = init_fields(cls.config_class)
    unknown = sorted(set(fields) - set(known))
    missing = sorted(n for n, f in known.items() if n not in fields and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    kind = cfg_dict.get("kind", cls.kinds[0])
    if unknown or missing:
        what = "; ".join(([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else []))
        raise ValueError(f"{cfg_file}: {what} for a {kind!r} drafter (its fields: {sorted(known)}); fix config.json")
    for name, value in fields.items():
        _check_type(cfg_file, name, value, known[name].type)
    try:
        cfg = cls.config_class(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: {e}") from e
    described = getattr(cfg, "kind", None)  # head configs name their kind through their fields
    if described is not None and "kind" in cfg_dict and described != kind:
        raise ValueError(f"{cfg_file}: \"kind\" is {kind!r}, but its fields (grounded {json.dumps(cfg.grounded)}, "
                         f"prefix_layer {json.dumps(cfg.prefix_layer)}) describe a {described!r} drafter; fix \"kind\" "
                         "or those fields")
    return cfg


_SIMPLE = {"int": int, "bool": bool, "float": (int, float), "str": str}  # JSON's scalars by annotation


def _check_type(cfg_file: Path, name: str, value, annotation) -> None:
    """A scalar config field (annotated int, bool, float or str, optionally | None) holds that type (a bool is no number)."""
    ann = str(annotation).replace(" ", "")
    optional = ann.endswith("|None")
    base = ann[: -len("|None")] if optional else ann
    if base not in _SIMPLE or (value is None and optional):
        return
    if not isinstance(value, _SIMPLE[base]) or (base != "bool" and isinstance(value, bool)):
        article = "an" if base[0] in "aeiou" else "a"
        raise ValueError(f"{cfg_file}: {name} must be {article} {base}{' or null' if optional else ''}, got {value!r}; "
                         "fix config.json")


def _head_fields(cfg: DrafterConfig, sd: dict[str, torch.Tensor]) -> list[str]:
    """The fields of a head drafter's config.json its weights contradict, each with what the weights hold."""
    def indices(pattern):
        return {int(m[1]) for k in sd if (m := re.match(pattern, k))}

    heads, blocks = indices(r"heads\.(\d+)\."), indices(r"heads\.0\.blocks\.(\d+)\.")
    lm = "per_head" if "heads.0.lm_head.weight" in sd else "shared" if "shared_lm_head.weight" in sd else "tied"
    grounded = "heads.0.blocks.0.res_connection.weight" in sd
    draft_vocab = sd["draft_vocab"].shape[0] if "draft_vocab" in sd else None
    first = sd.get("heads.0.blocks.0.linear.weight")
    said = [("num_heads", cfg.num_heads, max(heads) + 1 if heads else None, "heads"),
            ("num_layers", cfg.num_layers, max(blocks) + 1 if blocks and not cfg.shared_resblocks else None,
             "ResBlocks per head"),
            ("grounded", cfg.grounded, grounded if heads else None, "(a first block over the path's embeddings)"),
            ("lm_head", cfg.lm_head, lm if heads else None, "LM heads"),
            ("prefix_layer", cfg.prefix_layer, any(k.startswith("prefix.") for k in sd), "(a prefix layer)"),
            ("draft_vocab_size", cfg.draft_vocab_size, draft_vocab, "draft tokens"),
            ("hidden_size", cfg.hidden_size, first.shape[0] if first is not None else None, "hidden units")]
    return [f"{name} is {json.dumps(ours)}, the weights hold {json.dumps(theirs)} {unit}" for name, ours, theirs, unit
            in said if theirs is not None and theirs != ours]


def load_ours(cls, path: Path, cfg_dict: dict):
    """A `cls` drafter from our format: config fields -> cls.config_class, weights strictly by name and shape.
    A config that does not describe the weights is a ValueError naming both files and the fields at odds."""
    cfg_file, weights = path / "config.json", path / WEIGHTS
    cfg = config_from(cls, cfg_dict, cfg_file)
    try:
        drafter = cls(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: {e}") from e
    sd = read_tensors(weights)
    own = drafter.state_dict()
    problems = tensor_problems(sd, {k: tuple(v.shape) for k, v in own.items()})
    if problems:
        fields = _head_fields(cfg, sd) if isinstance(cfg, DrafterConfig) else []
        why = f" ({'; '.join(fields)}: fix config.json)" if fields else ""
        raise ValueError(f"{weights} does not match {cfg_file}{why}: " + "; ".join(problems))
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()})
    return drafter


def save_ours(drafter, path, dtype: torch.dtype | None = None) -> None:
    """config.json + model.safetensors (floating tensors stored as `dtype` when given, e.g. bf16 to
    halve a shipped checkpoint) + tree_<device>.json for each tree in drafter.trees."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, "version": VERSION, "kind": drafter.kind, **drafter.config.to_dict()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    cast = lambda v: v.to(dtype) if dtype is not None and v.is_floating_point() else v  # noqa: E731
    sd = {k: cast(v.detach()).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(path / WEIGHTS), metadata={"format": "pt"})
    for device_kind, tree in getattr(drafter, "trees", {}).items():
        tree.save(path / f"tree_{device_kind}.json")
    save_tables(drafter, path)


# ---- the original Hydra and Medusa formats' ResBlocks -------------------------------------------------
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
