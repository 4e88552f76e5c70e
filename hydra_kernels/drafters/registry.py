"""The drafter families by kind, and the checkpoint formats each one recognises.

hk.new_drafter(model, kind=...) and hk.load_drafter(path) go through here; a new family is one module
under drafters/ plus its entry in FAMILIES.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .amphista import AmphistaDrafter
from .checkpoint import (FORMAT, OUR_KEYS, VERSION, config_from, init_fields, load_ours, read_config,
                         read_json)
from .combined import CombinedDrafter
from .config import DrafterConfig
from .eagle import EagleDrafter
from .hydra import HydraDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .mlp_speculator import MLPSpeculatorDrafter
from .ngram import NgramConfig, NgramDrafter
from ..acceptance_prior import load_prior
from ..budget import load_tables
from ..tree import Tree, as_tree
from .protocol import Drafter

FAMILIES: tuple[type[Drafter], ...] = (MedusaDrafter, HydraDrafter, EagleDrafter, MLPSpeculatorDrafter, AmphistaDrafter,
                                      NgramDrafter, LookaheadDrafter, CombinedDrafter)
KINDS: tuple[str, ...] = tuple(k for cls in FAMILIES for k in cls.kinds)
# kinds only original checkpoints produce (Hydra's prefix-mlp with grounded_heads false)
_EXTRA_KINDS = {"medusa+prefix": MedusaDrafter}

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "heads"
SHIPPED_MODEL = "smollm2-135m-instruct"  # the embedded default (hk.load_model())
SHIPPED_SHAPE = (49152, 576)  # its (vocab_size, hidden_size): a model of other shapes cannot take the shipped drafters
# load_drafter() takes the kind named in <SHIPPED_DIR>/<SHIPPED_MODEL>/default.json, the fastest measured
# (python/ship_heads.py --default KIND --measured "..." writes it); without that file, the first shipped
# kind in this order
SHIPPED_PREFERENCE = ("hydra++", "hydra", "medusa")
# kinds load_drafter(kind=...) builds from shipped parts (no weights of their own; budget tables in
# composed_tables_dir): "combined" is the n-gram drafter beside the shipped heads default.json names
# (_shipped_combined: its "heads" when the default kind is combined, else the default kind), which must be one of
# STATIC_TREE_KINDS
COMPOSED = ("combined",)
STATIC_TREE_KINDS = ("medusa", "hydra", "hydra++", "amphista")  # one Tree per step (CombinedDrafter's heads)
# the composed combined drafter's nodes per step, root included: on the CPU a verify costs more per node, and
# whole parts (3 + 10 nodes) lost on answers with little to copy: make demo's prompt, batch 1, Xeon VM,
# 2026-11-27 (benchmarks/bench_one_prompt.py): 0.99x plain whole, 1.08x at 6 nodes (Hydra alone 1.14x); on
# MT-Bench both ~1.8x plain (benchmarks/results/README.md)
COMBINED_NODE_BUDGET = 6
DEFAULT_FILE = "default.json"
# the recipe that trains each family (named when a kind is asked for but not shipped)
RECIPES = {"medusa": "python/train_heads.py", "hydra": "python/train_heads.py", "hydra++": "python/train_heads.py",
           "eagle": "python/train_eagle.py", "mlp_speculator": "python/train_mlp_speculator.py",
           "amphista": "python/train_amphista.py"}


def family(kind: str) -> type[Drafter]:
    """The class serving `kind` (ValueError naming the known kinds otherwise)."""
    for cls in FAMILIES:
        if kind in cls.kinds:
            return cls
    if kind in _EXTRA_KINDS:
        return _EXTRA_KINDS[kind]
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def new_drafter(model, kind: str = "hydra", **options) -> Drafter:
    """An untrained drafter of `kind` for `model` (same device and dtype).

    Head kinds ("medusa", "hydra", "hydra++") take num_heads=4, num_layers=1 (ResBlocks per head),
    lm_head "tied" (reuses the base model's LM head: small checkpoints, cheap training) | "per_head" |
    "shared", lm_head_bias, draft_vocab (token ids the heads may propose, e.g.
    hk.training.draft_vocabulary's most frequent; their LM head then reads only those rows),
    prefix_final_norm (Hydra++: False drops the prefix layer's final RMSNorm, so the fresh drafter's
    heads see exactly the base h).
    "mlp_speculator" (IBM's MLPSpeculator: a chain of MLP stages fed the previous stage's token; its own tree
    per sequence and step) takes n_predict=3, inner_dim=0 (the model's width), top_k_tokens_per_head (one k
    per stage, default [4, 3, 2, 2, ...]), n_candidates (suffixes kept, default min(8, prod of the ks)),
    tie_weights, scale_input, draft_vocab.
    "amphista" (AMD's Amphista: Medusa-style heads from the last committed position, fed by two staged causal
    adaptation layers over the base states and the sampled token, mixed by one bi-directional block across the
    heads; a static tree, all depths in one pass) takes num_heads=4, draft_vocab, lm_head "tied" (the base LM
    head's draft-vocabulary rows) | "low_rank" (lm_head_rank=256), stage_split (heads fed by the first
    adaptation layer, default ceil(num_heads / 2)).
    "ngram" (prompt lookup, no weights) takes max_ngram=4, min_ngram=1, num_tokens=10, num_branches=1.
    "lookahead" (Jacobi lookahead + n-gram pool, no weights; greedy only) takes window=4, ngram=3, guesses=4.
    "eagle" (one draft decoder layer over the base features) takes draft_vocab, tree (its default
    DynamicTree or dict(total_tokens=8, depth=4, top_k=4)), input_norm / final_norm (False: EAGLE-1's layer).
    "combined" takes drafters=[an ngram drafter, a trained drafter] (e.g. hk.load_drafter(model=model), the
    shipped heads), node_budget, strong_match (see CombinedDrafter)."""
    cls = family(kind)
    if kind not in cls.kinds:
        raise ValueError(f"kind {kind!r} comes only from original checkpoints; new drafters: {KINDS}")
    return cls.new(model, kind, **options)


def shipped_drafters() -> dict[str, Path]:
    """kind -> directory of the heads shipped inside the package for the embedded default model."""
    root = SHIPPED_DIR / SHIPPED_MODEL
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").exists()} if root.is_dir() else {}


def check_default_entry(entry, shipped) -> tuple[str, str, str]:
    """A default.json entry checked against the shipped kinds -> (default kind, batch-1 kind, heads kind: the
    static-tree kind a composed kind is built over); ValueError saying what is wrong. python/ship_heads.py
    checks an entry with it before writing one."""
    try:
        kind = entry["kind"]
        one = entry["batch_1"]["kind"] if "batch_1" in entry else kind
        heads = entry["heads"] if kind in COMPOSED else kind
        if not all(isinstance(k, str) for k in (kind, one, heads)):
            raise TypeError(f"kinds are strings, got {[kind, one, heads]!r}")
    except (KeyError, TypeError) as e:
        raise ValueError(f"must be JSON with a 'kind' (a composed kind {COMPOSED} also 'heads'; a 'batch_1' entry "
                         f"its own 'kind') ({e!r})") from e
    if heads not in shipped:
        what = f" as the heads of {kind!r}" if kind in COMPOSED else ""
        raise ValueError(f"names {heads!r}{what}, which is not shipped ({sorted(shipped)})")
    if one not in shipped and one not in COMPOSED:
        raise ValueError(f"names {one!r} for batch 1, which is neither shipped ({sorted(shipped)}) nor composed {COMPOSED}")
    if (kind in COMPOSED or one in COMPOSED) and heads not in STATIC_TREE_KINDS:
        raise ValueError(f"composes {COMPOSED} over {heads!r}, which drafts no static tree (needed: one of "
                         f"{STATIC_TREE_KINDS})")
    return kind, one, heads


def _default_entry() -> tuple[str, str, str]:
    """default.json read and checked (check_default_entry). Without the file: the first shipped kind of
    SHIPPED_PREFERENCE for all three."""
    shipped = shipped_drafters()
    f = SHIPPED_DIR / SHIPPED_MODEL / DEFAULT_FILE
    if not f.exists():
        kind = next((k for k in SHIPPED_PREFERENCE if k in shipped), "hydra")
        return kind, kind, kind
    try:
        return check_default_entry(json.loads(f.read_text()), shipped)
    except ValueError as e:  # a JSONDecodeError is a ValueError too
        why = f"must be JSON ({e})" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ValueError(f"{f} {why}; the package is corrupt: reinstall it") from e


def default_kind(batch_1: bool = False) -> str:
    """The kind load_drafter() returns: the one default.json names (the fastest measured on the embedded
    model, with the measurement it rests on; it may be a COMPOSED kind, built over the shipped kind its
    "heads" names, which must draft a static tree: STATIC_TREE_KINDS), else the first shipped kind of
    SHIPPED_PREFERENCE. batch_1=True: the kind default.json's optional "batch_1" entry names for decoding one
    sequence at a time (what the CLI and `make demo` use; it may be composed too), else that same default."""
    kind, one, _ = _default_entry()
    return one if batch_1 else kind


def default_heads_kind() -> str:
    """The shipped kind whose weights the default drafter drafts with: default.json's "heads" when its kind is
    composed (the combined drafter's static-tree heads), else the default kind itself."""
    return _default_entry()[2]


def composed_tables_dir(kind: str, heads: str) -> Path:
    """Where a COMPOSED kind's budget tables over the shipped `heads` live: it has no weights, only
    budget_<device>.json, searched with python/search_budget.py --kind KIND (over default_heads_kind()). One
    directory per heads kind: two kinds' trees can coincide (untrained heads' default tree) while their drafts
    cost differently."""
    return SHIPPED_DIR / SHIPPED_MODEL / kind / heads


def measured_files_dir(kind: str) -> Path:
    """Where the measured files of a shipped or composed kind live (budget_<device>.json, acceptance_rates.json), which
    python/search_budget.py and python/calibrate_acceptance.py write: a shipped kind's own directory, a composed kind's
    composed_tables_dir over the default heads. ValueError for a kind that is neither."""
    shipped = shipped_drafters()
    if kind in COMPOSED:
        return composed_tables_dir(kind, default_heads_kind())
    if kind not in shipped:
        raise ValueError(f"kind {kind!r} is neither shipped {sorted(shipped)} nor composed {COMPOSED}")
    return shipped[kind]


def _shipped_combined(model) -> CombinedDrafter:
    """COMPOSED["combined"]: the n-gram drafter (its defaults) and the shipped heads default.json names (its
    default kind, or its "heads" when the default is combined), one tree of at most COMBINED_NODE_BUDGET nodes
    per step (CombinedDrafter: a long n-gram match is served first), with the budget tables searched for that
    composition (composed_tables_dir)."""
    heads = default_heads_kind()
    if heads not in STATIC_TREE_KINDS:
        raise ValueError(f"the combined drafter needs heads drafting a static tree {STATIC_TREE_KINDS}; the default "
                         f"shipped kind is {heads!r}: pass drafters=[...] to hk.new_drafter(kind='combined') instead")
    drafter = CombinedDrafter(NgramDrafter(NgramConfig()), load_drafter(model=model, kind=heads), COMBINED_NODE_BUDGET)
    drafter.budget_tables.update(load_tables(composed_tables_dir("combined", heads)))
    drafter.acceptance_prior = load_prior(composed_tables_dir("combined", heads))
    return drafter


def load_drafter(path=None, model=None, *, kind: str | None = None) -> Drafter:
    """Load a drafter, recognising its format: ours (any kind), an original Hydra checkpoint dir,
    original Medusa heads, vLLM's Medusa layout, an fms-extras MLPSpeculator (HF hub or vLLM naming) or an
    original EAGLE-1/EAGLE-3 checkpoint (needs model). Every file is checked as it is read (a corrupt or
    inconsistent one is a ValueError naming it; weights strictly by name and shape). model (optional): moves
    the drafter to its device/dtype, checks it fits (Drafter.check_model: a drafter for another model is refused
    here) and supplies the base config a Hydra++ checkpoint may lack. path=None: the drafter
    shipped for the embedded default model (SmolLM2-135M-Instruct), `kind` among shipped_drafters() or
    COMPOSED ("combined": the n-gram drafter beside the shipped heads default.json names); default: the best
    measured, default_kind() (default.json). A head drafter's `trees` holds the tree searched per device
    class; generate(tree=None) uses it."""
    if path is None:
        shipped = shipped_drafters()
        kind = kind or default_kind()
        if kind in COMPOSED and kind not in shipped:
            return _shipped_combined(model)
        if kind not in shipped:
            recipe = RECIPES.get(kind)
            how = f"train your own with {recipe}, or pass" if recipe else "pass"
            raise FileNotFoundError(f"no shipped {kind!r} drafter; shipped: {sorted(shipped) or 'none'} "
                                    f"({how} a checkpoint directory)")
        path = shipped[kind]
        if model is not None and (model.config.vocab_size, model.config.hidden_size) != SHIPPED_SHAPE:
            raise ValueError("the shipped drafters are for the embedded SmolLM2-135M-Instruct (vocab 49152, hidden 576); "
                             "pass the path of a drafter trained for this model")
    elif kind is not None:
        raise ValueError("kind selects among the shipped drafters; it is only used with path=None")
    drafter = _load_dir(Path(path), model)
    drafter.eval()
    if model is not None:
        drafter.to(model.device, model.dtype)
        try:
            drafter.check_model(model)  # a drafter for another model: refused here, before any work
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        with torch.no_grad():  # the caches every run reads (Drafter.prepare), built now, not in the first drafted step
            drafter.prepare(model, model.backend_plan())
    return drafter


def _load_dir(path: Path, model) -> Drafter:
    """A drafter directory, every file it holds checked as it is read: config.json (fields that describe the
    weights), the weights, tree_<device>.json (a tree these heads can draft), budget_<device>.json; a corrupt or
    inconsistent one is a ValueError naming it."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory: pass a drafter directory (config.json and its weights)")
    cfg_file = path / "config.json"
    cfg_dict = read_config(cfg_file)
    if cfg_dict.get("format") == FORMAT:
        cls = _saved_family(cfg_file, cfg_dict)
        if hasattr(cls, "load_saved"):
            # families without weights, or made of other drafters (loaded with `load`), read their own directory
            if hasattr(cls, "config_class"):
                config_from(cls, cfg_dict, cfg_file)  # its fields checked here, naming the file
            drafter = cls.load_saved(path, cfg_dict, model=model, load=load_drafter)
        else:
            drafter = load_ours(cls, path, cfg_dict)
    else:
        cls = next((c for c in FAMILIES if hasattr(c, "recognizes") and c.recognizes(cfg_dict)), None)
        if cls is None:
            raise ValueError(f"{cfg_file} is neither a hydra_kernels drafter (format {FORMAT!r}) nor a checkpoint "
                             "of a supported original implementation (Hydra: hydra_num_heads; Medusa: medusa_num_heads, "
                             "or vLLM's: architectures ['MedusaModel']; MLPSpeculator: model_type 'mlp_speculator'; "
                             "EAGLE: a one-layer Llama config)")
        drafter = cls.load_original(path, cfg_dict, model)
    tables = load_tables(path)  # budget_<device>.json: searched node budgets (budget.py); each names its file
    for device, table in tables.items():
        if table.device != device:
            raise ValueError(f"{path / f'budget_{device}.json'} holds the table of device {table.device!r}; rename "
                             f"it budget_{table.device}.json or search it again (python python/search_budget.py)")
    drafter.budget_tables.update(tables)
    drafter.acceptance_prior = load_prior(path)  # acceptance_rates.json: where the adaptive budget starts
    if hasattr(drafter, "trees"):
        drafter.trees = {f.stem[len("tree_"):]: _saved_tree(drafter, f) for f in sorted(path.glob("tree_*.json"))}
    for device, spec in getattr(drafter, "dynamic_trees", {}).items():
        try:
            drafter.resolve_tree(spec, device)
        except ValueError as e:
            raise ValueError(f"{path / f'dynamic_{device}.json'}: {e}") from e
    return drafter


def _saved_family(cfg_file: Path, cfg_dict: dict) -> type[Drafter]:
    """The family of a config.json in our format: its "kind" (or, written before "kind" was recorded, the kind
    its head fields describe), checked against the version and the fields; ValueError naming the file."""
    version = cfg_dict.get("version", VERSION)
    if version != VERSION:
        raise ValueError(f"{cfg_file}: format version {version!r}; this hydra_kernels reads version {VERSION} "
                         "(a newer hydra_kernels wrote it: upgrade)")
    fields = set(cfg_dict) - set(OUR_KEYS)
    kind = cfg_dict.get("kind")
    if kind is None:
        try:
            kind = _kind_of_fields(cfg_dict)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{cfg_file} has no \"kind\" and its fields are not a head drafter's ({e}); add "
                             f"\"kind\": one of {KINDS}") from e
    if not isinstance(kind, str) or (kind not in KINDS and kind not in _EXTRA_KINDS):
        raise ValueError(f"{cfg_file}: \"kind\" {kind!r} is not a drafter kind; one of {KINDS}")
    cls = family(kind)

    def takes(c) -> bool:
        return hasattr(c, "config_class") and fields <= set(init_fields(c.config_class))

    if hasattr(cls, "config_class") and not takes(cls):
        fitting = [k for c in FAMILIES if c is not cls and takes(c) for k in c.kinds]
        if fitting:
            odd = sorted(fields - set(init_fields(cls.config_class)))
            raise ValueError(f"{cfg_file}: \"kind\" is {kind!r}, but its fields {odd} are not fields of kind {kind!r}: "
                             f"they are those of {' / '.join(map(repr, fitting))}; fix \"kind\"")
    return cls


def _saved_tree(drafter: Drafter, f: Path) -> Tree:
    """tree_<device>.json: Medusa-format choices these heads can draft (drafter.resolve_tree's bounds)."""
    choices = read_json(f)
    try:
        if not isinstance(choices, list):
            raise ValueError(f"expected a JSON list of choices, got {type(choices).__name__}")
        tree = as_tree(choices)
        drafter.resolve_tree(tree, f.stem[len("tree_"):])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{f} is not a tree this drafter can draft ({e}); delete it or search it again "
                         "(python python/eval_heads.py)") from e
    return tree


def _kind_of_fields(cfg_dict: dict) -> str:
    """Head checkpoints written before "kind" was recorded: the kind their config fields describe."""
    fields = {k: v for k, v in cfg_dict.items() if k not in OUR_KEYS}
    return DrafterConfig(**fields).kind
