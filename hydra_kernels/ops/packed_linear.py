"""The native small-M linear for the CPU (csrc/packed_linear_cpu.cpp), the only way Python reaches it.

`pack_linear_weight(w)` stores a weight [N, K] in contiguous 64-column panels (fp32, or bf16 to halve
the bytes a memory-bound step reads); `packed_linear(x, packed, N, bias)` = x W^T + b for x [..., K]
with each output an in-order FMA chain over K (fp32 accumulation), so a row's result never depends on
how many rows share the call. Fast only with AVX-512 (`packed_linear_available`); the CPU model and the
draft heads use it for at most MAX_PACKED_ROWS rows (model/packed_linear.py).
"""
from __future__ import annotations

import torch

from .backend import native_available

# Above this many rows MKL's blocked sgemm is as fast (the weights are reused enough to be compute-bound).
# Measured 2026-11-23 on the 2-core dev CPU (throwaway script, both paths interleaved, min of 5, under load:
# ratios only), 30 layers of 576 -> 1536, ms packed vs MKL input-major:
# M = 8 10.7 vs 24.4, 32 30.1 vs 42.6, 48 35.7 vs 66.3, 64 59.3 vs 77.2, 96 90.3 vs 88.8. 64 rows covers
# batch 8-10 with a 6-node tree (and keeps its rows bit-identical to single-token steps).
MAX_PACKED_ROWS = 64

_AVAILABLE: bool | None = None


def packed_linear_available() -> bool:
    """The native kernel is built and has its AVX-512 path on this CPU (elsewhere: F.linear)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:  # native_available: built, and from sources of this interface (a stale build is refused there)
            _AVAILABLE = native_available() and bool(torch.ops.hydra_kernels.packed_linear_is_fast())
        except (AttributeError, RuntimeError):
            _AVAILABLE = False
    return _AVAILABLE


def pack_linear_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight fp32 [N, K] (any strides) -> its panels for packed_linear, stored as `dtype` (fp32 default,
    or bf16)."""
    return torch.ops.hydra_kernels.pack_linear_weight(weight, dtype)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x fp32 [..., K], packed = pack_linear_weight(W [n, K]), bias fp32 [n] or None -> x W^T + b [..., n]."""
    return _OP(x, packed, n, bias)


class LazyOp:
    """torch.ops.hydra_kernels.<name>, its handle looked up at the first call and kept (these run ~120 times per
    CPU decoding step: the attribute lookups of torch.ops cost microseconds each)."""

    def __init__(self, name: str):
        self.name, self.op = name, None

    def __call__(self, *args):
        if self.op is None:
            self.op = getattr(torch.ops.hydra_kernels, self.name)
        return self.op(*args)


_OP = LazyOp("packed_linear")
