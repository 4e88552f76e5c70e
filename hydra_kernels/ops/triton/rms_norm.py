"""Triton RMSNorm, with the residual add before it fused in (ops.rms_norm).

One program per row: the row is read once, h = x (+ add) kept in registers (and stored when the residual
sum is asked for), the fp32 statistic reduced in the program, and y written. The rounding steps are the
definition's (reference.rms_norm): h in x's dtype, the normalised row cast to x's dtype before the weight
multiplies it; fp contraction is off so a multiply and an add round as torch's separate kernels do. What
may differ from torch is the order of the fp32 sum of squares (a tree in the program) and rsqrt's last bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, pow2, round_to


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, w_ptr, h_ptr, y_ptr, H, s_x, s_a, s_h, s_y, eps,
                     HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    h = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0)
    if HAS_ADD:
        a = tl.load(add_ptr + row * s_a + offs, mask=m, other=0.0)
        h = round_to(h.to(tl.float32) + a.to(tl.float32), h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * s_h + offs, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
    normed = round_to(hf * rstd, y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + row * s_y + offs, round_to(w.to(tl.float32) * normed.to(tl.float32), y_ptr.dtype.element_ty), mask=m)


def rms_norm(x, weight, eps, add=None):
    """Same contract as reference.rms_norm (weight in x's dtype: ops.rms_norm checks)."""
    H = x.shape[-1]
    xr = as_rows(x)
    ar = xr if add is None else as_rows(add)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = y if add is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yr, hr = y.view(-1, H), h.view(-1, H)
    block = pow2(H)
    if xr.shape[0]:
        # a row per program: the whole row in registers (H = 4096: 16 fp32 values a thread at 8 warps)
        _rms_norm_kernel[(xr.shape[0],)](xr, ar, weight.contiguous(), hr, yr, H, xr.stride(0), ar.stride(0),
                                         hr.stride(0), yr.stride(0), float(eps), HAS_ADD=add is not None,
                                         BLOCK=block, num_warps=min(16, max(1, block // 512)),
                                         enable_fp_fusion=False)
    return y if add is None else (h, y)
