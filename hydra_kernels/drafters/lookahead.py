"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", 2024): no weights, any Llama model, greedy acceptance.

Every step's one base forward holds two branches beside the root, in a per-sequence mask:
- the lookahead branch, a Jacobi window of N-1 rows x W columns of guesses. Node (k, j) sits at position
  root + 1 + j + k and sees the root, row 0 up to column j, and rows 1..k-1 of its own column: the row-0
  line is one guessed sequence, each column climbs it by one token per row. The base argmax at the
  last row's nodes is the new row; the column j then reads as an N-gram (row 0 .. row N-2, new) whose
  every token was produced after the one before it, and goes into the pool; the oldest row drops.
  Lookahead nodes lie on no leaf path (padded nodes of the step's TreeBatch), so they are never accepted.
- the verification branch: the pool's N-grams that start with the root (up to G, most recent first) as
  a trie under the root, verified like any draft tree.
The base model's argmax at the lookahead nodes reaches the drafter through Drafter.observe_tokens'
step_argmax (greedy acceptance only). The pool and the window live on the host.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..tree import Tree, TreeBatch
from .checkpoint import FORMAT
from .ngram import trie
from ..budget import save_tables
from .protocol import Drafter, Proposal


@dataclass
class LookaheadConfig:
    window: int = 4  # W: columns of the Jacobi window
    ngram: int = 3  # N: n-gram size (N-1 rows of guesses; verified n-grams have N-1 draft tokens)
    guesses: int = 4  # G: pool n-grams verified per step

    def __post_init__(self):
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class LookaheadState:
    def __init__(self, cfg: LookaheadConfig, batch_size: int, device):
        self.rows: list[list[list[int]] | None] = [None] * batch_size  # per sequence: N-1 rows of W tokens
        self.pool: list[dict[int, list[tuple[int, ...]]]] = [{} for _ in range(batch_size)]  # first token -> n-gram tails
        self.last = [0] * batch_size  # the current root per sequence (host)
        self.finished = [False] * batch_size
        self.la_start = 0  # index of the first lookahead node in the last proposal
        self.skipped = False  # the last step was a plain step (skip_step): no lookahead nodes to learn from
        self.guesses = cfg.guesses  # pool n-grams verified per step now (set_budget lowers it)
        self.device = device


class LookaheadDrafter(Drafter):
    """hk.new_drafter(model, kind="lookahead", window=4, ngram=3, guesses=4)."""

    kinds = ("lookahead",)
    config_class = LookaheadConfig
    prunable_proposals = False  # its window rows sit at fixed nodes (observe_tokens reads their argmax there)

    def __init__(self, cfg: LookaheadConfig):
        super().__init__()
        self.config = cfg
        c = cfg
        self._la_rel = torch.tensor([1 + j + k for k in range(c.ngram - 1) for j in range(c.window)])  # positions
        # lookahead block mask [L, L] (row-major over (k, j)) and each node's view of the root
        Wn, R = c.window, c.ngram - 1
        m = torch.zeros(R * Wn, R * Wn, dtype=torch.bool)
        for k in range(R):
            for j in range(Wn):
                i = k * Wn + j
                m[i, :j + 1] = True  # row 0 up to column j
                for k2 in range(1, k + 1):
                    m[i, k2 * Wn + j] = True  # its column in rows 1..k (itself included)
        self._la_mask = m

    @property
    def kind(self) -> str:
        return "lookahead"

    @classmethod
    def new(cls, model, kind: str = "lookahead", **options) -> "LookaheadDrafter":
        return cls(LookaheadConfig(**options))

    def check_model(self, model) -> None:
        pass  # no weights: any vocabulary, any width

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """A bound: G chains of N-1 under the root plus one node per lookahead slot."""
        if tree is not None:
            raise ValueError("the lookahead drafter builds its own tree every step; pass tree=None and size it with "
                             "window / ngram / guesses")
        c = self.config
        chains = [[r] + [0] * (d - 1) for r in range(c.guesses) for d in range(1, c.ngram)]
        return Tree(chains + [[c.guesses + i] for i in range(c.window * (c.ngram - 1))])

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> LookaheadState:
        return LookaheadState(self.config, batch_size, model.device)

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        """A plain step, then the root + the lookahead window (W * (N-1) nodes: the window must advance
        every step it runs) + g verified n-grams of N-1 tokens, for g = 1 .. guesses."""
        c = self.config
        base = 1 + c.window * (c.ngram - 1)
        return (1, *(base + g * (c.ngram - 1) for g in range(1, c.guesses + 1)))

    def set_budget(self, state: LookaheadState, nodes: int) -> None:
        """Verify the most (most recent) pool n-grams whose trie fits `nodes` beside the window."""
        c = self.config
        state.guesses = max(1, min(c.guesses, (nodes - 1 - c.window * (c.ngram - 1)) // (c.ngram - 1)))

    def after_prefill(self, state: LookaheadState, hidden, lengths) -> None:
        pass

    def after_step(self, state: LookaheadState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        pass

    def after_plain_step(self, state: LookaheadState, hidden, root) -> None:
        pass

    def observe_tokens(self, state: LookaheadState, new_tokens: list[list[int]], step_argmax=None) -> None:
        c = self.config
        R, Wn = c.ngram - 1, c.window
        if state.rows[0] is None:  # after the prefill: each prompt + its first token; seed the window from it
            for b, toks in enumerate(new_tokens):
                rng = random.Random(b)
                state.rows[b] = [[rng.choice(toks) for _ in range(Wn)] for _ in range(R)]
                state.last[b] = toks[-1]
            return
        if state.skipped:  # a plain step ran no lookahead branch: only the root moves, the window waits
            state.skipped = False
            for b, toks in enumerate(new_tokens):
                state.finished[b] = state.finished[b] or not toks
                if toks:
                    state.last[b] = toks[-1]
            return
        if step_argmax is None:
            raise ValueError("lookahead decoding needs greedy acceptance (the base argmax at its lookahead nodes)")
        new_rows = step_argmax[:, state.la_start + (R - 1) * Wn: state.la_start + R * Wn].tolist()  # [B, W]
        for b, toks in enumerate(new_tokens):
            if not toks:
                state.finished[b] = True
                continue
            rows, pool = state.rows[b], state.pool[b]
            for j in range(Wn):  # column j as an N-gram: rows 0..N-2, then the new token
                gram = tuple(rows[k][j] for k in range(R)) + (new_rows[b][j],)
                tails = pool.setdefault(gram[0], [])
                if gram[1:] in tails:
                    tails.remove(gram[1:])
                tails.append(gram[1:])  # most recent last
                del tails[: -c.guesses]
            state.rows[b] = rows[1:] + [new_rows[b]]
            state.last[b] = toks[-1]

    def skip_step(self, state: LookaheadState, root: torch.Tensor, seqlens: torch.Tensor) -> None:
        state.skipped = True

    def propose(self, state: LookaheadState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        c = self.config
        B = len(state.last)
        parent_lists, token_lists = [], []
        for b in range(B):
            tails = [] if state.finished[b] else state.pool[b].get(state.last[b], [])[-state.guesses:]
            p, t = trie(state.last[b], [list(x) for x in reversed(tails)])
            parent_lists.append(p)
            token_lists.append(t)
        V = max(len(p) for p in parent_lists)  # root + the largest verification trie
        nL = c.window * (c.ngram - 1)
        T = V + nL
        parents = torch.full((B, T), -1, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        tokens = torch.zeros(B, T, dtype=torch.long)
        rel = torch.zeros(B, T, dtype=torch.long)  # position - seqlens
        for b in range(B):
            p, t = parent_lists[b], token_lists[b]
            parents[b, : len(p)] = torch.tensor(p)
            valid[b, : len(p)] = True
            tokens[b, : len(t)] = torch.tensor(t)
            tokens[b, V:] = torch.tensor([x for row in state.rows[b] for x in row])
        tree = TreeBatch(parents, valid)  # the verification branch; lookahead nodes are padding
        rel[:, :V] = tree.depths[:, :V]
        rel[:, V:] = self._la_rel
        tree.mask[:, V:, V:] = self._la_mask
        tree.mask[:, V:, 0] = True  # every lookahead node sees the root
        state.la_start = V
        dev = state.device
        if dev.type != "cpu":
            tree = tree.to(dev)
        positions = seqlens.long()[:, None] + rel.to(dev, non_blocking=True)
        return Proposal(tokens.to(dev, non_blocking=True), tree, positions)

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """config.json only (no weights): {"format": "hydra_kernels.drafter", "kind": "lookahead", ...}."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"format": FORMAT, "version": 1, "kind": self.kind, **self.config.to_dict()}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_tables(self, path)

    @classmethod
    def load_saved(cls, path: Path, cfg_dict: dict, model=None, load=None) -> "LookaheadDrafter":
        fields = {k: v for k, v in cfg_dict.items() if k not in ("format", "version", "kind")}
        return cls(LookaheadConfig(**fields))
