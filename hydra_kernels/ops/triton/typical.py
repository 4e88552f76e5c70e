"""Triton typical acceptance without [B, T, V] logits: LM-head statistics + fused path selection.

1. `lm_head_sample_stats`: one pass of the LM head over vocabulary tiles (as lm_head_topk) keeps, per
   row and tile, z = logits / temperature's max m, sum e^(z-m), sum e^(z-m) z, and a Gumbel-max sample
   (argmax of z + Gumbel noise from tl.rand(seed, row * V + token): an exact draw from softmax(z)). A
   small merge gives lse = M + log S, entropy = lse - U / S (since -sum p log p = lse - sum p z), and
   the sample. 2. `typical_accept`: one program per sequence, all leaf paths at once, applies Medusa's
   criterion p(child) > min(threshold, alpha * exp(-entropy(parent))) along each path, keeps the
   longest, then the highest summed log p (first path on ties), and takes the next root from the
   samples. No host synchronisation.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .greedy_verify import path_tile
from .lm_head_topk import logits_tile


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


def lm_head_sample_stats(x, weight, temperature, seed):
    """Same contract as reference.lm_head_sample_stats (seed: int64 tensor [1] on x's device)."""
    lead = x.shape[:-1]
    H = x.shape[-1]
    V = weight.shape[0]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    N = x2.shape[0]
    BLOCK_N = 16 if N <= 16 else 32 if N <= 32 else 64
    BLOCK_V, BLOCK_H = (4096 if os.environ.get("TRITON_INTERPRET") == "1" else 128), 64  # see lm_head_topk
    n_tiles = triton.cdiv(V, BLOCK_V)
    f = lambda: torch.empty(N, n_tiles, dtype=torch.float32, device=x.device)  # noqa: E731
    m, s, u, gv = f(), f(), f(), f()
    gi = torch.empty(N, n_tiles, dtype=torch.int64, device=x.device)
    ieee = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    _lm_head_stats_kernel[(n_tiles, triton.cdiv(N, BLOCK_N))](
        x2, weight, seed, m, s, u, gv, gi, N, V, H, x2.stride(0), weight.stride(0), weight.stride(1), n_tiles,
        1.0 / temperature, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, IEEE=ieee)
    M = m.max(dim=1, keepdim=True).values
    w = torch.exp(m - M)
    S, U = (s * w).sum(1), (u * w).sum(1)
    lse = M[:, 0] + torch.log(S)
    entropy = lse - U / S
    sample = gi.gather(1, gv.argmax(dim=1, keepdim=True))[:, 0]
    return lse.view(lead), entropy.view(lead), sample.view(lead)


@triton.jit
def _typical_accept_kernel(lse_ptr, ent_ptr, clog_ptr, samp_ptr, paths_ptr, T, P, D1, threshold, alpha,
                           len_ptr, acc_ptr, root_ptr, last_ptr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p, d, in_p, in_d, node, parent = path_tile(paths_ptr, P, D1, BLOCK_P, BLOCK_D)
    node0 = tl.maximum(node, 0)
    par0 = tl.maximum(parent, 0)
    lp = tl.load(clog_ptr + b * T + node0) - tl.load(lse_ptr + b * T + par0)  # log p(child | parent)
    thr = tl.minimum(threshold, alpha * tl.exp(-tl.load(ent_ptr + b * T + par0)))
    ok = (node >= 0) & (tl.exp(lp) > thr)
    rejected = (d[None, :] >= 1) & (~ok)
    length = tl.min(tl.where(rejected, d[None, :], BLOCK_D), axis=1)  # root + accepted, per path
    length = tl.minimum(length, D1)
    score = tl.sum(tl.where((d[None, :] >= 1) & (d[None, :] < length[:, None]), lp, 0.0), axis=1)
    length = tl.where(in_p, length, -1)
    best_len = tl.max(length, axis=0)
    sc = tl.where(length == best_len, score, float("-inf"))
    best_sc = tl.max(sc, axis=0)
    best_p = tl.min(tl.where((length == best_len) & (sc == best_sc), p, BLOCK_P), axis=0)
    row = tl.load(paths_ptr + best_p * D1 + d, mask=in_d, other=-1)
    tl.store(acc_ptr + b * D1 + d, tl.where(d < best_len, row, -1).to(tl.int64), mask=in_d)
    last = tl.sum(tl.where(d == best_len - 1, row, 0), axis=0)
    tl.store(len_ptr + b, best_len.to(tl.int64))
    tl.store(last_ptr + b, last.to(tl.int64))
    tl.store(root_ptr + b, tl.load(samp_ptr + b * T + last))


def typical_accept(lse, entropy, child_logits, samples, paths, posterior_threshold, posterior_alpha):
    """Same contract as reference.typical_accept."""
    B, T = lse.shape
    P, D1 = paths.shape
    dev = lse.device
    new = lambda *s: torch.empty(s, dtype=torch.long, device=dev)  # noqa: E731
    out = (new(B), new(B, D1), new(B), new(B))
    _typical_accept_kernel[(B,)](lse.float().contiguous(), entropy.float().contiguous(), child_logits.float().contiguous(),
                                 samples.to(torch.int64).contiguous(), paths.contiguous(), T, P, D1,
                                 float(posterior_threshold), float(posterior_alpha), *out,
                                 BLOCK_P=triton.next_power_of_2(P), BLOCK_D=triton.next_power_of_2(D1))
    return out
