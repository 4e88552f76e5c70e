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
        fan_out = {}
        for c in self.choices:
            fan_out[c[:-1]] = fan_out.get(c[:-1], 0) + 1
        self.max_children = max(fan_out.values(), default=0)  # the largest number of children of a node
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

    def host_parents(self) -> list[int]:
        """parents as a host list, from the choices (no device read; built once)."""
        if "_host_parents" not in self.__dict__:
            index = {c: i for i, c in enumerate([()] + self.choices)}
            self._host_parents = [-1] + [index[c[:-1]] for c in self.choices]
        return self._host_parents

    def host_ranks(self) -> list[int]:
        """ranks as a host list (node 0, the root: 0), from the choices (built once)."""
        if "_host_ranks" not in self.__dict__:
            self._host_ranks = [0] + [c[-1] for c in self.choices]
        return self._host_ranks

    def host_sibling_ranks(self) -> list[int]:
        """Each node's rank among its siblings (sibling_ranks of host_parents; built once)."""
        if "_host_sibling_ranks" not in self.__dict__:
            self._host_sibling_ranks = sibling_ranks(self.host_parents())
        return self._host_sibling_ranks

    def to(self, device) -> "Tree":
        """A copy whose tensors live on `device` (the buffers are built once per generate call)."""
        t = object.__new__(Tree)
        t.__dict__.update(self.__dict__)
        for name in ("parents", "depths", "ranks", "ancestors", "mask", "paths", "flat_source"):
            setattr(t, name, getattr(self, name).to(device))
        t.plans = [DepthPlan(p.parents.to(device), p.topk, p.children.to(device), p.child_slot.to(device),
                             p.child_rank.to(device)) for p in self.plans]
        return t

    def subtree(self, num_nodes: int) -> "Tree":
        """The `num_nodes` nodes (root included) this tree keeps at a smaller draft budget: its nodes ranked
        by the prior expected acceptance default_tree grows by (p(d, r) = top1[d] * decay^r along the path;
        a child always ranks below its parent, so every prefix of the ranking is a tree). Nested: the
        subtree of n nodes contains that of n - 1. num_nodes = self.num_nodes gives this tree's nodes."""
        if not 1 <= num_nodes <= self.num_nodes:
            raise ValueError(f"a subtree of {num_nodes} nodes: this tree has {self.num_nodes} (root included)")

        def value(c: tuple[int, ...]) -> float:
            v = 1.0
            for d, r in enumerate(c):
                v *= _PRIOR_TOP1[min(d, len(_PRIOR_TOP1) - 1)] * _PRIOR_RANK_DECAY**r
            return v

        kept = sorted(self.choices, key=lambda c: (-value(c), len(c), c))[: num_nodes - 1]
        return Tree(kept)

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


# from_parent_lists builds trees of up to this many mask entries (B * T * T) in Python, larger ones with tensor ops
# (EPYC VM, 2026-11-28: 1 x 4 nodes 0.03 vs 0.35 ms; 16 x 10 nodes 0.52 vs 0.73 ms)
HOST_BUILD_MAX = 2048


