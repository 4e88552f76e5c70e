"""Triton rejection_accept: lossless recursive rejection sampling over a tree from LM-head statistics
(no [B, T, V] probabilities), one launch for the batch, no host synchronisation.

Each program walks BLOCK_B sequences side by side. The per-node inputs do not depend on the walk, so
they are loaded up front as [BLOCK_B, T] tiles (one round of memory latency instead of one per node):
parent, token, p(token | parent) = exp(child_logit - lse[parent]) and the node's uniform. The walk then
visits nodes j = 1..T-1 in index order (children come after their parents), reading column j of the
tiles: a child of the current node not repeating a rejected sibling's token is accepted when
u_j * (1 - removed) < p_j (the residual renormalised: r(x) / sum(r) = p(x) / (1 - removed mass));
accepted, it becomes the current node; rejected, its mass joins `removed`. Where the walk stops, the
next root is samples[b, node], lm_head_residual_sample's draw from p with that node's children removed:
exactly the residual there, since the walk stops only after rejecting every child.
Sequence b reads its parents at parents + b * s_pb (s_pb = 0: one shared tree).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreted, pow2, tree_buffer


@triton.jit
def _rejection_accept_kernel(lse_ptr, clog_ptr, samp_ptr, u_ptr, tok_ptr, par_ptr, s_pb, B, T, D1,
                             len_ptr, acc_ptr, root_ptr, last_ptr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < B
    b64 = b.to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    ok = b_ok[:, None] & (t[None, :] < T)
    node = b64[:, None] * T + t[None, :]  # [BLOCK_B, BLOCK_T] into the [B, T] statistics
    par = tl.load(par_ptr + b64[:, None] * s_pb + t[None, :], mask=ok, other=-1)
    tok = tl.load(tok_ptr + node, mask=ok, other=-1)
    lse_par = tl.load(lse_ptr + b64[:, None] * T + tl.maximum(par, 0), mask=ok, other=0.0)
    p = tl.exp(tl.load(clog_ptr + node, mask=ok, other=0.0) - lse_par)  # p(token_j | parent_j)
    u = tl.load(u_ptr + node, mask=ok, other=1.0)
    d = tl.arange(0, BLOCK_D)
    idx = tl.where(d[None, :] == 0, 0, -1) + tl.zeros([BLOCK_B, BLOCK_D], tl.int32)  # the accepted path
    cur = tl.zeros([BLOCK_B], tl.int32)  # current node
    level = tl.zeros([BLOCK_B], tl.int32)  # its depth
    removed = tl.zeros([BLOCK_B], tl.float32)  # mass of its rejected children
    for j in range(1, T):
        col = t[None, :] == j
        pj = tl.sum(tl.where(col, par, 0), axis=1)
        xj = tl.sum(tl.where(col, tok, 0), axis=1)
        prob = tl.sum(tl.where(col, p, 0.0), axis=1)
        uj = tl.sum(tl.where(col, u, 0.0), axis=1)
        # an earlier sibling with the same token was rejected (else the walk had left): its residual is 0
        dup = tl.max(((t[None, :] < j) & (par == pj[:, None]) & (tok == xj[:, None])).to(tl.int32), axis=1) > 0
        tried = (pj == cur) & (~dup)  # padded nodes (parent -1) are never tried
        acc = tried & (uj * tl.maximum(1.0 - removed, 0.0) < prob)
        removed = tl.where(acc, 0.0, tl.where(tried, removed + prob, removed))
        cur = tl.where(acc, j, cur)
        level += acc.to(tl.int32)
        idx = tl.where(acc[:, None] & (d[None, :] == level[:, None]), j, idx)
    tl.store(len_ptr + b64, (level + 1).to(tl.int64), mask=b_ok)
    tl.store(acc_ptr + b64[:, None] * D1 + d[None, :], idx.to(tl.int64), mask=b_ok[:, None] & (d[None, :] < D1))
    tl.store(last_ptr + b64, cur.to(tl.int64), mask=b_ok)
    tl.store(root_ptr + b64, tl.load(samp_ptr + b64 * T + cur, mask=b_ok, other=0), mask=b_ok)


def rejection_accept(lse, child_logits, samples, uniforms, tree_tokens, parents, depth):
    """Same contract as reference.rejection_accept (parents [T] or [B, T])."""
    B, T = lse.shape
    D1 = depth + 1
    parents, s_pb = tree_buffer(parents, 1)
    dev = lse.device
    new = lambda *s: torch.empty(s, dtype=torch.long, device=dev)  # noqa: E731
    out = (new(B), new(B, D1), new(B), new(B))
    # a GPU walks one sequence per program in one warp (the column reads are in-warp reductions, and the
    # sequences run in parallel); the interpreter pays per program, so it walks many sequences together
    BLOCK_B = min(pow2(B), 1024) if interpreted() else 1
    ins = (t.contiguous() for t in (lse, child_logits, samples, uniforms, tree_tokens))
    _rejection_accept_kernel[(triton.cdiv(B, BLOCK_B),)](*ins, parents, s_pb, B, T, D1, *out, BLOCK_B=BLOCK_B,
                                                         BLOCK_T=pow2(T), BLOCK_D=pow2(D1), num_warps=1)
    return out
