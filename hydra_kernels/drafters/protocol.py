"""The Drafter protocol: what the decoding loop (speculative.py) knows of any drafting method.

A family (Medusa, Hydra, EAGLE, n-gram, ...) is one module under drafters/ with a class that
implements these methods, plus its registry entry (drafters/registry.py). load_drafter(model=...) calls
drafter.prepare(model, backends) once (caches every run reads); the loop calls, per run:

    tree  = drafter.resolve_tree(tree_arg, device_type)     # before any work: validated, bounds the KV rows
    state = drafter.start(model, B, max_seq_len, tree, backends)
    drafter.use_generator(state, generator)       # the run's torch.Generator (None at temperature 0)
    drafter.after_prefill(state, hidden [B, L, H], lengths [B])          # or [B, L, n*H]: see feature_layers
    loop:  drafter.set_budget(state, n)                 # only when the step's node budget changes (budget.py)
           drafter.set_parts(state, flags)             # adaptive budget (adaptive.py): which parts draft
           drafter.size_part(state, part, nodes)       # adaptive budget: at most that many nodes of a part
           p = drafter.propose(state, root [B], seqlens [B])           # Proposal: tokens [B, T] + their tree
             or drafter.skip_step(state, root, seqlens)   # budget 1: a plain step (the root alone, no draft)
           ... verify (p.tree), commit ...
           drafter.after_step(state, accepted_hidden [B, K+1, H], accepted_tokens [B, K+1], accept_lengths [B])
           drafter.observe_tokens(state, new_tokens, step_argmax)   # host copies (no-op by default)

Everything stays on the device: no method may read a device tensor on the host inside a step (the
base model's forward of the step is the only thing the host waits for).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ..tree import Tree, TreeBatch


class Proposal(NamedTuple):
    """One step's draft. tokens int64 [B, T], node 0 = the root (the token the base model already
    chose); tree: a static Tree shared by the batch or a TreeBatch (a tree per sequence, padded to
    T); positions int64 [B, T] = seqlens[b] + depth, when the drafter built them on the device (else
    the model derives them from the tree's depths).

    draft_probs fp32 [B, T, V] or None: for sampled drafts, row j is the distribution node j's token
    was drawn from (children drawn i.i.d. from their parent's draft distribution share one row; a
    deterministic child among them is its token's one-hot row; the root's and padded nodes' rows are
    ignored). Rejection acceptance then accepts with min(1, p/q) (ops.rejection_verify), which accepts
    more than the deterministic rule when q is close to p; None: deterministic drafts. Greedy
    acceptance is exact for any draft and typical acceptance judges p alone: both ignore it.

    For the adaptive budget (hydra_kernels/adaptive.py), which learns each node's acceptance during the
    run: groups int64 [B, T] or None, the index in Drafter.parts of the part that drafted each node (None:
    part 0); signal int64 [B, T] or None, the drafter's confidence class of each node, a small int in
    [0, 8) (the n-gram match length; a head's guess's probability class, confidence_class; None: the
    node's rank among its siblings). Nodes of one (part, depth, signal) are taken to be accepted alike."""

    tokens: torch.Tensor
    tree: Tree | TreeBatch
    positions: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    signal: torch.Tensor | None = None


# A drafted node's probability under its drafter (a head's softmax of its guess at the node's parent) -> its class
# for the adaptive budget's learning: class c holds p in [EDGES[c - 1], EDGES[c]). The shipped Hydra heads' depth-1
# guesses were accepted 0.06-0.14 of the time below p = 0.3 (38% of the steps) and 0.54-0.71 from p = 0.6 (27%), 0.34
# overall (EPYC VM, 2026-11-29, MT-Bench 20-31, 128 tokens, 737 steps; depth 2 alike): a class tells the policy which
# guesses are worth a row, where the guess's rank (0 for every node of a chain) told it nothing
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)
# an outline node (Drafter.outline) whose class its drafting decides (a head's guess, not drafted yet)
PENDING_SIGNAL = -1


_EDGES: dict = {}  # (device, dtype) -> CONFIDENCE_EDGES as a tensor: made once (on a GPU a host copy is a sync)


def pending_outline(tree: Tree, batch: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Drafter.outline of a one-part static tree whose every class its drafting decides (PENDING_SIGNAL)."""
    parents = tree.host_parents()
    return [(parents, [0] * len(parents), [PENDING_SIGNAL] * len(parents))] * batch


def confidence_class(p: torch.Tensor) -> torch.Tensor:
    """Probabilities [...] -> confidence classes int64 [...] in [0, len(CONFIDENCE_EDGES)] (see CONFIDENCE_EDGES)."""
    key = (p.device, p.dtype)
    if key not in _EDGES:
        _EDGES[key] = torch.tensor(CONFIDENCE_EDGES, dtype=p.dtype, device=p.device)
    return torch.bucketize(p.contiguous(), _EDGES[key], right=True)


class Drafter(nn.Module):
    """Base class of every drafting family. Subclasses set `kinds` (the registry names they serve)
    and implement the methods below; `kind` names this instance's family."""

    kinds: tuple[str, ...] = ()
    # None: after_prefill / after_step get the base model's final-normed hidden states. A tuple of layer
    # indices (EAGLE-3): they get instead the residual streams entering those layers of the base model,
    # concatenated along the last dimension ([..., len(feature_layers) * H]; Llama's `capture`).
    feature_layers: tuple[int, ...] | None = None
    # the parts the adaptive budget switches on and off per step (set_parts) and keys its learning by
    parts: tuple[str, ...] = ("draft",)
    # may a step verify only some of a proposal's nodes (a valid subtree)? False where nodes have fixed roles
    # (lookahead's window rows): the adaptive budget then verifies a proposal whole or drafts nothing
    prunable_proposals: bool = True

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def check_model(self, model) -> None:
        """A clear ValueError, before any work, when this drafter cannot serve `model`."""
        raise NotImplementedError

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """The run's tree from generate()'s `tree` argument (None: the drafter's choice for this device
        class). Validated here, before any work. For a drafter that proposes its own tree each step, the
        returned tree bounds every proposal (at most its node count and depth)."""
        raise NotImplementedError

    def prepare(self, model, backends) -> None:
        """Build the caches every run on `model` with `backends` (a BackendPlan) reads and keeps across runs (the
        base head's rows a draft ranks with, packed), changing nothing any method computes. load_drafter(model=...)
        calls it with the model's default plan, so a process's first drafted step does not pay it (EPYC VM,
        2026-11-29: ~30 ms for the shipped heads, ~9% of a 64-token answer at batch 1, landing in whichever run
        drafted first); start() calls it too (a no-op once built). Default: nothing to build."""

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> Any:
        """Allocate what the drafter keeps across the run's steps (its KV buffer, n-gram tables, the
        hidden state its next draft starts from); `backends` is the run's BackendPlan."""
        raise NotImplementedError

    def after_prefill(self, state, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """hidden [B, L, H]: the base model's final-normed states of the right-padded prompts (or the
        captured layers' inputs [B, L, n * H] when feature_layers is set); lengths [B]."""
        raise NotImplementedError

    def use_generator(self, state, generator: torch.Generator | None) -> None:
        """The run's torch.Generator (seeded by generate's `seed`; None at temperature 0), given once after
        start(): a drafter that samples its drafts draws from it, so one seed fixes the whole run (the
        draft draws come before the step's acceptance draws). Default: nothing (deterministic drafts)."""

    def propose(self, state, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        """root int64 [B] (the base model's next token, at position seqlens[b]); seqlens int32 [B] the
        base model's committed lengths (read-only) -> this step's draft."""
        raise NotImplementedError

    # ---- the draft budget (hydra_kernels/budget.py decides it per step) -------------------------------
    @property
    def budget_tables(self) -> dict:
        """device class -> BudgetTable searched for this drafter (budget_<device>.json beside its weights)."""
        return self.__dict__.setdefault("_budget_tables", {})

    # the acceptance rates the adaptive budget starts from in a fresh process (hydra_kernels/acceptance_prior.py:
    # acceptance_rates.json beside its weights or tables), or None: adaptive.PRIOR_RATE for every node
    acceptance_prior = None

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        """Node budgets a step of this run's `tree` can be held to, increasing: 1 (a plain step) and the
        full tree at least; a family that can draft a smaller tree (set_budget) lists those sizes too."""
        return (1, tree.num_nodes)

    def set_budget(self, state, nodes: int) -> None:
        """The following proposals draft at most `nodes` nodes (one of budget_levels, > 1; the full
        tree's size restores it). Called only when the budget changes. The default drafts only the full
        tree, the one size > 1 its budget_levels list."""

    def set_parts(self, state, parts: tuple[bool, ...]) -> None:
        """The next propose() drafts with the parts flagged True (one flag per `parts`, at least one True;
        the adaptive budget calls it every step it proposes). A part held back costs no drafting work; its
        state still follows the text (skip_step's catching up where it needs it). Default: one part."""

    def size_part(self, state, part: int, nodes: int | None) -> None:
        """The next propose() drafts at most `nodes` nodes (root included) of part `part` (an index into
        `parts`), where that part's work grows with the nodes it drafts (a head per depth); None: its whole
        draft. The adaptive budget sizes such a part by what it kept lately, so a draft it will cut is not
        drafted. Default: nothing (each part drafts its whole draft)."""

    def static_tree(self, state) -> Tree | None:
        """The Tree the next propose() drafts, where it is fixed before drafting (a static tree at the current
        budget and size_part bound); None (default): the drafter builds its tree per step."""
        return None

    def outline(self, state, batch: int) -> list[tuple[list[int], list[int], list[int]]] | None:
        """The next propose()'s tree known on the host before any drafting work (after set_parts / size_part):
        per sequence (parents, groups, signal), one entry per node, root first (parent -1), as the Proposal
        will carry them (groups: the parts' indices; signal: Proposal.signal, or the sibling rank where the
        proposal has none; PENDING_SIGNAL where drafting decides it, a head's guess). The adaptive budget reads it
        to skip a draft it would cut to nothing before paying for it. Default: from static_tree (one part, sibling ranks), None where there is none. A drafter
        whose outline needs work that propose() also does (the n-gram lookups) keeps it for that call."""
        tree = self.static_tree(state)
        if tree is None:
            return None
        parents = tree.host_parents()
        return [(parents, [0] * len(parents), tree.host_sibling_ranks())] * batch

    def part_times(self, state) -> list[float] | None:
        """Seconds each part spent in the last propose() (a part held back: what it still did, e.g. the heads'
        catching up in skip_step), for the adaptive budget's costs; None (default): it times the whole
        propose() call (catching up included: a conservative price for drafting)."""
        return None

    def skip_step(self, state, root: torch.Tensor, seqlens: torch.Tensor) -> None:
        """This step is a plain step: the base model runs the root alone (no propose() call). A drafter that
        catches up on committed positions inside propose() (EAGLE, Amphista) keeps them for its next draft here
        (drafters/backlog.py: a call of its layers costs about as much for one position as for many); after_step
        and observe_tokens follow as after any step (one accepted token per active sequence)."""

    def after_step(self, state, accepted_hidden: torch.Tensor, accepted_tokens: torch.Tensor,
                   accept_lengths: torch.Tensor) -> None:
        """The step's committed tokens: accepted_hidden [B, K+1, H] (as after_prefill's hidden) and
        accepted_tokens [B, K+1] along the accepted path (root first), valid up to accept_lengths[b] (0 for
        a finished sequence)."""
        raise NotImplementedError

    def after_plain_step(self, state, hidden: torch.Tensor, root: torch.Tensor) -> None:
        """after_step of a greedy plain step in which every sequence is active and the drafter's features are
        the final hidden states: hidden [B, H] the root's row, root [B], one accepted token each. Default: that
        after_step call. A drafter that keeps only the last row (the heads, the MLPSpeculator) or nothing
        overrides it to take `hidden` as it is, and EAGLE and Amphista hold it by reference in their backlog
        (drafters/backlog.py) until a later step runs it: the loop runs this right after the native plain step,
        whose weight stream leaves every cache cold, and there each tensor call costs 10-40 us, not 1-3 (EPYC VM,
        2026-11-29: the views and the ones of the default call took ~0.07 ms of a ~6 ms batch-1 step). So a caller
        must not write `hidden`, or the roots it later passes to skip_step / propose, in place (the native step
        returns fresh tensors each step); skip_step or propose follows before the next step's hooks."""
        self.after_step(state, hidden[:, None], root[:, None], torch.ones_like(root))

    def observe_tokens(self, state, new_tokens: list[list[int]], step_argmax: torch.Tensor | None = None) -> None:
        """Host copies of the text, for host-side drafters (n-gram, lookahead); default: nothing.

        Called after the loop's one host read, so it costs no extra device sync: once after the prefill
        with each prompt plus its first token, then after every step with the tokens the step added to
        each sequence (accepted drafts + the next root; [] for a finished sequence). The calls'
        concatenation is each sequence's text up to and including the root the next propose() gets.
        step_argmax int64 [B, T] (greedy acceptance only, else None): the base model's argmax after every
        node of the step's proposal, on the device (reading it is one more device->host copy)."""

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """Write the drafter in its own format, which hk.load_drafter(path) recognises."""
        raise NotImplementedError