class TreeBatch:
    """A tree per sequence for one step (EAGLE-2's confidence-ranked trees, n-gram matches of varying
    length), padded to a common T; the verify forward, the acceptance ops and commit_kv take it where
    they take a static Tree (same attribute names, one more leading batch dimension).

    parents int64 [B, T] (-1: root and padding), depths int64 [B, T] (padding: 0), mask bool [B, T, T]
    ancestor-or-self (a padded node sees only itself), paths int64 [B, P, D+1] leaf paths (-1 padded; a
    sequence with fewer leaves gets [0, -1, ...] rows, which accept nothing), valid bool [B, T];
    max_children = T - 1, a bound on any node's number of children (Tree.max_children is exact).
    Padded nodes lie on no path, so they are never accepted; their K/V rows are written and dropped.
    """

    def __init__(self, parents: torch.Tensor, valid: torch.Tensor | None = None, max_depth: int | None = None):
        """parents int [B, T]: node i's parent index (< i; -1 for the root, node 0, and for padded nodes);
        valid bool [B, T] (default: every node); max_depth: a known bound on the trees' depth (the
        ancestor walk then stops there instead of at T - 1 levels). Built on parents' device, without a
        host read there."""
        if parents.dim() != 2 or parents.dtype.is_floating_point or parents.shape[1] < 1:
            raise ValueError(f"parents must be an integer [B, T] tensor with T >= 1, got {parents.dtype} {tuple(parents.shape)}")
        B, T = parents.shape
        dev = parents.device
        parents = parents.long()
        valid = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.bool()
        if parents.device.type == "cpu":  # a cheap structural check where it costs no device sync
            node = torch.arange(T)
            bad = valid[:, 1:] & ((parents[:, 1:] < 0) | (parents[:, 1:] >= node[1:]))
            if bool(bad.any()) or not bool(valid[:, 0].all()):
                raise ValueError("every valid non-root node needs a parent with a smaller index, and node 0 (the root) must be valid")
            par_ok = valid.gather(1, parents[:, 1:].clamp(min=0))
            if bool((valid[:, 1:] & ~par_ok).any()):
                raise ValueError("a valid node has a padded parent")
        parents = torch.where(valid, parents, torch.full_like(parents, -1))
        parents[:, 0] = -1
        # ancestor-or-self mask, one depth level at a time: anc holds each node's ancestor k levels up
        mask = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
        bidx = torch.arange(B, device=dev)[:, None]
        node = torch.arange(T, device=dev).expand(B, T)
        mask[bidx, node, node] = True
        depths = torch.zeros(B, T, dtype=torch.long, device=dev)
        anc = parents
        for _ in range(T - 1 if max_depth is None else min(T - 1, max_depth)):  # padded and root nodes stop at once
            up = anc >= 0
            mask[bidx.expand(B, T)[up], node[up], anc[up]] = True
            depths += up.long()
            anc = torch.where(up, parents.gather(1, anc.clamp(min=0)), anc)
        self._finish(parents, depths, mask, valid)

    def _finish(self, parents, depths, mask, valid) -> None:
        """Set the buffers from parents / depths / mask / valid [B, T(, T)] and derive the leaf paths."""
        B, T = parents.shape
        dev = parents.device
        bidx = torch.arange(B, device=dev)[:, None]
        node = torch.arange(T, device=dev).expand(B, T)
        self.parents, self.depths, self.mask, self.valid = parents, depths, mask, valid
        self.num_nodes = T
        D = int(depths.max()) if T > 1 else 0  # one host read per built tree (its paths' width)
        self.depth = D
        self.max_children = T - 1  # a bound on any node's number of children, known without a host read
        # leaves: valid nodes no valid node names as parent
        has_child = torch.zeros(B, T, dtype=torch.bool, device=dev)
        has_child[bidx.expand(B, T)[valid & (parents >= 0)], parents[valid & (parents >= 0)]] = True
        leaf = valid & ~has_child  # [B, T]
        P = int(leaf.sum(1).max())
        # each leaf's path from the root: ancestors ordered by depth, leaf last
        order = torch.argsort((~leaf).long() * T + node, dim=1, stable=True)[:, :P]  # leaves first, by index
        is_leaf = leaf.gather(1, order)  # [B, P]
        anc_mask = mask[bidx, order]  # [B, P, T] ancestors-or-self of each leaf
        lvl = torch.where(anc_mask, depths[:, None, :], torch.full_like(anc_mask, D + 1, dtype=torch.long))
        paths = torch.full((B, P, D + 1), -1, dtype=torch.long, device=dev)
        # node j sits at column depths[j] of the leaf's path
        b3, p3, j3 = torch.nonzero(anc_mask & is_leaf[:, :, None], as_tuple=True)
        paths[b3, p3, lvl[b3, p3, j3]] = j3
        paths[:, :, 0] = 0  # padding rows: just the root
        self.paths = paths

    @classmethod
    def kept(cls, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
             sel: torch.Tensor) -> "TreeBatch":
        """The trees restricted to nodes sel [B, T] (increasing ids per row, every kept valid node's parent
        kept too), from a tree batch's parents / depths / mask / valid [B, T0(, T0)] (a static Tree's
        expanded): the mask and depths gathered, not rebuilt level by level (the adaptive budget cuts a
        proposal every step). Kept nodes that were padding stay padding."""
        B, T0 = parents.shape
        T = sel.shape[1]
        dev = sel.device
        inv = torch.full((B, T0), -1, dtype=torch.long, device=dev)
        inv.scatter_(1, sel, torch.arange(T, device=dev).expand(B, T))
        kept_valid = valid.gather(1, sel)
        par = inv.gather(1, parents.gather(1, sel).clamp(min=0))
        par = torch.where(kept_valid, par, torch.full_like(par, -1))
        par[:, 0] = -1
        rows = mask.gather(1, sel[:, :, None].expand(B, T, T0))  # [B, T, T0]
        kept_mask = rows.gather(2, sel[:, None, :].expand(B, T, T)) & kept_valid[:, None, :]
        eye = torch.eye(T, dtype=torch.bool, device=dev)
        kept_mask = torch.where(kept_valid[:, :, None], kept_mask, eye)  # a padded node sees only itself
        t = object.__new__(cls)
        t._finish(par, torch.where(kept_valid, depths.gather(1, sel), torch.zeros_like(par)), kept_mask, kept_valid)
        return t

    @classmethod
    def from_parent_lists(cls, parent_lists: Sequence[Sequence[int]], device=None) -> "TreeBatch":
        """One parent list per sequence (node 0 first with parent -1), of any lengths; padded to the longest.
        The same buffers as the constructor's, built on the host in Python and copied once each: the n-gram and
        combined drafters build one of these every drafting step, and for their few small trees the
        constructor's ~30 tensor ops (~0.35 ms on a 2-core CPU) cost more than the lists' own walk (~0.03 ms).
        Past HOST_BUILD_MAX mask entries (B * T * T) the lists would cost more: the constructor builds it."""
        B = len(parent_lists)
        if B == 0 or any(len(p) == 0 for p in parent_lists):
            raise ValueError("from_parent_lists needs at least one sequence, each with its root (node 0)")
        T = max(len(p) for p in parent_lists)
        if B * T * T > HOST_BUILD_MAX:
            parents = torch.full((B, T), -1, dtype=torch.long)
            valid = torch.zeros(B, T, dtype=torch.bool)
            for b, p in enumerate(parent_lists):
                parents[b, : len(p)] = torch.tensor(list(p), dtype=torch.long)
                valid[b, : len(p)] = True
            return cls(parents.to(device), valid.to(device))
        par = [[-1] * T for _ in range(B)]
        dep = [[0] * T for _ in range(B)]
        mask = [[[i == j for j in range(T)] for i in range(T)] for _ in range(B)]  # a padded node sees itself
        valid = [[i < len(p) for i in range(T)] for p in parent_lists]
        paths_b, D = [], 0
        for b, p in enumerate(parent_lists):
            if p[0] != -1:
                raise ValueError(f"sequence {b}: node 0 (the root) must have parent -1, got {p[0]}")
            has_child = [False] * len(p)
            for i, q in enumerate(p):
                row = mask[b][i]
                if i == 0:
                    continue
                q = int(q)
                if not 0 <= q < i:
                    raise ValueError("every valid non-root node needs a parent with a smaller index, and node 0 "
                                     f"(the root) must be valid: sequence {b} node {i} has parent {q}")
                par[b][i], dep[b][i], has_child[q] = q, dep[b][q] + 1, True
                row[:i] = mask[b][q][:i]  # a node's ancestors are its parent's ancestors-or-self
            D = max(D, max(dep[b]))
            paths_b.append([i for i in range(len(p)) if not has_child[i]])  # leaves, by index
        P = max(len(leaves) for leaves in paths_b)
        paths = [[[-1] * (D + 1) for _ in range(P)] for _ in range(B)]
        for b, leaves in enumerate(paths_b):
            for r in range(P):
                paths[b][r][0] = 0  # padding rows: just the root
            for r, leaf in enumerate(leaves):
                j = leaf
                while j >= 0:  # node j sits at column depths[j] of the leaf's path
                    paths[b][r][dep[b][j]] = j
                    j = par[b][j]
        t = object.__new__(cls)
        t.parents, t.depths = torch.tensor(par, device=device), torch.tensor(dep, device=device)
        t.mask, t.valid = torch.tensor(mask, device=device), torch.tensor(valid, device=device)
        t.paths = torch.tensor(paths, dtype=torch.long, device=device)
        t.num_nodes, t.depth, t.max_children = T, D, T - 1
        return t

    @classmethod
    def from_paths(cls, paths: torch.Tensor, num_nodes: int) -> "TreeBatch":
        """A tree per sequence given by its leaf paths, built with device ops only (no host read, so a
        drafter can build it on the GPU inside a step): paths int [B, P, D+1], row p = the node ids of leaf
        p's path from the root (column d: its node at depth d, column 0 the root 0; -1 past the leaf, a row
        [0, -1, ...] is padding); num_nodes T > every id. Nodes no path names are padding. The caller
        vouches that the paths form a tree (a node has one depth and one parent, parent id < child id) and
        that every row ends at a leaf; the leaves keep the rows' order (the constructor's is by node id)."""
        if paths.dim() != 3 or paths.dtype.is_floating_point or paths.shape[2] < 1:
            raise ValueError(f"paths must be an integer [B, P, D+1] tensor, got {paths.dtype} {tuple(paths.shape)}")
        B, P, D1 = paths.shape
        T, dev = num_nodes, paths.device
        paths = paths.long()
        idx = torch.where(paths >= 0, paths, torch.full_like(paths, T))  # unnamed entries write to a spare column T
        flat = idx.reshape(B, P * D1)
        valid = torch.zeros(B, T + 1, dtype=torch.bool, device=dev).scatter_(1, flat, True)[:, :T].contiguous()
        valid[:, 0] = True
        level = torch.arange(D1, device=dev).expand(B, P, D1).reshape(B, P * D1)
        depths = torch.zeros(B, T + 1, dtype=torch.long, device=dev).scatter_(1, flat, level)[:, :T].contiguous()
        parents = torch.full((B, T + 1), -1, dtype=torch.long, device=dev)
        if D1 > 1:
            parents.scatter_(1, idx[:, :, 1:].reshape(B, -1), paths[:, :, :-1].reshape(B, -1))
        parents = parents[:, :T].contiguous()
        parents[:, 0] = -1
        # ancestor-or-self: along a row, the node at depth d sees the nodes at depths <= d
        below = torch.ones(D1, D1, dtype=torch.bool, device=dev).tril()
        rows = idx[:, :, :, None].expand(B, P, D1, D1)
        cols = torch.where(below, idx[:, :, None, :], torch.full_like(rows, T))
        mask = torch.zeros(B, T + 1, T + 1, dtype=torch.bool, device=dev)
        mask.index_put_((torch.arange(B, device=dev)[:, None, None, None], rows, cols),
                        torch.ones((), dtype=torch.bool, device=dev))
        mask = mask[:, :T, :T].contiguous()
        mask.diagonal(dim1=1, dim2=2).fill_(True)  # padded nodes see only themselves
        t = object.__new__(cls)
        t.parents, t.depths, t.mask, t.valid = parents, depths, mask, valid
        t.num_nodes, t.depth, t.paths = T, D1 - 1, paths
        t.max_children = T - 1  # a bound (as in __init__)
        return t

    def to(self, device) -> "TreeBatch":
        """A copy whose tensors live on `device` (build on the CPU, where construction reads nothing
        back from a device, then move)."""
        t = object.__new__(TreeBatch)
        t.__dict__.update(self.__dict__)
        for name in ("parents", "depths", "mask", "valid", "paths"):
            setattr(t, name, getattr(self, name).to(device))
        return t

    @classmethod
    def from_tree(cls, tree: "Tree", batch_size: int) -> "TreeBatch":
        """The static tree repeated for every sequence (its per-sequence form)."""
        return cls(tree.parents[None].expand(batch_size, -1).clone())

    def __repr__(self) -> str:
        return f"TreeBatch(batch={self.parents.shape[0]}, num_nodes={self.num_nodes}, depth={self.depth})"


