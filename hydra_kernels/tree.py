"""Draft trees: Medusa-format choices -> the buffers one decoding step needs.

A choice is a path of top-k ranks from the root: (0,) is head 1's best guess, (0, 1) is head 2's
second-best guess after it. Nodes are in BFS order (by depth, then lexicographically); node 0 is the
root (the token the base model already predicted). Node i sits at sequence position L + depths[i].
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch


@dataclass
class DepthPlan:
    """How the nodes at one depth d >= 1 are drafted (head d-1, 0-based, run on their parents)."""

    parents: torch.Tensor  # [n_p] nodes at depth d-1 that have children
    topk: int  # k = 1 + the largest rank among the children
    children: torch.Tensor  # [n_c] the nodes at depth d
    child_slot: torch.Tensor  # [n_c] index of each child's parent in `parents`
    child_rank: torch.Tensor  # [n_c] rank of each child among its parent's top-k


class Tree:
    def __init__(self, choices: Sequence[Sequence[int]]):
        paths = [tuple(int(r) for r in c) for c in choices]
        for c in paths:
            if len(c) == 0:
                raise ValueError("a tree choice is empty; the root is implicit, list only paths of length >= 1")
            if any(r < 0 for r in c):
                raise ValueError(f"tree choice {list(c)} has a negative rank")
        if len(set(paths)) != len(paths):
            dup = next(c for c in paths if paths.count(c) > 1)
            raise ValueError(f"tree choice {list(dup)} appears more than once")
        known = set(paths)
        for c in paths:
            if len(c) > 1 and c[:-1] not in known:
                raise ValueError(f"tree choice {list(c)} needs its prefix {list(c[:-1])} in the tree too")
        self.choices: list[tuple[int, ...]] = sorted(paths, key=lambda c: (len(c), c))
        nodes = [()] + self.choices
        index = {c: i for i, c in enumerate(nodes)}
        T = len(nodes)
        self.num_nodes = T
        self.depth = max((len(c) for c in nodes), default=0)
        self.parents = torch.tensor([-1] + [index[c[:-1]] for c in self.choices], dtype=torch.long)
        self.depths = torch.tensor([len(c) for c in nodes], dtype=torch.long)
        self.ranks = torch.tensor([0] + [c[-1] for c in self.choices], dtype=torch.long)
        # ancestors[i, d] = node index of i's ancestor at depth d (i itself at its depth; -1 beyond)
        self.ancestors = torch.full((T, self.depth + 1), -1, dtype=torch.long)
        self.mask = torch.zeros(T, T, dtype=torch.bool)  # ancestor-or-self
        for i, c in enumerate(nodes):
            for d in range(len(c) + 1):
                a = index[c[:d]]
                self.ancestors[i, d] = a
                self.mask[i, a] = True
        prefixes = {c[:-1] for c in self.choices}
        leaves = [i for i, c in enumerate(nodes) if c not in prefixes]
        self.paths = self.ancestors[leaves]  # [P, depth + 1] leaf paths, padded with -1
        self.plans: list[DepthPlan] = []
        for d in range(1, self.depth + 1):
            children = [i for i, c in enumerate(nodes) if len(c) == d]
            parents = sorted({int(self.parents[i]) for i in children})
            slot = {p: s for s, p in enumerate(parents)}
            self.plans.append(DepthPlan(
                parents=torch.tensor(parents, dtype=torch.long),
                topk=1 + max(nodes[i][-1] for i in children),
                children=torch.tensor(children, dtype=torch.long),
                child_slot=torch.tensor([slot[int(self.parents[i])] for i in children], dtype=torch.long),
                child_rank=torch.tensor([nodes[i][-1] for i in children], dtype=torch.long),
            ))

        # flat_source[t]: index of node t's token in the per-depth top-k lists concatenated (Medusa drafts
        # every depth from h alone, so node t is simply candidate offset[depth] + rank; node 0 unused)
        offsets = [0]
        for plan in self.plans:
            offsets.append(offsets[-1] + plan.topk)
        self.flat_source = torch.tensor([0] + [offsets[len(c) - 1] + c[-1] for c in self.choices], dtype=torch.long)

    def to(self, device) -> "Tree":
        """A copy whose tensors live on `device` (the buffers are built once per generate call)."""
        t = object.__new__(Tree)
        t.__dict__.update(self.__dict__)
        for name in ("parents", "depths", "ranks", "ancestors", "mask", "paths", "flat_source"):
            setattr(t, name, getattr(self, name).to(device))
        t.plans = [DepthPlan(p.parents.to(device), p.topk, p.children.to(device), p.child_slot.to(device),
                             p.child_rank.to(device)) for p in self.plans]
        return t

    def check_heads(self, num_heads: int) -> None:
        if self.depth > num_heads:
            raise ValueError(
                f"the tree is {self.depth} deep but the drafter has {num_heads} heads; use a tree of depth "
                f"<= {num_heads} (e.g. hk.tree.default_tree(depth={num_heads}))"
            )

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, depth={self.depth}, leaves={self.paths.shape[0]})"

    def save(self, path) -> None:
        Path(path).write_text(json.dumps([list(c) for c in self.choices]))

    @classmethod
    def load(cls, path) -> "Tree":
        return cls(json.loads(Path(path).read_text()))


def chain(depth: int) -> Tree:
    """The trivial tree: one path of top-1 guesses, [[0], [0, 0], ...]."""
    return Tree([[0] * d for d in range(1, depth + 1)])


# Assumed top-1 accuracy of heads 1..5 and the share of the remaining mass each next rank gets; only
# used to shape the default tree until a searched tree (measured acceptance) replaces it.
_PRIOR_TOP1 = (0.6, 0.45, 0.35, 0.28, 0.22)
_PRIOR_RANK_DECAY = 0.45


def default_tree(num_nodes: int = 64, depth: int = 4, max_rank: int = 10) -> Tree:
    """A tree of `num_nodes` nodes (root included) grown greedily by expected acceptance under a prior:
    P(node) = prod over its path of p(d, r), p(d, r) = top1[d] * decay^r. Children always score below
    their parent, so taking the best candidates in order keeps every prefix present."""
    if not 1 <= depth <= len(_PRIOR_TOP1):
        raise ValueError(f"depth must be in [1, {len(_PRIOR_TOP1)}], got {depth}")

    def p(d: int, r: int) -> float:
        return _PRIOR_TOP1[d] * _PRIOR_RANK_DECAY**r

    choices: list[tuple[int, ...]] = []
    heap = [(-p(0, r), (r,)) for r in range(max_rank)]
    heapq.heapify(heap)
    while heap and len(choices) < num_nodes - 1:
        neg, c = heapq.heappop(heap)
        choices.append(c)
        if len(c) < depth:
            for r in range(max_rank):
                heapq.heappush(heap, (neg * p(len(c), r), c + (r,)))
    return Tree(choices)


def as_tree(tree) -> Tree:
    """Tree, list of choices, a JSON file of choices, 'default', or 'chain-N' -> Tree."""
    if isinstance(tree, Tree):
        return tree
    if isinstance(tree, (str, Path)):
        s = str(tree)
        if s == "default":
            return default_tree()
        if s.startswith("chain-"):
            return chain(int(s.split("-", 1)[1]))
        if Path(s).is_file():
            return Tree.load(s)
        raise ValueError(f"unknown tree {s!r}: pass a Tree, a list of choices, a JSON file, 'default' or 'chain-N'")
    return Tree(tree)
