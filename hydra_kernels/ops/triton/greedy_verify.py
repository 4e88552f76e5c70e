"""Triton greedy_verify: one program per sequence, all leaf paths at once.

Tile [paths, depth]: a path element is accepted while its token equals the target after its parent;
a path's accepted length is its first rejection; the winner maximises key = length * 65536 +
(65535 - path) (longest, then the first path), matching the reference's tie rule. Sequence b reads its
leaf paths at paths + b * s_pb: s_pb = 0 for one tree shared by the batch, P * (D+1) for a tree per
sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import path_tile, pow2, tree_buffer


@triton.jit
def _greedy_verify_kernel(target_ptr, tokens_ptr, paths_ptr, s_pb, T, P, D1, len_ptr, acc_ptr, root_ptr, last_ptr,
                          BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    paths_ptr += b * s_pb  # this sequence's tree
    p, d, in_p, in_d, node, parent = path_tile(paths_ptr, P, D1, BLOCK_P, BLOCK_D)
    tok = tl.load(tokens_ptr + b * T + tl.maximum(node, 0))
    tgt = tl.load(target_ptr + b * T + tl.maximum(parent, 0))
    rejected = (d[None, :] >= 1) & ((node < 0) | (tok != tgt))  # padding ends a path too
    length = tl.min(tl.where(rejected, d[None, :], BLOCK_D), axis=1)  # [BLOCK_P]: root + accepted
    length = tl.minimum(length, D1)
    key = tl.where(in_p, length.to(tl.int64) * 65536 + (65535 - p), -1)
    best = tl.max(key, axis=0)
    best_len = best // 65536
    best_p = 65535 - best % 65536
    row = tl.load(paths_ptr + best_p * D1 + d, mask=in_d, other=-1)
    tl.store(acc_ptr + b * D1 + d, tl.where(d < best_len, row, -1), mask=in_d)
    last = tl.sum(tl.where(d == best_len - 1, row, 0), axis=0)
    tl.store(len_ptr + b, best_len)
    tl.store(last_ptr + b, last)
    tl.store(root_ptr + b, tl.load(target_ptr + b * T + last))


def greedy_verify(target_tokens, tree_tokens, paths):
    """Same contract as reference.greedy_verify (paths [P, D+1] or [B, P, D+1]; at most 65535 leaf paths)."""
    B, T = tree_tokens.shape
    P, D1 = paths.shape[-2:]
    if P >= 65536:
        raise ValueError("greedy_verify (triton): at most 65535 leaf paths")
    paths, s_pb = tree_buffer(paths, 2)
    dev = tree_tokens.device
    new = lambda *s: torch.empty(s, dtype=torch.long, device=dev)  # noqa: E731
    out = (new(B), new(B, D1), new(B), new(B))
    _greedy_verify_kernel[(B,)](target_tokens.to(torch.int64).contiguous(), tree_tokens.to(torch.int64).contiguous(),
                                paths, s_pb, T, P, D1, *out, BLOCK_P=pow2(P), BLOCK_D=pow2(D1))
    return out
