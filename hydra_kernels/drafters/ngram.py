"""Prompt-lookup (n-gram) drafting: no weights, no training, any Llama model.

Per sequence, the longest suffix of the text (n tokens, n from max_ngram down to min_ngram) is looked
up among its earlier occurrences in the prompt and the text generated so far; the tokens that followed
the most recent occurrences are the draft: one chain (num_branches=1) or several distinct
continuations merged into a per-sequence tree (a trie: shared prefixes are one node). A continuation that
reaches the text's end goes on copying its own tokens (`continuation`): a loop drafts num_tokens tokens. Verification is
the base model's, so greedy output is exactly plain greedy decoding's.

The lookup searches the text's bytes (4 per token, appended as the text grows, never rebuilt) backwards
from its end for each suffix size tried, in C (NgramIndex): a step costs O(new tokens) to append and a few
byte searches. The family is host-side by nature (a search over token ids): it reads the host copy of
the text the loop already makes once per step (Drafter.observe_tokens) and sends the step's draft to the
device in one copy.
"""
from __future__ import annotations

import json
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..tree import Tree, TreeBatch, chain
from .checkpoint import FORMAT
from ..budget import save_tables
from .protocol import Drafter, Proposal

_WORD = next(t for t in "IL" if array(t).itemsize == 4)  # an unsigned 4-byte array code: NgramIndex's words
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
    """One sequence's text, with its tokens also as 4-byte words (native order) (`words`) so a lookup is a
    byte search in C (bytearray.rfind, CPython's fastsearch) instead of a Python n-gram dict kept per token:
    appending a step's tokens is O(new tokens) bytes, and a lookup scans the text backwards from its end,
    O(text) in C: EPYC VM, 2026-11-28, an append and a lookup ~5 us a sequence at 300 tokens, ~12 at 2k, ~37
    at 8k, where the dict cost ~2.2 us of Python per appended token, the prompt's included (~4.4 ms a
    2k-token prompt, ~70 ms at batch 16), paid even on steps that never look up (the adaptive budget's).
    A byte match that does not start on a word boundary straddles two tokens and is skipped."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.text: list[int] = []
        self.words = bytearray()

    def extend(self, tokens: list[int]) -> None:
        self.text.extend(tokens)
        self.words += array(_WORD, tokens).tobytes()  # token ids are in [0, 2^32): a vocabulary index

    def occurrences(self, n: int, limit: int):
        """End positions (index just past it) of the earlier occurrences of the text's last n tokens, most
        recent first, at most `limit` of them (the suffix itself, ending at the text's end, excluded)."""
        words, L = self.words, len(self.text)
        sub = bytes(words[(L - n) * 4:])
        end = (L - 1) * 4  # an earlier occurrence ends at token L - 1 at the latest
        while limit > 0:
            s = words.rfind(sub, 0, end)
            if s < 0:
                return
            if s % 4:  # not on a token boundary: the next candidate starts at least one byte lower
                end = s + len(sub) - 1
                continue
            yield s // 4 + n
            limit -= 1
            end = s + len(sub) - 4  # the next occurrence ends one token earlier at the latest (overlaps count)

    def lookup(self, num_tokens: int, num_branches: int) -> tuple[int, list[list[int]]]:
        """(n of the longest suffix with an earlier occurrence, 0 if none; up to num_branches distinct
        continuations of num_tokens tokens (`continuation`), from the most recent occurrences first, among
        the _MAX_SCAN most recent)."""
        text, L = self.text, len(self.text)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            found: list[list[int]] = []
            seen: set[tuple[int, ...]] = set()
            for e in self.occurrences(n, _MAX_SCAN):
                c = tuple(continuation(text, e, num_tokens))
                if c not in seen:
                    seen.add(c)
                    found.append(list(c))
                    if len(found) == num_branches:
                        break
            if found:
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
        self.drafted = (None, None)  # (key, draft_lists): this step's lookups, kept by outline() for propose()


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

    def after_plain_step(self, state: NgramState, hidden, root) -> None:
        pass

    def observe_tokens(self, state: NgramState, new_tokens: list[list[int]], step_argmax=None) -> None:
        for b, toks in enumerate(new_tokens):
            if toks:
                state.indexes[b].extend(toks)
            elif state.indexes[b].text:  # an active sequence always gains its next root
                state.finished[b] = True

    def draft_lists(self, state: NgramState) -> tuple[list[list[int]], list[list[int]]]:
        """Per sequence, the (parents, tokens) of this step's trie (node 0 = the root); sets state.matched.
        Looked up once per step (outline() and propose() share it)."""
        # the texts' lengths, which sequences finished and the draft length decide the lookups
        key = (state.num_tokens, tuple(len(i.text) for i in state.indexes), tuple(state.finished))
        if state.drafted[0] == key:
            return state.drafted[1]
        c = self.config
        parent_lists, token_lists = [], []
        for b, idx in enumerate(state.indexes):
            n, conts = (0, []) if state.finished[b] else idx.lookup(state.num_tokens, c.num_branches)
            state.matched[b] = n
            p, t = trie(idx.text[-1], conts)
            parent_lists.append(p)
            token_lists.append(t)
        state.drafted = (key, (parent_lists, token_lists))
        return parent_lists, token_lists

    def outline(self, state: NgramState, batch: int) -> list[tuple[list[int], list[int], list[int]]]:
        """Each sequence's trie (its match length the signal of every node): the lookups, kept for propose()."""
        parent_lists, _ = self.draft_lists(state)
        return [(p, [0] * len(p), [m] * len(p)) for p, m in zip(parent_lists, state.matched)]

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
