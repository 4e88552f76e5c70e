"""Triton LM head with a fused top-k: the [N, V] logits are never written.

Drafting needs the k best children of each node and greedy verification the argmax (k = 1); both
only need ranks. The vocabulary is cut into BLOCK_V tiles, one program per (tile, row block): it
computes logits = x W_tile^T over H in BLOCK_H steps (tensor-core dots, the weight tile read once for
all N rows), then extracts its tile's k best by k rounds of max / first-argmax / knock-out. A small
merge over [N, tiles * k] candidates (torch.topk) finishes. Memory traffic: the weight once
(V x H), plus N x tiles x k candidates -- for N <= 64 the weight read dominates, so the kernel is
bound by DRAM bandwidth like a GEMV.
Ties: within a tile the lowest index wins; across tiles the merge keeps the earliest candidate for
k = 1 (argmax), so argmax ties resolve to the lowest token id, as torch.argmax does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, ieee_dots, logits_tile, row_block, vocab_block
from .tuning import k_configs, launch


@triton.jit
def _lm_head_topk_kernel(x_ptr, w_ptr, val_ptr, idx_ptr, N, V, H, s_xn, s_wv, s_wh, n_tiles,
                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         IEEE: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    acc = logits_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N, BLOCK_V, BLOCK_H, IEEE)
    cols = tl.arange(0, BLOCK_V)
    out = (offs_n.to(tl.int64) * n_tiles + pid_v) * K
    for j in range(K):  # a runtime loop: unrolled k = 10 rounds made ptxas keep a stack frame
        best = tl.max(acc, axis=1)
        arg = tl.min(tl.where(acc == best[:, None], cols[None, :], BLOCK_V), axis=1)  # first index of the max
        tl.store(val_ptr + out + j, best, mask=n_ok)
        tl.store(idx_ptr + out + j, (pid_v * BLOCK_V + arg).to(tl.int64), mask=n_ok)
        acc = tl.where(cols[None, :] == arg[:, None], float("-inf"), acc)


def _configs(dtype: torch.dtype) -> list:
    """Launch configs (tuning.k_configs): the H step (common.k_step) at 4 warps first. The doubled step
    stays at 4 warps (at 8 a 128-wide 16-bit step kept a 16-byte stack frame on sm_80 and sm_90), and
    fp32 has none (a 32-wide FMA step kept a 24-byte one beside the 64-row tile's top-k rounds)."""
    return k_configs("BLOCK_H", dtype, 4, longer_warps=None if dtype == torch.float32 else 4)


def lm_head_topk(x: torch.Tensor, weight: torch.Tensor, k: int, *, block_v: int | None = None, config=None):
    """Same contract as reference.lm_head_topk. block_v / config: tuning overrides (tests)."""
    lead = x.shape[:-1]
    x2 = as_rows(x)  # [N, H]
    (N, H), V = x2.shape, weight.shape[0]
    BLOCK_N, BLOCK_V = row_block(N), block_v or vocab_block(V)
    n_tiles = triton.cdiv(V, BLOCK_V)
    vals = torch.empty(N, n_tiles, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(N, n_tiles, k, dtype=torch.int64, device=x.device)
    launch(_lm_head_topk_kernel, (n_tiles, triton.cdiv(N, BLOCK_N)),
           (x2, weight, vals, idx, N, V, H, x2.stride(0), weight.stride(0), weight.stride(1), n_tiles),
           dict(K=k, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, IEEE=ieee_dots(x.dtype)), _configs(x.dtype),
           key=["N", "V", "H"], config=config)
    vals, idx = vals.view(N, n_tiles * k), idx.view(N, n_tiles * k)
    if k == 1:
        pick = vals.argmax(dim=1, keepdim=True)  # first maximum: lowest tile, so lowest token id
    else:
        pick = vals.topk(k, dim=1).indices
    return vals.gather(1, pick).view(*lead, k), idx.gather(1, pick).view(*lead, k)