def run_subtree(full: Tree, nodes: int, built: dict, device) -> Tree:
    """full.subtree(nodes) on `device`, built once per run (`built`: the run state's dict of them); the
    full tree's size gives `full` itself. For a drafter's set_budget."""
    if nodes == full.num_nodes:
        return full
    if nodes not in built:
        built[nodes] = full.subtree(nodes).to(device)
    return built[nodes]


def sibling_ranks(parents: list[int]) -> list[int]:
    """parents (a host list, root first) -> each node's rank among its siblings (0: its parent's first child),
    as adaptive.sibling_rank computes it on tensors."""
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


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
    """generate()'s tree argument -> Tree: a Tree, a list of choices, a JSON file of choices, 'default',
    or 'chain-N' (N >= 1). The one place that parses it; a tree must draft at least one node (a root-only
    tree would run speculative decoding that never speculates)."""
    if isinstance(tree, Tree):
        t = tree
    elif isinstance(tree, (str, Path)):
        s = str(tree)
        if s == "default":
            t = default_tree()
        elif s.startswith("chain-"):
            n = s[len("chain-"):]
            if not (n.isascii() and n.isdigit() and int(n) >= 1):
                raise ValueError(f"tree {s!r}: 'chain-N' needs a whole number N >= 1 of drafted tokens, e.g. 'chain-4'")
            t = chain(int(n))
        elif Path(s).is_file():
            try:
                t = Tree.load(s)
            except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"tree file {s} is not a JSON list of choices (lists of ranks): {e}") from e
        else:
            raise ValueError(f"unknown tree {s!r}: pass a Tree, a list of choices, a JSON file, 'default' or 'chain-N'")
    elif isinstance(tree, Sequence) or hasattr(tree, "__iter__"):
        t = Tree(_choice_list(tree))
    else:
        raise TypeError(f"tree must be a Tree, a list of choices, a JSON file, 'default' or 'chain-N', got {tree!r}")
    if t.num_nodes < 2:
        raise ValueError("the tree drafts no token (only the root): pass at least one choice, e.g. [[0]] or 'chain-1'")
    return t


def _choice_list(choices) -> list[list[int]]:
    """Medusa-format choices, each a list of int ranks (numpy integers accepted), checked for type."""
    out = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not hasattr(c, "__iter__"):
            raise TypeError(f"a tree choice must be a list of ranks, e.g. [0, 1], got {c!r}")
        ranks = []
        for r in c:
            if isinstance(r, (bool, float)) or not hasattr(r, "__index__"):
                raise TypeError(f"tree choice {list(c)!r}: ranks must be ints, got {r!r}")
            ranks.append(r.__index__())
        out.append(ranks)
    return out
