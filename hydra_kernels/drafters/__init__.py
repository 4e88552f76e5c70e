"""Draft heads: Medusa, Hydra, Hydra++ behind one Drafter interface."""
from __future__ import annotations

from pathlib import Path

import torch

from .config import KINDS, DrafterConfig
from .formats import load_drafter_dir, save_drafter
from .heads import Drafter, DraftHead, ResBlock


def new_drafter(model, kind: str = "hydra", num_heads: int = 4, num_layers: int = 1, *, lm_head: str = "tied",
                lm_head_bias: bool = False, draft_vocab=None, prefix_final_norm: bool = True) -> Drafter:
    """An untrained drafter for `model` (same device and dtype). kind: "medusa", "hydra" or "hydra++".
    lm_head "tied" reuses the base model's LM head (small checkpoints, cheap training).
    draft_vocab: token ids the heads may propose (e.g. hk.training.draft_vocabulary's most frequent
    tokens); their LM head then reads only those rows. None: the whole vocabulary.
    prefix_final_norm (Hydra++): False drops the prefix layer's final RMSNorm, so the fresh drafter's heads
    see exactly the base h (DrafterConfig.prefix_final_norm)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    mc = model.config
    cfg = DrafterConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=mc.hidden_size,
                        vocab_size=mc.vocab_size, grounded=kind != "medusa", prefix_layer=kind == "hydra++",
                        prefix_final_norm=prefix_final_norm, lm_head=lm_head, lm_head_bias=lm_head_bias,
                        draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
                        base_config=mc.to_hf_dict(include_extra=False) if kind == "hydra++" else None)
    drafter = Drafter(cfg).to(model.device, model.dtype).eval()
    if draft_vocab is not None:
        ids = torch.as_tensor(draft_vocab, dtype=torch.long, device=model.device)
        if ids.ndim != 1 or ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= mc.vocab_size:
            raise ValueError(f"draft_vocab must be distinct token ids in [0, {mc.vocab_size})")
        drafter.draft_vocab.copy_(ids)
    if drafter.prefix is not None:
        drafter.prefix.init_identity(model)
    return drafter


SHIPPED_DIR = Path(__file__).resolve().parents[1] / "heads"
SHIPPED_MODEL = "smollm2-135m-instruct"  # the embedded default (hk.load_model())
# load_drafter() takes the first shipped kind in this order; only the best measured kind is shipped
# besides Medusa (python/eval_heads.py decides; python/ship_heads.py --package writes the package)
SHIPPED_PREFERENCE = ("hydra++", "hydra", "medusa")


def shipped_drafters() -> dict[str, Path]:
    """kind -> directory of the heads shipped inside the package for the embedded default model."""
    root = SHIPPED_DIR / SHIPPED_MODEL
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").exists()} if root.is_dir() else {}


def load_drafter(path=None, model=None, *, kind: str | None = None) -> Drafter:
    """Load a drafter: our format, an original Hydra checkpoint dir or original Medusa heads.
    model (optional): moves the drafter to its device/dtype and supplies the base config a Hydra++
    checkpoint may lack. path=None: the heads shipped for the embedded default model (SmolLM2-135M-
    Instruct), `kind` among hk.drafters.shipped_drafters() (default: the best measured one). The
    drafter's `trees` holds the tree searched per device class; generate(tree=None) uses it."""
    if path is None:
        shipped = shipped_drafters()
        kind = kind or next((k for k in SHIPPED_PREFERENCE if k in shipped), "hydra")
        if kind not in shipped:
            raise FileNotFoundError(f"no shipped {kind!r} heads; shipped: {sorted(shipped) or 'none'} "
                                    "(train your own with python/train_heads.py, or pass a checkpoint directory)")
        path = shipped[kind]
        if model is not None and (model.config.vocab_size, model.config.hidden_size) != (49152, 576):
            raise ValueError("the shipped heads are for the embedded SmolLM2-135M-Instruct (vocab 49152, hidden 576); "
                             "pass the path of heads trained for this model")
    elif kind is not None:
        raise ValueError("kind selects among the shipped heads; it is only used with path=None")
    return load_drafter_dir(path, model)


Drafter.save = save_drafter

__all__ = ["shipped_drafters", "Drafter", "DrafterConfig", "DraftHead", "ResBlock", "new_drafter", "load_drafter", "save_drafter", "KINDS"]
