"""What every drafter family with weights shares: the checks against its base model (its draft vocabulary,
the model's device and dtype) and how its linears run on the packed CPU kernel."""
from __future__ import annotations

import dataclasses

import torch

from ..model.packed_linear import MAX_PACKED_ROWS, Linear
from ..ops.packed_linear import pack_linear_weight, packed_linear
from ..ops.quantized_linear import QuantizedPanels
from ..weight_cache import DerivedCache

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


def lm_head_rows(rows, ids: torch.Tensor) -> torch.Tensor:
    """The LM head rows of a draft vocabulary [Vd, H]; on the CPU stored input-major like the model's
    weights (the small-M GEMV streams it ~2x faster). rows: ids -> those rows' values (Llama.lm_head_rows:
    no copy of the whole head where quantized panels hold it)."""
    with torch.no_grad():
        s = rows(ids)
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


PACK_CHUNK = 4096  # LM-head rows packed at a time (a multiple of the kernel's 64-row panels)


def pack_lm_head_rows(rows, ids: torch.Tensor, dtype: torch.dtype = DRAFT_PACK_DTYPE) -> torch.Tensor:
    """pack_linear_weight(rows(ids)) (rows: ids -> the LM head's rows, Llama.lm_head_rows), built PACK_CHUNK
    rows at a time: the panels of
    consecutive 64-row blocks are independent, so the concatenation is the same tensor bit for bit
    (tests/test_drafters.py), and no fp32 copy of the rows is ever whole (37.7 MB for SmolLM2's
    16384-token draft vocabulary: it set the peak RSS of a drafting process, issue 44)."""
    assert PACK_CHUNK % 64 == 0
    with torch.no_grad():
        parts = [pack_linear_weight(rows(ids[i:i + PACK_CHUNK]), dtype) for i in range(0, ids.numel(), PACK_CHUNK)]
    return torch.cat(parts)


class TiedLMHead:
    """The base model's LM head as a drafter's frozen output layer: its rows of the draft vocabulary
    (lm_head_rows, gathered when a path reads them) and, for the CPU's kernels, the same rows as the head's own
    quantized blocks where it is quantized, else in bf16 panels packed straight from the model's weight
    (pack_lm_head_rows), each kept until the model's weight
    or the vocabulary changes (weight_cache.DerivedCache). Not a module: the rows belong to the base model
    and are never saved with the drafter."""

    def __init__(self):
        self._rows = DerivedCache()
        self._panels = DerivedCache()

    def weight(self, model, draft_vocab: torch.Tensor | None) -> torch.Tensor:
        """[Vd, H]: model.output's rows of draft_vocab (the whole head when None)."""
        if draft_vocab is None:
            return model.lm_head_weight()
        return self._rows.get((model.lm_head_source(), draft_vocab),
                              lambda: lm_head_rows(model.lm_head_rows, draft_vocab))

    def packed_logits(self, model, draft_vocab: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
        """hidden fp32 [..., H] -> logits [..., Vd] on the CPU kernels (the caller checked the packed kernel's
        rule): where the model's LM head is quantized (a GGUF's Q8_0 head, Llama.lm_head_quantized), the rows'
        own blocks (QuantizedPanels.select_rows: the head's exact values at ~1.1 bytes a weight, where bf16
        panels take 2 and round them: a drafting step reads these rows every depth); else bf16 panels."""
        panels = self._cpu_panels(model, draft_vocab)
        if isinstance(panels, QuantizedPanels):
            return panels.linear(hidden)
        return packed_linear(hidden, panels, model.output.out_features if draft_vocab is None else draft_vocab.numel())

    def _cpu_panels(self, model, draft_vocab: torch.Tensor | None):
        """The rows packed_logits reads (built once, kept until the head's weight or the vocabulary changes)."""
        src, V = model.lm_head_source(), model.output.out_features
        sources = (src,) if draft_vocab is None else (src, draft_vocab)
        quantized = model.lm_head_quantized()
        if quantized is not None:
            return self._panels.get(sources, lambda: quantized if draft_vocab is None else
                                    quantized.select_rows(draft_vocab), extra=("quantized",))
        return self._panels.get(sources, lambda: pack_lm_head_rows(
            model.lm_head_rows, torch.arange(V) if draft_vocab is None else draft_vocab), extra=(DRAFT_PACK_DTYPE,))

    def prepare(self, model, draft_vocab: torch.Tensor | None, packed: bool) -> None:
        """At a run's start: build the CPU rows now where this run's drafting reads them (the packed kernel on an
        fp32 CPU model, no autograd). Built lazily they landed in the first drafting step (~25 ms for SmolLM2's
        16384-token draft vocabulary, ~4x a plain step), which the adaptive budget times as that part's cost: the
        part then looked dear and stayed held back for runs after (adaptive.py keeps its gates)."""
        if (packed and model.device.type == "cpu" and model.output.weight.dtype is torch.float32
                and not torch.is_grad_enabled()):
            self._cpu_panels(model, draft_vocab)

    def logits(self, model, draft_vocab: torch.Tensor | None, hidden: torch.Tensor, packed: bool) -> torch.Tensor:
        """hidden [..., H] -> logits [..., Vd]. packed: the CPU kernel on bf16 panels where its rule allows
        (fp32 CPU inference, few rows, as model/packed_linear.Linear), else F.linear (autograd, GPU)."""
        if (packed and hidden.is_cpu and hidden.dtype is torch.float32 and model.output.weight.dtype is torch.float32
                and not torch.is_grad_enabled() and hidden.numel() <= MAX_PACKED_ROWS * hidden.shape[-1]):
            return self.packed_logits(model, draft_vocab, hidden)
        return torch.nn.functional.linear(hidden, self.weight(model, draft_vocab))

    def __deepcopy__(self, memo):  # a copied drafter rebuilds from its own model
        return TiedLMHead()


def draft_vocab_prefix(drafter, size: int):
    """A copy of `drafter` that ranks only the first `size` ids of its draft vocabulary. The recipes order
    a draft vocabulary by frequency (training/data.recipe_draft_vocabulary), so the prefix keeps the
    tokens most guesses are; what drops is the cost: on the CPU a draft reads its LM-head rows every
    depth, so half the rows is about half of that read. Only for drafters whose weights do not depend on
    the vocabulary size (they rank with the base model's LM head rows: EAGLE-1/2, a base-tied
    MLPSpeculator); one with its own rows per draft token is refused. Searched trees and budget tables
    are not carried over: they were measured with the full vocabulary."""
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is None:
        raise ValueError(f"this {drafter.kind} drafter ranks the whole vocabulary (no draft vocabulary to cut)")
    if not isinstance(size, int) or not 1 <= size <= vocab.numel():
        raise ValueError(f"size must be an int in [1, {vocab.numel()}] (the draft vocabulary's size), got {size!r}")
    cut = type(drafter)(dataclasses.replace(drafter.config, draft_vocab_size=size))
    own = cut.state_dict()
    state = {k: (v[:size] if k == "draft_vocab" else v) for k, v in drafter.state_dict().items()}
    sized = sorted(k for k, v in state.items() if k in own and own[k].shape != v.shape)
    if sized:
        raise ValueError(f"this {drafter.kind} drafter has weights sized by its draft vocabulary ({', '.join(sized)}); "
                         "train it with the smaller draft vocabulary instead")
    cut.load_state_dict(state)
    p = next(drafter.parameters(), vocab)
    return cut.to(p.device, p.dtype).train(drafter.training)
