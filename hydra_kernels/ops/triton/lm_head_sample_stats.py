"""Triton lm_head_sample_stats: what typical acceptance needs from the LM head, in one pass over the
vocabulary, the [N, V] logits never written.

One program per (vocabulary tile, row block) computes the tile's logits as lm_head_topk does and keeps,
per row, of z = logits / temperature: the max m, sum e^(z-m), sum e^(z-m) z, and a Gumbel-max sample
(argmax of z + Gumbel noise from tl.rand(seed, row * V + token): an exact draw from softmax(z)). A small
merge over tiles gives lse = M + log S, entropy = lse - U / S (since -sum p log p = lse - sum p z), and
the sample.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, ieee_dots, logits_tile, row_block, vocab_block
from .tuning import k_configs, launch


@triton.jit
def _lm_head_stats_kernel(x_ptr, w_ptr, seed_ptr, m_ptr, s_ptr, u_ptr, gv_ptr, gi_ptr, N, V, H, s_xn, s_wv, s_wh,
                          n_tiles, inv_temp, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                          IEEE: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    v_ok = offs_v < V
    acc = logits_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N, BLOCK_V, BLOCK_H, IEEE)
    z = tl.where(v_ok[None, :], acc * inv_temp, float("-inf"))
    m = tl.max(z, axis=1)
    e = tl.exp(z - m[:, None])  # masked columns: exp(-inf) = 0
    s = tl.sum(e, axis=1)
    u = tl.sum(e * tl.where(v_ok[None, :], z, 0.0), axis=1)  # no 0 * -inf on masked columns
    seed = tl.load(seed_ptr)
    r = tl.rand(seed, offs_n[:, None] * V + offs_v[None, :])  # uniform in [0, 1): one per (row, token)
    g = z - tl.log(-tl.log(tl.maximum(r, 1e-20)))
    gv = tl.max(g, axis=1)
    cols = tl.arange(0, BLOCK_V)
    gi = tl.min(tl.where(g == gv[:, None], cols[None, :], BLOCK_V), axis=1) + pid_v * BLOCK_V
    o = offs_n.to(tl.int64) * n_tiles + pid_v
    tl.store(m_ptr + o, m, mask=n_ok)
    tl.store(s_ptr + o, s, mask=n_ok)
    tl.store(u_ptr + o, u, mask=n_ok)
    tl.store(gv_ptr + o, gv, mask=n_ok)
    tl.store(gi_ptr + o, gi.to(tl.int64), mask=n_ok)


def _configs(dtype: torch.dtype, BLOCK_N: int) -> list:
    """Launch configs (tuning.k_configs), the hand-picked one first. A 64-row tile keeps ~5 fp32 [64, BLOCK_V]
    values live (logits, exp, noise): 4 warps spill them (255 registers + a stack frame on sm_90), 8 warps
    hold them in registers; the weight is still read once."""
    return k_configs("BLOCK_H", dtype, 8 if BLOCK_N >= 64 else 4)


def lm_head_sample_stats(x, weight, temperature, seed, *, config=None):
    """Same contract as reference.lm_head_sample_stats (seed: int64 tensor [1] on x's device).
    config: a tuning override (tests)."""
    lead = x.shape[:-1]
    x2 = as_rows(x)  # [N, H]
    (N, H), V = x2.shape, weight.shape[0]
    BLOCK_N, BLOCK_V = row_block(N), vocab_block(V)
    n_tiles = triton.cdiv(V, BLOCK_V)
    f = lambda: torch.empty(N, n_tiles, dtype=torch.float32, device=x.device)  # noqa: E731
    m, s, u, gv = f(), f(), f(), f()
    gi = torch.empty(N, n_tiles, dtype=torch.int64, device=x.device)
    launch(_lm_head_stats_kernel, (n_tiles, triton.cdiv(N, BLOCK_N)),
           (x2, weight, seed, m, s, u, gv, gi, N, V, H, x2.stride(0), weight.stride(0), weight.stride(1), n_tiles,
            1.0 / temperature), dict(BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, IEEE=ieee_dots(x.dtype)),
           _configs(x.dtype, BLOCK_N), key=["N", "V", "H"], config=config)
    M = m.max(dim=1, keepdim=True).values
    w = torch.exp(m - M)
    S, U = (s * w).sum(1), (u * w).sum(1)
    lse = M[:, 0] + torch.log(S)
    entropy = lse - U / S
    sample = gi.gather(1, gv.argmax(dim=1, keepdim=True))[:, 0]
    return lse.view(lead), entropy.view(lead), sample.view(lead)
