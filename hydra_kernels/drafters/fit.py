"""What every drafter family with weights shares: the checks against its base model (its draft vocabulary,
the model's device and dtype) and how its linears run on the packed CPU kernel."""
from __future__ import annotations

import torch

from ..model.packed_linear import Linear

# storage of the drafters' packed CPU panels (fp32 accumulation); torch.float32 keeps fp32 weights (same kernel)
DRAFT_PACK_DTYPE = torch.bfloat16


def draft_vocab_ids(draft_vocab, vocab_size: int, device=None) -> torch.Tensor | None:
    """draft_vocab (token ids, or None for the whole vocabulary) -> int64 [Vd] on `device`, refused with a
    ValueError unless the ids are distinct and in [0, vocab_size)."""
    if draft_vocab is None:
        return None
    ids = torch.as_tensor(draft_vocab, dtype=torch.long, device=device)
    if ids.ndim != 1 or ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft_vocab must be distinct token ids in [0, {vocab_size})")
    return ids


def check_device_dtype(drafter, model) -> None:
    """A ValueError naming the fix when the drafter's parameters are not on the model's device and dtype."""
    p = next(drafter.parameters(), None)
    if p is not None and (p.device != model.device or p.dtype != model.dtype):
        raise ValueError(f"drafter is {p.dtype} on {p.device} but the model is {model.dtype} on {model.device}; "
                         "call drafter.to(model.device, model.dtype)")


def lm_head_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The LM head rows of a draft vocabulary [Vd, H]; on the CPU stored input-major like the model's
    weights (the small-M GEMV streams it ~2x faster)."""
    with torch.no_grad():
        s = w.index_select(0, ids)
        return s.t().contiguous().t() if s.device.type == "cpu" else s.contiguous()


def pack_draft_linears(drafter, on: bool) -> None:
    """Every Linear of the drafter on the packed CPU kernel with bf16 panels (on), or back on F.linear. A
    CPU drafting step is bound by reading weights (heads, a draft layer, the LM-head rows of the draft
    vocabulary), so half the bytes is most of the draft's time; a draft's precision cannot change the
    output (the base model verifies), only which guesses are proposed."""
    for m in drafter.modules():
        if isinstance(m, Linear) and (m.packed_on != on or m.pack_dtype != DRAFT_PACK_DTYPE):
            m.pack_dtype = DRAFT_PACK_DTYPE
            m.pack_cpu(on)
