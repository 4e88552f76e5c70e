"""Triton lm_head_residual_sample: what lossless rejection sampling on a tree needs from the LM head, in
one pass over the vocabulary, the [N, V] logits never written.

Per row (a tree node), of z = logits / temperature: lse (for p(child) = exp(z_child - lse), the
acceptance test) and a token drawn from softmax(z) with the row's excluded tokens removed (its
children's tokens: the residual the walk draws from when it stops there). The draw is a Gumbel-max:
argmax over allowed v of z_v + G_v, G_v = -log(-log U_v), U_v = tl.rand(seed, row * V + v). Removing
tokens from the argmax is exactly renormalising softmax over the rest (the Gumbel-max of a restricted
set is a draw from the restricted softmax), and the noise is drawn once per (row, token), so the
restriction costs only a compare per excluded token, not a second pass.

Why one pass suffices: the walk stops at a node only after rejecting all its children, so the set to
remove at a node is known before the pass (its children's tokens), whatever the walk does. (Keeping
each row's top-(C+1) perturbed tokens and skipping the rejected ones afterwards, C = the fan-out, is
exact too -- at most C tokens are removed -- but costs C+1 max / knock-out rounds per tile and
(C+1)-times larger partials; removing the known children costs a compare per excluded token that lies
in the tile, and the partials stay one token per tile.)

One program per (vocabulary tile, row block): the tile's logits as lm_head_topk computes them; per row
the max m and sum e^(z-m) (lse's partials) and the best perturbed token of the tile. A small merge over
tiles gives lse = M + log sum_t s_t e^(m_t - M) and the best token overall (ties: lowest id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, ieee_dots, interpreted, logits_tile, row_block, vocab_block
from .tuning import k_configs, launch


@triton.jit
def _lm_head_residual_sample_kernel(x_ptr, w_ptr, seed_ptr, ex_ptr, m_ptr, s_ptr, gv_ptr, gi_ptr, N, V, H, C,
                                    s_xn, s_wv, s_wh, n_tiles, inv_temp, BLOCK_N: tl.constexpr,
                                    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    v0 = pid_v * BLOCK_V
    offs_v = v0 + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    v_ok = offs_v < V
    acc = logits_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N, BLOCK_V, BLOCK_H, IEEE)
    z = tl.where(v_ok[None, :], acc * inv_temp, float("-inf"))
    m = tl.max(z, axis=1)
    s = tl.sum(tl.exp(z - m[:, None]), axis=1)  # columns past V: exp(-inf) = 0
    rows = offs_n.to(tl.int64)
    seed = tl.load(seed_ptr)
    r = tl.rand(seed, rows[:, None] * V + offs_v[None, :])  # uniform in [0, 1): one per (row, token)
    g = z - tl.log(-tl.log(tl.maximum(r, 1e-20)))  # z + Gumbel noise
    for c in range(C):  # the row's excluded tokens; a tile holds few of them, so most slots skip the compare
        ex = tl.load(ex_ptr + rows * C + c, mask=n_ok, other=-1)  # [BLOCK_N], -1: none
        here = (ex >= v0) & (ex < v0 + BLOCK_V)
        if tl.max(here.to(tl.int32), axis=0) > 0:
            g = tl.where(offs_v[None, :] == ex[:, None], float("-inf"), g)
    gv = tl.max(g, axis=1)
    cols = tl.arange(0, BLOCK_V)
    gi = tl.min(tl.where(g == gv[:, None], cols[None, :], BLOCK_V), axis=1) + v0  # first index of the max
    o = rows * n_tiles + pid_v
    tl.store(m_ptr + o, m, mask=n_ok)
    tl.store(s_ptr + o, s, mask=n_ok)
    tl.store(gv_ptr + o, gv, mask=n_ok)
    tl.store(gi_ptr + o, gi.to(tl.int64), mask=n_ok)


def _configs(dtype: torch.dtype, BLOCK_N: int) -> list:
    """Launch configs (tuning.k_configs), the hand-picked one first. As lm_head_sample_stats: a 64-row tile keeps
    several fp32 [64, BLOCK_V] values live (logits, exp, noise); 8 warps hold them in registers where 4
    would spill."""
    return k_configs("BLOCK_H", dtype, 8 if BLOCK_N >= 64 else 4)


def lm_head_residual_sample(x, weight, temperature, seed, exclude, *, block_v: int | None = None, config=None):
    """Same contract as reference.lm_head_residual_sample (seed: int64 tensor [1] on x's device).
    block_v: the vocabulary tile (default: common.vocab_block; tests force several tiles with it);
    config: a tuning override (tests)."""
    lead = x.shape[:-1]
    x2 = as_rows(x)  # [N, H]
    (N, H), V = x2.shape, weight.shape[0]
    C = exclude.shape[-1]
    ex = exclude.reshape(N, C).contiguous() if C else torch.full((N, 1), -1, dtype=torch.long, device=x.device)
    BLOCK_V = block_v or vocab_block(V)
    # on a GPU decode-sized row blocks (the weight is read once per block); the interpreter pays per
    # program, so it takes up to 128K-element tiles (same math; a sampling test decodes thousands of rows)
    BLOCK_N = row_block(N)
    if interpreted():
        BLOCK_N = max(BLOCK_N, min(triton.next_power_of_2(N), 2**17 // BLOCK_V))
    n_tiles = triton.cdiv(V, BLOCK_V)
    f = lambda: torch.empty(N, n_tiles, dtype=torch.float32, device=x.device)  # noqa: E731
    m, s, gv = f(), f(), f()
    gi = torch.empty(N, n_tiles, dtype=torch.int64, device=x.device)
    launch(_lm_head_residual_sample_kernel, (n_tiles, triton.cdiv(N, BLOCK_N)),
           (x2, weight, seed, ex, m, s, gv, gi, N, V, H, C, x2.stride(0), weight.stride(0), weight.stride(1),
            n_tiles, 1.0 / temperature), dict(BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, IEEE=ieee_dots(x.dtype)),
           _configs(x.dtype, BLOCK_N), key=["N", "V", "H", "C"], config=config)
    M = m.max(dim=1, keepdim=True).values
    lse = M[:, 0] + torch.log((s * torch.exp(m - M)).sum(1))
    sample = gi.gather(1, gv.argmax(dim=1, keepdim=True))[:, 0]  # first maximum: lowest tile, lowest id
    return lse.view(lead), sample.view(lead)
