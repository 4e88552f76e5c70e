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


def replay_accept_lengths(ranks: torch.Tensor, new_tokens: int, tree: Tree) -> list[int]:
    """Greedy speculative decoding of one answer replayed from its head ranks, without running it:
    the tokens each step emits. ranks [new_tokens - 1, heads]: split_ranks' block for the answer
    (row i: position start + i, where `start` is the prompt's last token). The prefill emits the
    first token (the root); a step at position p accepts the deepest tree node whose rank path is a
    prefix of ranks[p], emits it plus the next root (1 + its depth tokens), and the next step starts
    at p + that. Because greedy decoding is lossless, the answer is the same as plain decoding's, so
    this equals the real run's accept lengths (up to rank ties the float rounding of a different
    forward could break the other way)."""
    nodes = set(tree.choices)
    rows = ranks.tolist()
    out, made, p = [], 1, 0
    while made < new_tokens:
        emitted, path = 1, ()
        for r in rows[p] if p < len(rows) else ():
            path += (r,)
            if path not in nodes:  # also stops at -1 (past the end) and UNRANKED
                break
            emitted += 1
        emitted = min(emitted, new_tokens - made)
        out.append(emitted)
        made += emitted
        p += emitted
    return out


def time_tree_sizes(model, drafter, ranks: torch.Tensor, sizes: list[int], prompts: list[list[int]],
                    max_new_tokens: int = 96, max_rank: int = 10, progress: bool = True) -> list[dict]:
    """Real greedy decoding of `prompts` (batch 1) with the grown tree of each size (1: plain decoding).
    Interleaved: each prompt is decoded with every size back to back, the order rotated from prompt to
    prompt, so a drift in the machine's speed (large on shared VMs) hits every size alike rather than
    the sizes that happened to run during it. -> rows {size, tokens_per_s, tokens_per_step,
    expected_tokens_per_step}, tokens_per_s = all tokens / all time at that size."""
    from ..generate import generate

    trees = {s: grow_tree(ranks, s, max_rank, drafter.num_heads) if s > 1 else (None, [1.0]) for s in sizes}
    tot = {s: {"tok": 0, "acc": 0, "steps": 0, "secs": 0.0} for s in sizes}

    def run(size, prompt, n):
        tree = trees[size][0]
        return generate(model, [prompt], drafter=drafter if tree else None, tree=tree, max_new_tokens=n)

    for s in sizes:
        run(s, prompts[0], 8)  # warm-up (first-call dispatch, buffers)
    bar = tqdm(total=len(sizes) * len(prompts), desc="timing tree sizes", disable=not progress)
    for i, p in enumerate(prompts):
        for s in sizes[i % len(sizes):] + sizes[: i % len(sizes)]:
            t0 = time.perf_counter()
            out = run(s, p, max_new_tokens)
            t = tot[s]
            t["secs"] += time.perf_counter() - t0
            t["tok"] += len(out.sequences[0])
            accepted = out.accept_lengths[0] if s > 1 else [1] * (len(out.sequences[0]) - 1)  # plain: 1 per step
            t["acc"] += sum(accepted)
            t["steps"] += len(accepted)
            bar.update()
    bar.close()
    return [{"size": s, "tokens_per_s": tot[s]["tok"] / tot[s]["secs"],
             "tokens_per_step": tot[s]["acc"] / max(1, tot[s]["steps"]),
             "expected_tokens_per_step": trees[s][1][-1]} for s in sizes]
