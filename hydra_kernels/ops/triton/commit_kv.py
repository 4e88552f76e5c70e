"""Triton commit_kv: every layer, K and V, and sequence in one launch.

Program (column block c, sequence b, plane = layer * 2 + {K, V}) loads the [K+1, BLOCK_COLS] tile of
its accepted source rows into registers, waits at a barrier, then stores the tile to the destination
rows. The barrier is what makes overlapping rows safe: the compiled layout may spread the rows of one
column over different warps, and without it a warp storing destination row i could overwrite a source
row (accepted index > i) before another warp has loaded it. Other programs own other columns or planes.
benchmarks/triton_aot.py checks the compiled PTX for the barrier between the loads and the stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2


@triton.jit
def _commit_kv_kernel(kv_ptr, seqlens_ptr, idx_ptr, lens_ptr, B, S, row_elems, k1,
                      BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    pid_c = tl.program_id(0)
    b = tl.program_id(1)
    plane = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    start = tl.load(seqlens_ptr + b)
    rows = tl.arange(0, BLOCK_ROWS)
    cols = pid_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    valid = (rows < n) & (rows < k1)  # n is data: never read idx (or write rows) past k1
    src = start + tl.load(idx_ptr + b * k1 + rows, mask=valid, other=0)  # [BLOCK_ROWS] int64 rows
    dst = start + rows
    base = kv_ptr + (plane.to(tl.int64) * B + b) * S * row_elems
    m = valid[:, None] & (cols[None, :] < row_elems)
    tile = tl.load(base + src[:, None] * row_elems + cols[None, :], mask=m)
    tl.debug_barrier()  # every warp's loads of the tile are done before any warp stores (bar.sync)
    tl.store(base + dst[:, None] * row_elems + cols[None, :], tile, mask=m)


def _block_cols(block_rows: int, row_elems: int) -> int:
    """Columns per program: the whole tile sits in registers across the barrier, so at most 8192 elements
    (4 warps: 64 per thread, no spill in fp32), at most 1024 columns and no wider than a row needs."""
    return max(16, min(1024, pow2(row_elems), 8192 // block_rows))


def commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths):
    """Same contract as reference.commit_kv; kv_cache must be contiguous."""
    if not kv_cache.is_contiguous():
        raise ValueError("commit_kv (triton): kv_cache must be contiguous (it is the model's static buffer)")
    L2, B, S = kv_cache.shape[0] * 2, kv_cache.shape[2], kv_cache.shape[3]
    row_elems = kv_cache.shape[4] * kv_cache.shape[5]
    k1 = accept_indices.shape[1]
    idx = accept_indices.to(torch.int64).contiguous()
    block_cols = _block_cols(pow2(k1), row_elems)
    grid = (triton.cdiv(row_elems, block_cols), B, L2)
    _commit_kv_kernel[grid](kv_cache, cache_seqlens.to(torch.int64), idx, accept_lengths.to(torch.int64), B, S,
                            row_elems, k1, BLOCK_ROWS=pow2(k1), BLOCK_COLS=block_cols)
