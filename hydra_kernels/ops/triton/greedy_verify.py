"""Triton greedy_verify: one program per sequence, all leaf paths at once.

Tile [paths, depth]: a path element is accepted while its token equals the target after its parent;
a path's accepted length is its first rejection; the winner maximises key = length * 65536 +
(65535 - path) (longest, then the first path), matching the reference's tie rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def path_tile(paths_ptr, P, D1, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [paths, depth] tile of node ids (-1 padding) and each element's parent (the previous one)."""
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    in_p = p < P
    in_d = d < D1
    node = tl.load(paths_ptr + p[:, None] * D1 + d[None, :], mask=in_p[:, None] & in_d[None, :], other=-1)
    parent = tl.load(paths_ptr + p[:, None] * D1 + d[None, :] - 1,
                     mask=in_p[:, None] & in_d[None, :] & (d[None, :] >= 1), other=0)
    return p, d, in_p, in_d, node, parent


@triton.jit
def _greedy_verify_kernel(target_ptr, tokens_ptr, paths_ptr, T, P, D1, len_ptr, acc_ptr, root_ptr, last_ptr,
                          BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
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
    """Same contract as reference.greedy_verify (at most 65535 leaf paths)."""
    B, T = tree_tokens.shape
    P, D1 = paths.shape
    if P >= 65536:
        raise ValueError("greedy_verify (triton): at most 65535 leaf paths")
    dev = tree_tokens.device
    new = lambda *s: torch.empty(s, dtype=torch.long, device=dev)
    out = (new(B), new(B, D1), new(B), new(B))
    _greedy_verify_kernel[(B,)](target_tokens.to(torch.int64).contiguous(), tree_tokens.to(torch.int64).contiguous(),
                                paths.contiguous(), T, P, D1, *out,
                                BLOCK_P=triton.next_power_of_2(P), BLOCK_D=triton.next_power_of_2(D1))
    return out
