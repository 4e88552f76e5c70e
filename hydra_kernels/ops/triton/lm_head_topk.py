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

import os

import torch
import triton
import triton.language as tl


@triton.jit
def logits_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    """x[offs_n] @ W[offs_v]^T over H in BLOCK_H steps -> fp32 [BLOCK_N, BLOCK_V]; columns past V are -inf."""
    n_ok = offs_n < N
    v_ok = offs_v < V
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(x_ptr + offs_n[:, None].to(tl.int64) * s_xn + offs_h[None, :], mask=n_ok[:, None] & h_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * s_wv + offs_h[None, :] * s_wh,
                    mask=v_ok[:, None] & h_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return tl.where(v_ok[None, :], acc, float("-inf"))


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
    for j in tl.static_range(K):
        best = tl.max(acc, axis=1)
        arg = tl.min(tl.where(acc == best[:, None], cols[None, :], BLOCK_V), axis=1)  # first index of the max
        tl.store(val_ptr + out + j, best, mask=n_ok)
        tl.store(idx_ptr + out + j, (pid_v * BLOCK_V + arg).to(tl.int64), mask=n_ok)
        acc = tl.where(cols[None, :] == arg[:, None], float("-inf"), acc)


def lm_head_topk(x: torch.Tensor, weight: torch.Tensor, k: int, *, block_v: int | None = None):
    """Same contract as reference.lm_head_topk."""
    lead = x.shape[:-1]
    H = x.shape[-1]
    V = weight.shape[0]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[0]
    BLOCK_N = 16 if N <= 16 else 32 if N <= 32 else 64
    # GPU: 128-wide vocabulary tiles (many programs stream the weight); Triton's interpreter (the CPU
    # tier) pays per program, so it gets few wide tiles -- same math, ~8x faster tests
    BLOCK_V = block_v or (4096 if os.environ.get("TRITON_INTERPRET") == "1" else 128)
    BLOCK_H = 64
    n_tiles = triton.cdiv(V, BLOCK_V)
    vals = torch.empty(N, n_tiles, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(N, n_tiles, k, dtype=torch.int64, device=x.device)
    # fp32 keeps fp32 products; the interpreter (Triton 3.9) computes bf16 dots wrongly: upcast there
    ieee = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    _lm_head_topk_kernel[(n_tiles, triton.cdiv(N, BLOCK_N))](
        x2, weight, vals, idx, N, V, H, x2.stride(0), weight.stride(0), weight.stride(1), n_tiles,
        K=k, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, IEEE=ieee)
    vals, idx = vals.view(N, n_tiles * k), idx.view(N, n_tiles * k)
    if k == 1:
        pick = vals.argmax(dim=1, keepdim=True)  # first maximum: lowest tile, so lowest token id
    else:
        pick = vals.topk(k, dim=1).indices
    return vals.gather(1, pick).view(*lead, k), idx.gather(1, pick).view(*lead, k)
