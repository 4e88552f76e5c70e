"""nn.Linear with a CPU fast path for small M (decode steps, tree verification, draft heads).

After `pack_cpu()`, fp32 CPU inference with at most MAX_PACKED_ROWS rows runs the native
`packed_linear` op (hydra_kernels/ops/packed_linear.py): the weight is kept a second time in
contiguous column panels that stream from DRAM, and each output is an in-order FMA chain over K, so a
row's result does not depend on how many rows share the call (a token gives the same logits in a
1-token step and inside a tree). Larger M (prefill, training) and every other case take F.linear.
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
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def packed_kernel_off(model: nn.Module):
    """Inside the block every packed Linear of `model` takes F.linear (MKL on the input-major weights
    load_model keeps): the A/B switch for timing both paths on one model, interleaved."""
    mods = [m for m in model.modules() if isinstance(m, Linear) and m.packed_on]
    for m in mods:
        m.packed_on = False
    try:
        yield
    finally:
        for m in mods:
            m.packed_on = True
