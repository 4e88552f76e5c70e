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


def dynamic_search_grid():
    """The EAGLE-2 settings (total_tokens, depth, top_k) search_dynamic_tree times by default: small trees, as
    a 2-core CPU affords (a 3-node verify step costs ~1.13x a plain one there, a 16-node one ~1.9x)."""
    from ..drafters.eagle import DynamicTree

    return [DynamicTree(t, d, k) for t, d, k in [(3, 2, 1), (4, 3, 1), (4, 2, 2), (5, 3, 2), (5, 4, 1), (6, 3, 2),
                                                 (6, 4, 2), (8, 4, 2), (8, 3, 3), (10, 4, 3), (12, 5, 3)]]


def search_dynamic_tree(model, drafter, prompts: list[list[int]], max_new_tokens: int = 96, grid=None,
                        progress: bool = True):
    """EAGLE's tree search on this device: real greedy decoding (batch 1) of `prompts` with every dynamic-tree
    setting of `grid` (default dynamic_search_grid()) and with plain decoding, interleaved as time_tree_sizes
    is (each prompt through every setting back to back, the order rotated per prompt). The setting with the
    most tokens/s is recorded as drafter.dynamic_trees[<device type>] (drafter.save writes it as
    dynamic_<device>.json; generate(tree=None) then uses it). -> (the best DynamicTree, rows {total_tokens,
    depth, top_k, tokens_per_s, tokens_per_step, vs_plain}; the plain row has total_tokens 1)."""
    from ..generate import generate

    grid = list(grid or dynamic_search_grid())
    if not grid or not prompts:
        raise ValueError("search_dynamic_tree needs at least one setting and one prompt")
    for spec in grid:  # every setting checked before any timing
        drafter.resolve_tree(spec, model.device.type)
    settings = [None] + grid  # None: plain decoding
    tot = {i: {"tok": 0, "emitted": 0, "steps": 0, "secs": 0.0} for i in range(len(settings))}

    def run(i, prompt, n):
        spec = settings[i]
        return generate(model, [prompt], drafter=None if spec is None else drafter, tree=spec, max_new_tokens=n)

    for i in range(len(settings)):
        run(i, prompts[0], 8)  # warm-up
    bar = tqdm(total=len(settings) * len(prompts), desc="dynamic tree search", disable=not progress)
    for j, p in enumerate(prompts):
        order = list(range(len(settings)))
        for i in order[j % len(order):] + order[: j % len(order)]:
            t0 = time.perf_counter()
            out = run(i, p, max_new_tokens)
            tot[i]["secs"] += time.perf_counter() - t0
            tot[i]["tok"] += len(out.sequences[0])
            tot[i]["emitted"] += len(out.sequences[0]) - 1  # the first token comes from the prefill
            tot[i]["steps"] += out.num_steps
            bar.update()
    bar.close()
    speed = {i: tot[i]["tok"] / tot[i]["secs"] for i in tot}
    rows = [{"total_tokens": 1 if s is None else s.total_tokens, "depth": 0 if s is None else s.depth,
             "top_k": 0 if s is None else s.top_k, "tokens_per_s": speed[i],
             "tokens_per_step": tot[i]["emitted"] / max(1, tot[i]["steps"]), "vs_plain": speed[i] / speed[0]}
            for i, s in enumerate(settings)]
    best = settings[max(range(1, len(settings)), key=lambda i: speed[i])]
    drafter.dynamic_trees[model.device.type] = best
    return best, rows
