"""nn.Linear with a CPU fast path for small M (decode steps and tree verification).

After `pack_cpu()`, fp32 CPU inference with at most MAX_PACKED_ROWS rows runs the native
`hydra_kernels::packed_linear` kernel (csrc/packed_linear_cpu.cpp): the weight is kept a second time
in contiguous column panels that stream from DRAM, and each output is an in-order FMA chain over K, so
a row's result does not depend on how many rows share the call (a token gives the same logits in a
1-token step and inside a tree). Larger M (prefill, training) and every other case take F.linear.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows MKL's blocked sgemm is as fast (the weights are reused enough to be compute-bound).
# Measured 2026-11-23 on the 2-core dev CPU (throwaway script, both paths interleaved, min of 5, under load:
# ratios only), 30 layers of 576 -> 1536, ms packed vs MKL input-major:
# M = 8 10.7 vs 24.4, 32 30.1 vs 42.6, 48 35.7 vs 66.3, 64 59.3 vs 77.2, 96 90.3 vs 88.8. 64 rows covers
# batch 8-10 with a 6-node tree (and keeps its rows bit-identical to single-token steps).
MAX_PACKED_ROWS = 64


def packed_linear_available() -> bool:
    """The native kernel is built and has its AVX-512 path on this CPU (elsewhere: F.linear)."""
    try:
        import hydra_kernels._C  # noqa: F401

        return bool(torch.ops.hydra_kernels.packed_linear_is_fast())
    except (ImportError, AttributeError, RuntimeError):
        return False


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose small-M fp32 CPU inference can use packed weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_key = None
        self._max_numel = MAX_PACKED_ROWS * self.in_features

    def _key(self):
        # what identifies the packed weight: its storage and version (in-place updates and .data = ...
        # both change one of them); the key check runs on every call, so it reads as little as possible
        w = self.weight
        return (w.data_ptr(), w._version)

    @property
    def packed_on(self) -> bool:
        """Small-M fp32 CPU inference of this layer runs the packed kernel (pack_cpu was called)."""
        return self._packed is not None

    def pack_cpu(self) -> None:
        """Pack the weight for the native small-M kernel (fp32 CPU weights only; a no-op otherwise)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.is_meta:
            self._packed = None
            return
        with torch.no_grad():
            self._packed = torch.ops.hydra_kernels.pack_linear_weight(w.detach())
        self._packed_key = self._key()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the checks are ordered cheapest first: this runs ~120 times per decoding step, and at M = 1
        # a layer's kernel takes ~50-200 us, so microseconds of Python here show up in tokens/s
        if (self._packed is not None and x.is_cpu and x.dtype is torch.float32 and x.numel() <= self._max_numel
                and not torch.is_grad_enabled()):
            if self._packed_key != self._key():  # weights changed since packing (e.g. load_state_dict)
                self.pack_cpu()
                if self._packed is None:  # no longer an fp32 CPU weight
                    return F.linear(x, self.weight, self.bias)
            return _packed_linear_op()(x, self._packed, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)


_OP = None


def _packed_linear_op():
    global _OP
    if _OP is None:
        _OP = torch.ops.hydra_kernels.packed_linear
    return _OP


@contextlib.contextmanager
def packed_kernel_off(model: nn.Module):
    """Inside the block every packed Linear of `model` takes F.linear (MKL on the input-major weights
    load_model keeps): the A/B switch for timing both paths on one model, interleaved."""
    mods = [m for m in model.modules() if isinstance(m, Linear)]
    saved = [m._packed for m in mods]
    for m in mods:
        m._packed = None
    try:
        yield
    finally:
        for m, p in zip(mods, saved):
            m._packed = p
