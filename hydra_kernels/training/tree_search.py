"""Tree search (Hydra paper, section 4): grow the tree one node at a time, each time adding the node
that most raises the expected number of accepted tokens, estimated on held-out text; then time real
decoding at each size on this device and keep the fastest.

A node with rank path c = (r_0, ..., r_d) is accepted at position p iff ranks[p, :d+1] == c
(evaluate.head_ranks), so its acceptance probability is the fraction of positions whose rank prefix
is c, and E[tokens per step] = 1 + sum over nodes of that probability. Since a child is never more
likely than its parent, adding nodes in decreasing probability (shorter first on ties) is the greedy
growth and keeps every prefix in the tree.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
from tqdm.auto import tqdm

from ..tree import Tree


def path_frequencies(ranks: torch.Tensor, max_rank: int) -> Counter:
    """Counter of rank-path prefixes over positions (prefixes stop at the first rank >= max_rank)."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        path = []
        for r in row:
            if r < 0 or r >= max_rank:
                break
            path.append(r)
            counts[tuple(path)] += 1
    return counts


def grow_tree(ranks: torch.Tensor, num_nodes: int, max_rank: int = 10, max_depth: int | None = None) -> tuple[Tree, list[float]]:
    """The greedy tree of `num_nodes` nodes (root included) and the expected tokens per step after
    each added node (entry i: a tree of i + 1 nodes)."""
    counts = path_frequencies(ranks, max_rank)
    n = max(1, ranks.shape[0])
    order = sorted((c for c in counts if max_depth is None or len(c) <= max_depth),
                   key=lambda c: (-counts[c], len(c), c))[: num_nodes - 1]
    expected = [1.0]
    for c in order:
        expected.append(expected[-1] + counts[c] / n)
    return Tree(order), expected


def time_tree_sizes(model, drafter, ranks: torch.Tensor, sizes: list[int], prompts: list[list[int]],
                    max_new_tokens: int = 96, max_rank: int = 10, progress: bool = True) -> list[dict]:
    """Real greedy decoding of `prompts` (one at a time) with the grown tree of each size (1: plain
    decoding). -> rows {size, tokens_per_s, tokens_per_step, expected_tokens_per_step}."""
    from ..generate import generate

    rows = []
    for size in tqdm(sizes, desc="timing tree sizes", disable=not progress):
        tree, expected = grow_tree(ranks, size, max_rank, drafter.num_heads) if size > 1 else (None, [1.0])
        generate(model, [prompts[0]], drafter=drafter if tree else None, tree=tree, max_new_tokens=8)  # warm-up
        n_tok, n_acc, n_steps, secs = 0, 0, 0, 0.0
        for p in prompts:
            t0 = time.perf_counter()
            out = generate(model, [p], drafter=drafter if tree else None, tree=tree, max_new_tokens=max_new_tokens)
            secs += time.perf_counter() - t0
            n_tok += len(out.sequences[0])
            n_acc += sum(out.accept_lengths[0]) if tree else len(out.sequences[0]) - 1
            n_steps += len(out.accept_lengths[0]) if tree else len(out.sequences[0]) - 1
        rows.append({"size": size, "tokens_per_s": n_tok / secs, "tokens_per_step": n_acc / max(1, n_steps),
                     "expected_tokens_per_step": expected[-1]})
    return rows
