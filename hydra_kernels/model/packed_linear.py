"""nn.Linear with a CPU fast path for small M (decode steps, tree verification, draft heads).

After `pack_cpu()`, fp32 CPU inference with at most MAX_PACKED_ROWS rows runs the native
`packed_linear` op (hydra_kernels/ops/packed_linear.py): the weight is kept a second time in
contiguous column panels that stream from DRAM, and each output is an in-order FMA chain over K, so a
row's result does not depend on how many rows share the call (a token gives the same logits in a
1-token step and inside a tree). Larger M (prefill, training) and every other case take F.linear.

`release_original()` then drops that second copy the other way round: fp32 panels hold the weight's
exact values, so the layer keeps only them (the base model's projections, ~425 MB less for SmolLM2).
Its `weight` becomes a meta placeholder (shape and dtype only); every fp32 CPU inference, of any M, runs
the packed kernel (prefill rows are then bit-identical to decode rows too); other calls (autograd, other
dtypes) unpack the panels; state_dict holds the unpacked weight; loading, .to() and packed_kernel_off
bring the original back.
`pack_dtype` is the panels' storage: fp32 for the base model (verification decides every token), bf16
for draft heads (half the bytes; a guess's precision cannot change the output).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.packed_linear import MAX_PACKED_ROWS, pack_linear_weight, packed_linear, packed_linear_available
from ..weight_cache import DerivedCache

__all__ = ["Linear", "MAX_PACKED_ROWS", "packed_linear_available", "packed_kernel_off"]


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose small-M fp32 CPU inference can use packed weights."""

    def __init__(self, *args, pack_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_dtype = pack_dtype
        self.packed_on = False  # set by pack_cpu(); the panels are (re)built from the weight when it changes
        self._packed = DerivedCache()
        self._max_numel = MAX_PACKED_ROWS * self.in_features
        self._panels: torch.Tensor | None = None  # release_original(): the only copy of the weight

    @property
    def released(self) -> bool:
        """Only the fp32 panels hold the weight (release_original); `weight` is a meta placeholder."""
        return self._panels is not None

    def release_original(self) -> bool:
        """Keep the weight only as its fp32 panels (exact values), freeing the original's storage. Only for
        a packed fp32 CPU layer with fp32 panels whose weight no one else holds (not a tied LM head).
        Returns whether it released."""
        if self.released or not self.packed_on or self.pack_dtype != torch.float32:
            return False
        with torch.no_grad():
            panels = self.packed_weight()
        if panels is None:
            return False
        self._panels = panels
        self._packed.clear()
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=w.requires_grad)
        return True

    def unpacked_weight(self) -> torch.Tensor:
        """The weight [N, K] rebuilt from the panels [P, K, 64] (W[64 p + c, k] = panels[p, k, c])."""
        return self.unpacked_weight_of(self._panels)

    def restore_original(self) -> None:
        """Undo release_original: the weight is a real fp32 Parameter again (panels kept as its packed copy)."""
        if not self.released:
            return
        panels, rg = self._panels, self.weight.requires_grad
        self._panels = None
        self.weight = nn.Parameter(self.unpacked_weight_of(panels), requires_grad=rg)
        self._packed.get((self.weight,), lambda: panels)  # the panels stay valid for the restored weight

    def unpacked_weight_of(self, panels: torch.Tensor) -> torch.Tensor:
        """panels [P, K, 64] -> [N, K]."""
        return panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.released:
            destination[prefix + "weight"] = self.unpacked_weight()

    def _load_from_state_dict(self, *args, **kwargs):
        self.restore_original()  # loading writes into (or assigns) a real weight
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self.restore_original()  # .to() / .cuda() / .half() move the real weight
        return super()._apply(fn, *args, **kwargs)

    def pack_cpu(self, on: bool = True) -> None:
        """Use the packed kernel for this layer's small-M fp32 CPU inference (when the weight is an fp32
        CPU tensor and the kernel is fast here; otherwise F.linear stays)."""
        self.packed_on = on and packed_linear_available()
        self._packed.clear()
        if self.packed_on:
            with torch.no_grad():
                self.packed_weight()  # pack now, not inside the first decoding step

    def packed_weight(self) -> torch.Tensor | None:
        """The panels of the current weight, or None where this layer cannot use them."""
        if self._panels is not None:
            return self._panels
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.is_meta:
            return None
        return self._packed.get((w,), lambda: pack_linear_weight(w.detach(), self.pack_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the checks are ordered cheapest first: this runs ~120 times per decoding step, and at M = 1
        # a layer's kernel takes ~50-200 us, so microseconds of Python here show up in tokens/s
        if (self.packed_on and x.is_cpu and x.dtype is torch.float32 and x.numel() <= self._max_numel
                and not torch.is_grad_enabled()):
            packed = self.packed_weight()
            if packed is not None:
                return packed_linear(x, packed, self.out_features, self.bias)
        if self._panels is not None:  # released: the panels are the weight
            if self.packed_on and x.is_cpu and x.dtype is torch.float32 and not torch.is_grad_enabled():
                return packed_linear(x, self._panels, self.out_features, self.bias)  # any M (prefill)
            return F.linear(x, self.unpacked_weight().to(x.dtype), self.bias)
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def packed_kernel_off(model: nn.Module):
    """Inside the block every packed Linear of `model` takes F.linear (MKL on input-major weights, the
    released ones brought back for the block): the A/B switch for timing both paths on one model."""
    mods = [m for m in model.modules() if isinstance(m, Linear) and m.packed_on]
    released = [m for m in mods if m.released]
    for m in released:
        m.restore_original()
        m.weight.data = m.weight.data.t().contiguous().t()  # the input-major layout load_model gives
    for m in mods:
        m.packed_on = False
    try:
        yield
    finally:
        for m in mods:
            m.packed_on = True
        for m in released:
            m.release_original()
