"""Triton ResBlock of a draft head: y = x + SiLU(x W^T + b) in one launch.

The blocks after a Hydra head's first layer (and every Medusa block) are H -> H with an identity
residual. Unfused that is three passes (GEMM, SiLU, add) and two [R, H] intermediates; here the
GEMM accumulates in fp32 registers and bias, SiLU and the residual are applied before the one
store. R (nodes x sequences of one depth) is at most a few hundred, so the block is bound by reading
W once: each program owns an output tile of BLOCK_O columns for BLOCK_R rows, and the weight tile
is read once per row block (all rows of a depth share it when R <= BLOCK_R).
Grid: (output tiles of H, row blocks of R).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, ieee_dots, k_step, logits_tile, row_block
from .tuning import cfg, launch


@triton.jit
def _resblock_kernel(x_ptr, w_ptr, b_ptr, out_ptr, R, H, s_xr, s_wo, s_wk, s_or, HAS_B: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_o = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    r_ok = offs_r < R
    o_ok = offs_o < H
    # x W^T tile in fp32 (the LM head's tile loop; columns past H come back -inf and are never stored)
    acc = logits_tile(x_ptr, w_ptr, offs_r, offs_o, R, H, H, s_xr, s_wo, s_wk, BLOCK_R, BLOCK_O, BLOCK_K, IEEE)
    if HAS_B:
        acc += tl.load(b_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    both = r_ok[:, None] & o_ok[None, :]
    res = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * s_xr + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    y = res + acc * tl.sigmoid(acc)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * s_or + offs_o[None, :], y.to(out_ptr.dtype.element_ty), mask=both)


def _configs(dtype: torch.dtype) -> list:
    """Launch configs (tuning.py), the hand-picked one first: the K step (common.k_step), warps, stages."""
    return [cfg(BLOCK_K=k_step(dtype))]


def resblock(x, weight, bias, *, config=None):
    """Same contract as reference.resblock. config: a tuning override (tests)."""
    x2 = as_rows(x)  # [R, H]
    R, H = x2.shape
    out = torch.empty(R, H, dtype=x.dtype, device=x.device)
    if R == 0:
        return out.view(x.shape)
    BLOCK_R, BLOCK_O = row_block(R), 64
    launch(_resblock_kernel, (triton.cdiv(H, BLOCK_O), triton.cdiv(R, BLOCK_R)),
           (x2, weight, bias if bias is not None else x2, out, R, H, x2.stride(0), weight.stride(0), weight.stride(1),
            out.stride(0)), dict(HAS_B=bias is not None, BLOCK_R=BLOCK_R, BLOCK_O=BLOCK_O, IEEE=ieee_dots(x.dtype)),
           _configs(x.dtype), key=["R", "H"], config=config)
    return out.view(x.shape)
