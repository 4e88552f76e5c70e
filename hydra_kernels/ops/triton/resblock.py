"""Triton ResBlock of a draft head: y = x + SiLU(x W^T + b) in one launch (two when split over K).

The blocks after a Hydra head's first layer (and every Medusa block) are H -> H with an identity
residual. Unfused that is three passes (GEMM, SiLU, add) and two [R, H] intermediates; here the
GEMM accumulates in fp32 registers and bias, SiLU and the residual are applied before the one
store. R (nodes x sequences of one depth) is at most a few hundred, so the block is bound by reading
W once: each program owns an output tile of BLOCK_O columns for BLOCK_R rows, and the weight tile
is read once per row block (all rows of a depth share it when R <= BLOCK_R).

Too few output tiles to fill the GPU (SmolLM2, H = 576: 9 programs on 132 SMs) and the reduction over
K = H is split (common.k_splits): program (o, r, s) adds up K slice s into an fp32 partial [splits, R, H],
and a second kernel sums the partials in split order (deterministic: no atomics), then applies bias,
SiLU and the residual -- the epilogue needs the full sum.
Grid: (output tiles of H, row blocks of R, K splits); the finishing kernel's: (output tiles, row blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, ieee_dots, k_splits, row_block, rows_dot_tile
from .tuning import k_configs, launch


@triton.jit
def _resblock_epilogue(acc, x_ptr, b_ptr, out_ptr, offs_r, offs_o, R, H, s_xr, s_or, HAS_B: tl.constexpr):
    """out[offs_r, offs_o] = x + SiLU(acc + b) (acc: the full fp32 x W^T tile)."""
    o_ok = offs_o < H
    if HAS_B:
        acc += tl.load(b_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    both = (offs_r < R)[:, None] & o_ok[None, :]
    res = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * s_xr + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    y = res + acc * tl.sigmoid(acc)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * s_or + offs_o[None, :], y.to(out_ptr.dtype.element_ty), mask=both)


@triton.jit
def _resblock_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, R, H, k_per, s_xr, s_wo, s_wk, s_or,
                     HAS_B: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_o = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    k_lo = pid_k * k_per
    # x[:, k_lo:k_lo+k_len] W[:, k_lo:k_lo+k_len]^T in fp32 (the LM head's tile loop over one K slice; the
    # pointers start at the slice, so the loop keeps no slice bounds live: bounds in the loop spilled)
    acc = rows_dot_tile(x_ptr + k_lo, w_ptr + k_lo * s_wk, offs_r, offs_o, R, H, tl.minimum(k_per, H - k_lo),
                        s_xr, s_wo, s_wk, BLOCK_R, BLOCK_O, BLOCK_K, IEEE)
    if SPLIT:  # partial [splits, R, H] fp32; the finishing kernel applies the epilogue
        both = (offs_r < R)[:, None] & (offs_o < H)[None, :]
        tl.store(part_ptr + (pid_k * R + offs_r[:, None]).to(tl.int64) * H + offs_o[None, :], acc, mask=both)
    else:
        _resblock_epilogue(acc, x_ptr, b_ptr, out_ptr, offs_r, offs_o, R, H, s_xr, s_or, HAS_B)


@triton.jit
def _resblock_finish_kernel(part_ptr, x_ptr, b_ptr, out_ptr, R, H, n_splits, s_xr, s_or, HAS_B: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    """Sum of the split partials in split order, then the epilogue."""
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    both = (offs_r < R)[:, None] & (offs_o < H)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    for s in range(0, n_splits):
        acc += tl.load(part_ptr + (s * R + offs_r[:, None]).to(tl.int64) * H + offs_o[None, :], mask=both, other=0.0)
    _resblock_epilogue(acc, x_ptr, b_ptr, out_ptr, offs_r, offs_o, R, H, s_xr, s_or, HAS_B)


def _configs(dtype: torch.dtype) -> list:
    """Launch configs (tuning.k_configs): the K step (common.k_step) at 4 warps first."""
    return k_configs("BLOCK_K", dtype, 4)


def resblock(x, weight, bias, *, splits: int | None = None, config=None):
    """Same contract as reference.resblock. splits: K splits (default: common.k_splits from the grid and
    the SM count; tests force 1 or several); config: a tuning override (tests)."""
    x2 = as_rows(x)  # [R, H]
    R, H = x2.shape
    out = torch.empty(R, H, dtype=x.dtype, device=x.device)
    if R == 0:
        return out.view(x.shape)
    BLOCK_R, BLOCK_O = row_block(R), 64
    grid = (triton.cdiv(H, BLOCK_O), triton.cdiv(R, BLOCK_R))
    n_splits, k_per = k_splits(H, grid[0] * grid[1], x.device, splits)
    part = torch.empty(n_splits, R, H, dtype=torch.float32, device=x.device) if n_splits > 1 else out
    b = bias if bias is not None else x2
    launch(_resblock_kernel, (*grid, n_splits),
           (x2, weight, b, out, part, R, H, k_per, x2.stride(0), weight.stride(0), weight.stride(1), out.stride(0)),
           dict(HAS_B=bias is not None, SPLIT=n_splits > 1, BLOCK_R=BLOCK_R, BLOCK_O=BLOCK_O, IEEE=ieee_dots(x.dtype)),
           _configs(x.dtype), key=["R", "H", "k_per"], config=config)
    if n_splits > 1:
        _resblock_finish_kernel[grid](part, x2, b, out, R, H, n_splits, x2.stride(0), out.stride(0),
                                      HAS_B=bias is not None, BLOCK_R=BLOCK_R, BLOCK_O=BLOCK_O)
    return out.view(x.shape)
