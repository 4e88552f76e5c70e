"""One per-step tree from two drafters: n-gram (prompt lookup) candidates and a trained drafter's tree.

Every step, per sequence, both drafts hang under the shared root: the trained drafter's static tree
(e.g. the shipped Hydra heads') and the n-gram trie (ngram.py). At most `node_budget` nodes are kept
(root included), and the step chooses which candidates earn them: when the n-gram match is long (its
suffix >= strong_match tokens) the n-gram continuation takes nodes first and the heads' tree gets what is
left, else the heads' tree comes first. Either part is cut to a prefix of its nodes (both keep every
parent before its children, so a prefix is a valid subtree). Verification is the base model's, so greedy
output stays exactly plain greedy decoding's. Heads with sampled drafts (draft_temperature > 0): their
nodes keep their draft distributions and an n-gram node gets its token's one-hot row (a deterministic
draft), so rejection acceptance stays exact where both kinds are siblings under the root.

The heads' tokens stay on the device; the n-gram tokens (host) join them in one copy and one gather.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..tree import Tree, TreeBatch
from .checkpoint import FORMAT
from .ngram import NgramDrafter
from ..budget import save_tables
from .protocol import Drafter, Proposal


class CombinedState:
    def __init__(self, ngram, heads, heads_levels: tuple[int, ...], budget: int, device):
        self.ngram, self.heads = ngram, heads
        # heads_levels: the node budgets the heads take (their budget_levels; the largest: their whole tree)
        self.heads_levels, self.budget, self.device = heads_levels, budget, device
        self.heads_limit = None  # size_part's bound on the heads' nodes (None: the step's budget alone)
        # the heads' tree of n nodes -> (its parents as a host list, its nodes' ranks on the host and on the device)
        self.heads_lists = {}
        self.use_ngram, self.use_heads = True, True  # set_parts (the adaptive budget)
        self.root_only = Tree([])  # the heads' draft while they are held back
        self.part_s = [0.0, 0.0]  # seconds the last propose() spent in each part (ngram, heads)


class CombinedDrafter(Drafter):
    """hk.new_drafter(model, kind="combined", drafters=[ngram, heads], node_budget=None, strong_match=2).

    ngram: an NgramDrafter; heads: a drafter proposing a static Tree (Medusa, Hydra, Hydra++).
    node_budget: most nodes per sequence and step, root included (None: both drafts whole).
    strong_match: n-gram suffix length from which the n-gram continuation is served first."""

    kinds = ("combined",)
    parts = ("ngram", "heads")  # Proposal.groups: 0 an n-gram node, 1 a heads node

    def __init__(self, ngram: NgramDrafter, heads: Drafter, node_budget: int | None = None, strong_match: int = 2):
        super().__init__()
        if not isinstance(ngram, NgramDrafter):
            raise ValueError(f"the combined drafter's first part must be an ngram drafter, got {type(ngram).__name__}")
        if not isinstance(heads, Drafter) or isinstance(heads, (NgramDrafter, CombinedDrafter)):
            raise ValueError(f"the combined drafter's second part must be a trained drafter, got {type(heads).__name__}")
        if node_budget is not None and (not isinstance(node_budget, int) or node_budget < 2):
            raise ValueError(f"node_budget must be an int >= 2 (the root and one draft node) or None, got {node_budget!r}")
        if not isinstance(strong_match, int) or strong_match < 1:
            raise ValueError(f"strong_match must be a positive int, got {strong_match!r}")
        self.ngram, self.heads = ngram, heads
        self.node_budget, self.strong_match = node_budget, strong_match

    @property
    def kind(self) -> str:
        return "combined"

    @property
    def feature_layers(self):  # the n-gram part reads no features: the trained part's
        return self.heads.feature_layers

    @classmethod
    def new(cls, model, kind: str = "combined", drafters=None, node_budget: int | None = None,
            strong_match: int = 2) -> "CombinedDrafter":
        if drafters is None or len(drafters) != 2:
            got = None if drafters is None else [type(d).__name__ for d in drafters]
            raise ValueError(f"drafters must be [an ngram drafter, a trained drafter], got {got}")
        ngram, heads = drafters if isinstance(drafters[0], NgramDrafter) else drafters[::-1]
        return cls(ngram, heads, node_budget, strong_match)

    def check_model(self, model) -> None:
        self.ngram.check_model(model)
        self.heads.check_model(model)

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """`tree` selects the heads' tree (None: theirs for this device class). Returns a bound: the
        heads' tree and the n-gram bound side by side under the root (bound.heads_tree: the heads' own)."""
        heads_tree = self.heads.resolve_tree(tree, device_type)
        ng = self.ngram.resolve_tree(None, device_type)
        shift = 1 + max((c[0] for c in heads_tree.choices), default=-1)
        bound = Tree(list(heads_tree.choices) + [(c[0] + shift,) + c[1:] for c in ng.choices])
        bound.heads_tree = heads_tree
        return bound

    def prepare(self, model, backends) -> None:
        self.ngram.prepare(model, backends)
        self.heads.prepare(model, backends)

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> CombinedState:
        ht = tree.heads_tree
        budget = self.node_budget or tree.num_nodes
        state = CombinedState(self.ngram.start(model, batch_size, max_seq_len, ht, backends),
                              self.heads.start(model, batch_size, max_seq_len, ht, backends),
                              tuple(sorted(self.heads.budget_levels(ht))), budget, model.device)
        self._size_heads(state)
        return state

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        """Any node budget up to the run's (node_budget, else both drafts whole): a step keeps that many
        nodes of the two drafts, by the same rule as node_budget (the stronger draft first)."""
        return tuple(range(1, (self.node_budget or tree.num_nodes) + 1))

    def set_budget(self, state: CombinedState, nodes: int) -> None:
        # never past node_budget: a budget table searched at a larger node_budget (its tree key is the bound's,
        # which node_budget does not change) must not lift the cap
        state.budget = min(nodes, self.node_budget or nodes)
        self._size_heads(state)

    def _size_heads(self, state: CombinedState) -> None:
        """The heads draft no more nodes than the step keeps (their subtree of that size, Tree.subtree): at a
        budget of 2 the shipped chain's second head would run for a node the merge drops."""
        cap = state.budget if state.heads_limit is None else min(state.budget, state.heads_limit)
        drafting = [n for n in state.heads_levels if n > 1]  # set_budget takes budgets > 1 (1: a plain step)
        fits = [n for n in drafting if n <= cap]
        if drafting:  # the largest that fits, else the smallest the heads draft
            self.heads.set_budget(state.heads, fits[-1] if fits else drafting[0])

    def set_parts(self, state: CombinedState, parts: tuple[bool, ...]) -> None:
        state.use_ngram, state.use_heads = parts
        self.heads.set_parts(state.heads, (True,))  # the adaptive budget: the heads report their guesses' classes

    def size_part(self, state: CombinedState, part: int, nodes: int | None) -> None:
        if part == self.parts.index("heads") and nodes != state.heads_limit:  # the n-gram lookup costs per step, not per node
            state.heads_limit = nodes
            self._size_heads(state)

    def use_generator(self, state: CombinedState, generator) -> None:
        self.ngram.use_generator(state.ngram, generator)
        self.heads.use_generator(state.heads, generator)

    def after_prefill(self, state: CombinedState, hidden, lengths) -> None:
        self.ngram.after_prefill(state.ngram, hidden, lengths)
        self.heads.after_prefill(state.heads, hidden, lengths)

    def after_step(self, state: CombinedState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        self.ngram.after_step(state.ngram, accepted_hidden, accepted_tokens, accept_lengths)
        self.heads.after_step(state.heads, accepted_hidden, accepted_tokens, accept_lengths)

    def after_plain_step(self, state: CombinedState, hidden, root) -> None:
        self.ngram.after_plain_step(state.ngram, hidden, root)
        self.heads.after_plain_step(state.heads, hidden, root)

    def observe_tokens(self, state: CombinedState, new_tokens, step_argmax=None) -> None:
        self.ngram.observe_tokens(state.ngram, new_tokens, step_argmax)
        self.heads.observe_tokens(state.heads, new_tokens, step_argmax)

    def skip_step(self, state: CombinedState, root: torch.Tensor, seqlens: torch.Tensor) -> None:
        self.ngram.skip_step(state.ngram, root, seqlens)
        self.heads.skip_step(state.heads, root, seqlens)

    def part_times(self, state: CombinedState) -> list[float]:
        return list(state.part_s)

    def propose(self, state: CombinedState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        t0 = time.perf_counter()
        prop = self._propose(state, root, seqlens, t0)
        state.part_s[0] = time.perf_counter() - t0 - state.part_s[1]  # the n-gram lookup and the merge
        return prop

    def _propose(self, state: CombinedState, root: torch.Tensor, seqlens: torch.Tensor, t0: float) -> Proposal:
        if state.use_heads:
            hp = self.heads.propose(state.heads, root, seqlens)  # tokens [B, Th] on the device
            if not isinstance(hp.tree, Tree):
                raise ValueError("the combined drafter needs a trained drafter with a static tree")
        else:  # the heads held back (adaptive budget): they catch up as on a plain step, and draft the root alone
            self.heads.skip_step(state.heads, root, seqlens)
            hp = Proposal(root[:, None], state.root_only)
        state.part_s[1] = time.perf_counter() - t0  # the heads' drafting (host time; on the CPU the work itself)
        Th, N = hp.tree.num_nodes, state.budget
        B = root.shape[0]
        if state.use_ngram:
            ng_parents, ng_tokens = self.ngram.draft_lists(state.ngram)
        else:
            ng_parents, ng_tokens = [[-1]] * B, [[0]] * B
        C = max(len(p) for p in ng_parents) - 1  # most n-gram nodes (root excluded)
        dev = state.device
        if Th not in state.heads_lists:  # once per tree size and run
            ranks = hp.tree.host_sibling_ranks()
            state.heads_lists[Th] = (hp.tree.host_parents(), torch.tensor(ranks, dtype=torch.long, device=dev))
        heads_parents, heads_ranks = state.heads_lists[Th]
        # for the adaptive budget, a heads node's signal: its head's confidence class where the heads report it
        # (Proposal.signal), else its sibling rank (what the policy takes for a proposal without one)
        heads_signal = hp.signal if hp.signal is not None else heads_ranks.expand(B, Th)
        if C == 0 and N >= Th:  # no n-gram draft anywhere and room for the heads' tree: theirs as it is
            groups = torch.ones(B, Th, dtype=torch.long, device=dev)
            return hp._replace(groups=groups, signal=heads_signal)
        src_lists, par_lists = self._merge(state, heads_parents, ng_parents)
        T = max(len(s) for s in src_lists)
        # padded with zeros (padded nodes copy the root; never accepted) as lists, then one tensor each
        src = torch.tensor([s + [0] * (T - len(s)) for s in src_lists], dtype=torch.long)
        ng = torch.tensor([t[1:] + [0] * (max(C, 1) - len(t) + 1) for t in ng_tokens], dtype=torch.long)
        matched = torch.tensor(state.ngram.matched if state.use_ngram else [0] * B, dtype=torch.long)[:, None]
        ng, src, matched = ng.to(dev, non_blocking=True), src.to(dev, non_blocking=True), matched.to(dev, non_blocking=True)
        # for the adaptive budget: a node's part (1: heads, 0: n-gram) and signal (a heads node's, above; an n-gram
        # node's match length)
        groups = (src < Th).long()
        signal = torch.where(src < Th, heads_signal.gather(1, src.clamp(max=Th - 1)), matched)
        tokens = torch.cat([hp.tokens, ng], 1).gather(1, src)
        tree = TreeBatch.from_parent_lists(par_lists)  # built on the CPU: no device read-back
        draft_probs = None
        if hp.draft_probs is not None:  # sampled heads: their rows, and an n-gram node's one-hot (deterministic) row
            q = torch.cat([hp.draft_probs, F.one_hot(ng, hp.draft_probs.shape[-1]).to(hp.draft_probs.dtype)], 1)
            draft_probs = q[torch.arange(B, device=dev)[:, None], src]  # [B, T, V]
        return Proposal(tokens, tree if dev.type == "cpu" else tree.to(dev), draft_probs=draft_probs, groups=groups,
                        signal=signal)

    def _merge(self, state: CombinedState, heads_parents: list[int], ng_parents: list[list[int]]):
        """Per sequence, which nodes the step keeps (node sources in cat([heads tokens [Th], n-gram tokens
        without their root])) and their parents, the stronger draft first, at most state.budget nodes."""
        Th, N = len(heads_parents), state.budget
        src_lists, par_lists = [], []
        for b, pn in enumerate(ng_parents):
            c = len(pn) - 1
            if state.use_ngram and state.ngram.matched[b] >= self.strong_match:  # a long match: the n-gram draft first
                kn = min(c, N - 1)
                kh = min(Th - 1, N - 1 - kn)
            else:
                kh = min(Th - 1, N - 1)
                kn = min(c, N - 1 - kh)
            src_lists.append(list(range(kh + 1)) + [Th + j - 1 for j in range(1, kn + 1)])
            par_lists.append(heads_parents[: kh + 1] + [0 if pn[j] == 0 else kh + pn[j] for j in range(1, kn + 1)])
        return src_lists, par_lists

    def outline(self, state: CombinedState, batch: int) -> list[tuple[list[int], list[int], list[int]]] | None:
        """The merged tree propose() builds, from the n-gram lookups (kept for propose()) and the heads'
        static tree, before the heads draft: groups 0 n-gram / 1 heads, signal the match length / the heads'
        own outline's (PENDING_SIGNAL where their drafting decides it). None where the heads build their tree
        per step."""
        if state.use_heads:
            ho = self.heads.outline(state.heads, 1)
            if ho is None:
                return None
            heads_parents, _, heads_ranks = ho[0]
        else:
            heads_parents, heads_ranks = [-1], [0]
        ng_parents = self.ngram.draft_lists(state.ngram)[0] if state.use_ngram else [[-1]] * batch
        matched = state.ngram.matched if state.use_ngram else [0] * batch
        Th = len(heads_parents)
        out = []
        for src, par, m in zip(*self._merge(state, heads_parents, ng_parents), matched):
            out.append((par, [1 if j < Th else 0 for j in src], [heads_ranks[j] if j < Th else m for j in src]))
        return out

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """config.json (kind "combined", node_budget, strong_match) + the parts in ngram/ and heads/."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"format": FORMAT, "version": 1, "kind": self.kind, "node_budget": self.node_budget,
               "strong_match": self.strong_match, "parts": ["ngram", "heads"]}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        self.ngram.save(path / "ngram")
        self.heads.save(path / "heads", dtype=dtype)
        save_tables(self, path)

    @classmethod
    def load_saved(cls, path: Path, cfg_dict: dict, model=None, load=None) -> "CombinedDrafter":
        """load: the registry's load_drafter (passed in: this module cannot import the registry, which lists it)."""
        unknown = set(cfg_dict) - {"format", "version", "kind", "node_budget", "strong_match", "parts"}
        if unknown:
            raise ValueError(f"{path / 'config.json'}: unknown combined-drafter fields {sorted(unknown)}")
        return cls(load(path / "ngram"), load(path / "heads", model=model),
                   cfg_dict.get("node_budget"), cfg_dict.get("strong_match", 2))
