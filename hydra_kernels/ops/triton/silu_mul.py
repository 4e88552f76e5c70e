"""Triton SwiGLU elementwise part (ops.silu_mul): silu(gate) * up from the fused W1 | W3 projection's
output [..., 2I] in one pass (torch: silu, then a multiply, two launches and an [.., I] intermediate).

Grid: (rows, column blocks of I). The rounding steps are torch's: silu computed in fp32 and rounded to the
dtype, then the product rounded (fp contraction off); exp may differ from torch's in its last bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, pow2, round_to


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, s_gu, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * s_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_gu + I + cols, mask=m, other=0.0)
    act = round_to(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_out + cols, round_to(act.to(tl.float32) * u.to(tl.float32), out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up):
    """Same contract as reference.silu_mul."""
    I = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(I))
    if rows.shape[0] and I:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(I, block))](rows, out.view(-1, I), I, rows.stride(0), I,
                                                                  BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out
