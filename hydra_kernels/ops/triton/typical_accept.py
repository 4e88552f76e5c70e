"""Triton typical_accept: Medusa's typical acceptance from LM-head statistics (no [B, T, V] logits).

One program per sequence, all leaf paths at once: along each path, a child is accepted when
p(child) > min(threshold, alpha * exp(-entropy(parent))) with log p(child) = child_logit - lse(parent)
(statistics from lm_head_sample_stats and reference.child_logits); keep the longest path, then the
highest summed log p (first path on ties), and take the next root from the samples. No host
synchronisation. Sequence b reads its leaf paths at paths + b * s_pb (s_pb = 0: one shared tree).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import path_tile, pow2, tree_buffer


@triton.jit
def _typical_accept_kernel(lse_ptr, ent_ptr, clog_ptr, samp_ptr, paths_ptr, s_pb, T, P, D1, threshold, alpha,
                           len_ptr, acc_ptr, root_ptr, last_ptr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    paths_ptr += b * s_pb  # this sequence's tree
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
    """Same contract as reference.typical_accept (paths [P, D+1] or [B, P, D+1])."""
    B, T = lse.shape
    P, D1 = paths.shape[-2:]
    paths, s_pb = tree_buffer(paths, 2)
    dev = lse.device
    new = lambda *s: torch.empty(s, dtype=torch.long, device=dev)  # noqa: E731
    out = (new(B), new(B, D1), new(B), new(B))
    stats = (t.float().contiguous() for t in (lse, entropy, child_logits))
    _typical_accept_kernel[(B,)](*stats, samples.to(torch.int64).contiguous(), paths, s_pb, T, P, D1,
                                 float(posterior_threshold), float(posterior_alpha), *out,
                                 BLOCK_P=pow2(P), BLOCK_D=pow2(D1))
    return out
