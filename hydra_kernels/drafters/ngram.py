"""Prompt-lookup (n-gram) drafting: no weights, no training, any Llama model.

Per sequence, the longest suffix of the text (n tokens, n from max_ngram down to min_ngram) is looked
up among its earlier occurrences in the prompt and the text generated so far; the tokens that followed
the most recent occurrences are the draft: one chain (num_branches=1) or several distinct
continuations merged into a per-sequence tree (a trie: shared prefixes are one node). A continuation that
reaches the text's end goes on copying its own tokens (`continuation`): a loop drafts num_tokens tokens. Verification is
the base model's, so greedy output is exactly plain greedy decoding's.

The lookup goes through an index kept as the text grows (n-gram -> end positions of its occurrences),
updated with the tokens each step adds, never rebuilt: a step costs O(new tokens * n-gram sizes) dict
inserts plus one lookup per size tried. The family is host-side by nature (a dict over token ids): it
reads the host copy of the text the loop already makes once per step (Drafter.observe_tokens) and
sends the step's draft to the device in one copy.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..tree import Tree, TreeBatch, chain
from .checkpoint import FORMAT
from ..budget import save_tables
from .protocol import Drafter, Proposal

# earlier occurrences examined per lookup when looking for distinct continuations (most recent first)
_MAX_SCAN = 64


@dataclass
class NgramConfig:
    max_ngram: int = 4  # longest suffix tried first
    min_ngram: int = 1  # shortest suffix still used
    num_tokens: int = 10  # draft tokens per continuation (transformers' prompt_lookup_num_tokens)
    num_branches: int = 1  # distinct continuations per step (1: a chain)

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram", "num_tokens", "num_branches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    def to_dict(self) -> dict:
        return asdict(self)


class NgramIndex:
    """One sequence's text and, for every n in [min_n, max_n], n-gram (a tuple) -> the end positions
    (index just past the n-gram) of its occurrences, in text order."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.text: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        text, ends = self.text, self.ends
        for t in tokens:
            text.append(t)
            L = len(text)
            for n in range(self.min_n, min(self.max_n, L) + 1):
                ends.setdefault(tuple(text[L - n:]), []).append(L)

    def lookup(self, num_tokens: int, num_branches: int) -> tuple[int, list[list[int]]]:
        """(n of the longest suffix with an earlier occurrence, 0 if none; up to num_branches distinct
        continuations of num_tokens tokens (`continuation`), from the most recent occurrences first)."""
        text, L = self.text, len(self.text)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            ends = self.ends.get(tuple(text[L - n:]))
            if not ends or len(ends) < 2:  # the suffix itself is always its last occurrence
                continue
            found: list[list[int]] = []
            seen: set[tuple[int, ...]] = set()
            for e in reversed(ends[-_MAX_SCAN - 1:-1]):
                c = tuple(continuation(text, e, num_tokens))
                if c not in seen:
                    seen.add(c)
                    found.append(list(c))
                    if len(found) == num_branches:
                        break
            return n, found
        return 0, []


def continuation(text: list[int], e: int, k: int) -> list[int]:
    """The k tokens that followed the occurrence ending at e (< len(text)), the copy running on past the
    text's end into its own tokens (LZ77's overlapping copy): text' = text + draft and draft[m] =
    text'[e + m]; where e + m >= L that is draft[e + m - L], already copied since e < L. So a loop of
    period p (the suffix's most recent occurrence ends p tokens back) drafts k tokens of the loop, where
    text[e:e + k] alone would stop after p."""
    out = text[e:e + k]
    L = len(text)
    while len(out) < k:
        out.append(out[e + len(out) - L])
    return out


def trie(root: int, continuations: list[list[int]]) -> tuple[list[int], list[int]]:
    """root + continuations -> (parents, tokens) of their prefix tree: node 0 the root, every node after
    its parent, shared prefixes one node; nodes of earlier continuations come first."""
    parents, tokens = [-1], [root]
    child: dict[tuple[int, int], int] = {}
    for c in continuations:
        node = 0
        for t in c:
            nxt = child.get((node, t))
            if nxt is None:
                nxt = child[(node, t)] = len(tokens)
                parents.append(node)
                tokens.append(t)
            node = nxt
    return parents, tokens


class NgramState:
    def __init__(self, cfg: NgramConfig, batch_size: int, device):
        self.indexes = [NgramIndex(cfg.min_ngram, cfg.max_ngram) for _ in range(batch_size)]
        self.finished = [False] * batch_size
        self.matched = [0] * batch_size  # n of this step's match per sequence (0: none); CombinedDrafter reads it
        self.num_tokens = cfg.num_tokens  # draft tokens per continuation now (set_budget lowers it)
        self.device = device
        self.chains: dict[int, Tree] = {}  # k -> chain(k) on the device: every sequence drafts k tokens in a line


class NgramDrafter(Drafter):
    """Prompt lookup: hk.new_drafter(model, kind="ngram", max_ngram=4, min_ngram=1, num_tokens=10,
    num_branches=1). Works for any model (no weights)."""

    kinds = ("ngram",)
    config_class = NgramConfig

    def __init__(self, cfg: NgramConfig):
        super().__init__()
        self.config = cfg

    @property
    def kind(self) -> str:
        return "ngram"

    @classmethod
    def new(cls, model, kind: str = "ngram", **options) -> "NgramDrafter":
        return cls(NgramConfig(**options))

    def check_model(self, model) -> None:
        pass  # the draft is the model's own text: any vocabulary, any width

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """The bound on every proposal: num_branches chains of num_tokens under the root."""
        if tree is not None:
            raise ValueError("the ngram drafter builds its own tree every step; pass tree=None and size it with "
                             "num_tokens / num_branches")
        c = self.config
        return Tree([[r] + [0] * (d - 1) for r in range(c.num_branches) for d in range(1, c.num_tokens + 1)])

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> NgramState:
        return NgramState(self.config, batch_size, model.device)

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        """A plain step, then the bounds of continuations of k tokens (num_branches * k + 1 nodes) for
        k = 1, 2, 4, ... and num_tokens: the same lookup, its continuations cut to k tokens."""
        c = self.config
        ks = sorted({min(2**i, c.num_tokens) for i in range(c.num_tokens.bit_length() + 1)})
        return (1, *(c.num_branches * k + 1 for k in ks))

    def set_budget(self, state: NgramState, nodes: int) -> None:
        """Continuations of the most tokens whose trie fits `nodes` (num_branches * k + 1 <= nodes)."""
        c = self.config
        state.num_tokens = max(1, min(c.num_tokens, (nodes - 1) // c.num_branches))

    def after_prefill(self, state: NgramState, hidden, lengths) -> None:
        pass  # the text comes through observe_tokens

    def after_step(self, state: NgramState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        pass

    def observe_tokens(self, state: NgramState, new_tokens: list[list[int]], step_argmax=None) -> None:
        for b, toks in enumerate(new_tokens):
            if toks:
                state.indexes[b].extend(toks)
            elif state.indexes[b].text:  # an active sequence always gains its next root
                state.finished[b] = True

    def draft_lists(self, state: NgramState) -> tuple[list[list[int]], list[list[int]]]:
        """Per sequence, the (parents, tokens) of this step's trie (node 0 = the root); sets state.matched."""
        c = self.config
        parent_lists, token_lists = [], []
        for b, idx in enumerate(state.indexes):
            n, conts = (0, []) if state.finished[b] else idx.lookup(state.num_tokens, c.num_branches)
            state.matched[b] = n
            p, t = trie(idx.text[-1], conts)
            parent_lists.append(p)
            token_lists.append(t)
        return parent_lists, token_lists

    def propose(self, state: NgramState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        parent_lists, token_lists = self.draft_lists(state)
        T = max(len(p) for p in parent_lists)
        tokens = torch.zeros(len(token_lists), T, dtype=torch.long)  # padded nodes: token 0, never accepted
        for b, t in enumerate(token_lists):
            tokens[b, : len(t)] = torch.tensor(t)
        # the adaptive budget's confidence class of a node: its sequence's match length (a longer suffix
        # found earlier in the text predicts the continuation better)
        signal = torch.tensor(state.matched, dtype=torch.long)[:, None].expand(len(token_lists), T)
        signal = signal.to(state.device, non_blocking=True)
        if all(p == list(range(-1, T - 1)) for p in parent_lists):  # one chain length for all (T = 1: no match)
            if T - 1 not in state.chains:
                state.chains[T - 1] = chain(T - 1).to(state.device)
            return Proposal(tokens.to(state.device, non_blocking=True), state.chains[T - 1], signal=signal)
        tree = TreeBatch.from_parent_lists(parent_lists)  # built on the CPU: no device read-back
        if state.device.type != "cpu":
            tree = tree.to(state.device)
        return Proposal(tokens.to(state.device, non_blocking=True), tree, signal=signal)

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """config.json only (no weights): {"format": "hydra_kernels.drafter", "kind": "ngram", ...settings}."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"format": FORMAT, "version": 1, "kind": self.kind, **self.config.to_dict()}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_tables(self, path)

    @classmethod
    def load_saved(cls, path: Path, cfg_dict: dict, model=None, load=None) -> "NgramDrafter":
        fields = {k: v for k, v in cfg_dict.items() if k not in ("format", "version", "kind")}
        return cls(NgramConfig(**fields))
