"""The draft budget of each speculative step: how many tree nodes the drafter may propose, chosen from the
live batch size and context, down to 1 node (a plain step: the root alone, no draft).

Why: a verify step over T nodes costs about one plain step only while the base model's weight reads
dominate; with a batch (T * B rows) or a long context (K/V read per node) it costs more, and a tree that
pays at batch 1 loses at batch 8 (measured with the shipped Hydra heads: 0.66x plain decoding at batch 8).
The Hydra paper searches a tree per batch size; IBM's MLPSpeculator picks its candidates per batch size
and turns speculation off above a threshold. Here a BudgetTable, searched per device class for one
drafter and its tree (hydra_kernels/training/budget_search.py, `python python/search_budget.py`) and
saved with the drafter as budget_<device>.json, maps (batch, context) -> node budget. This module is the
one place that decides a step's budget (`StepBudget`); generate(budget=...) lets a user pin it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_PREFIX = "budget_"


def tree_key(tree) -> str:
    """What identifies the tree a table was searched for: its choices, or a dynamic tree's settings."""
    dyn = getattr(tree, "dynamic", None)
    if dyn is not None:
        return json.dumps({"dynamic": asdict(dyn)}, sort_keys=True)
    return json.dumps([list(c) for c in tree.choices])


def _nearest(values: list[int], x: int) -> int:
    """Index of the bucket nearest to x on a log scale; ties go to the larger bucket (the costlier
    regime: the smaller budget, the safe side)."""
    lx = math.log(max(x, 1))
    return min(range(len(values)), key=lambda i: (abs(math.log(values[i]) - lx), -values[i]))


@dataclass
class BudgetTable:
    """nodes[i][j]: the node budget at batch_sizes[i] and contexts[j] (1 = a plain step), for the tree
    `tree` (tree_key) with `full` nodes. A live (batch, context) takes its nearest bucket on a log scale.
    `measured` keeps the search's figures (tokens/s per budget) for the record."""

    device: str
    tree: str
    full: int
    batch_sizes: list[int]
    contexts: list[int]
    nodes: list[list[int]]
    measured: dict | None = None

    def __post_init__(self):
        for name in ("batch_sizes", "contexts"):
            v = getattr(self, name)
            if not v or any(not isinstance(x, int) or x < 1 for x in v) or sorted(v) != list(v):
                raise ValueError(f"budget table {name} must be increasing positive ints, got {v!r}")
        if len(self.nodes) != len(self.batch_sizes) or any(len(r) != len(self.contexts) for r in self.nodes):
            raise ValueError(f"budget table nodes must be [{len(self.batch_sizes)}][{len(self.contexts)}] "
                             f"(batch sizes x contexts), got {self.nodes!r}")
        if any(not isinstance(n, int) or not 1 <= n <= self.full for r in self.nodes for n in r):
            raise ValueError(f"budget table node counts must be ints in [1, {self.full}], got {self.nodes!r}")

    def nodes_for(self, batch: int, context: int) -> int:
        return self.nodes[_nearest(self.batch_sizes, batch)][_nearest(self.contexts, context)]

    def save(self, directory) -> Path:
        path = Path(directory) / f"{FILE_PREFIX}{self.device}.json"
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path) -> "BudgetTable":
        try:
            d = json.loads(Path(path).read_text())
            return cls(**d)
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError; missing/unknown fields: TypeError
            raise ValueError(f"{path} is not a budget table ({e}); delete it or search it again "
                             "(python python/search_budget.py)") from e


def load_tables(directory) -> dict[str, BudgetTable]:
    """device class -> BudgetTable for every budget_<device>.json in a drafter's directory."""
    return {f.stem[len(FILE_PREFIX):]: BudgetTable.load(f) for f in sorted(Path(directory).glob(FILE_PREFIX + "*.json"))}


def save_tables(drafter, directory) -> None:
    """The measured files that travel with a drafter: its budget tables and its acceptance prior (acceptance_prior.py,
    where the adaptive budget starts)."""
    for table in drafter.budget_tables.values():
        table.save(directory)
    if drafter.acceptance_prior is not None:
        drafter.acceptance_prior.save(directory)


class StepBudget:
    """A run's budget rule: `nodes(batch, context)` before each step. Made once per generate call by
    `choose`: a pinned node count, the drafter's table for this device and tree, or the full tree."""

    def __init__(self, full: int, pinned: int | None = None, table: BudgetTable | None = None, adaptive: bool = False):
        self.full, self.pinned, self.table, self.adaptive = full, pinned, table, adaptive

    def policy(self, drafter, batch: int, cap: int, model, device):
        """The run's adaptive policy (hydra_kernels/adaptive.py; at most `cap` nodes a step) when this budget
        is adaptive, else None."""
        if not self.adaptive:
            return None
        from .adaptive import AdaptiveBudget  # here, not at the top: adaptive imports the drafters, which import us
        from .attention_share import kv_per_weight_byte

        return AdaptiveBudget(drafter, batch, cap, model, device, kv_per_weight=kv_per_weight_byte(model))

    def nodes(self, batch: int, context: int) -> int:
        if self.pinned is not None:
            return self.pinned
        if self.table is not None:
            return min(self.table.nodes_for(batch, context), self.full)
        return self.full

    def plain_throughout(self, batch: int, first_context: int, last_context: int) -> bool:
        """Is every step of a run plain (1 node), for `batch` sequences whose context grows from
        first_context to at most last_context? Then generate() runs plain decoding itself (no drafter
        state, no prefill features kept, the plain loop's per-step work), so where the table says
        nothing pays the run is plain decoding, not speculative decoding with plain steps."""
        if self.pinned is not None:
            return self.pinned <= 1
        if self.adaptive:  # decided step by step
            return False
        if self.table is None:
            return self.full <= 1
        t = self.table
        row = t.nodes[_nearest(t.batch_sizes, batch)]
        # the nearest bucket moves monotonically with the context: the run meets buckets lo..hi
        lo, hi = _nearest(t.contexts, first_context), _nearest(t.contexts, last_context)
        return all(n <= 1 for n in row[lo:hi + 1])

    def __repr__(self) -> str:
        how = f"pinned {self.pinned}" if self.pinned is not None else \
            ("adaptive" if self.adaptive else "table" if self.table else "full")
        return f"StepBudget({how}, full={self.full})"


def choose(budget, drafter, tree, tree_arg, device_type: str, greedy: bool = True) -> StepBudget:
    """generate()'s `budget` argument -> the run's StepBudget, checked before any work.

    "adaptive": each step's draft sized by its expected tokens per second (hydra_kernels/adaptive.py),
    at most the drafter's largest budget level. "auto": the drafter's searched table for this device class and
    tree; an error when there is none. An int n: n nodes every step (1: plain steps; must be one of
    drafter.budget_levels(tree)). None: `default_is_adaptive` says where it is "adaptive"; elsewhere the table when
    the run uses the tree it was searched for, else the full tree every step (a pinned tree pins its size)."""
    full = tree.num_nodes
    table = drafter.budget_tables.get(device_type)
    if table is not None and table.tree != tree_key(tree):
        table = None  # searched for another tree: its figures say nothing about this one
    if budget is None:
        if tree_arg is None and default_is_adaptive(table, device_type, greedy):
            return StepBudget(full, adaptive=True)
        return StepBudget(full, table=table if tree_arg is None else None)
    if isinstance(budget, str):
        if budget == "adaptive":
            return StepBudget(full, adaptive=True)
        if budget != "auto":
            raise ValueError(f"budget must be None, 'adaptive', 'auto' or a node count, got {budget!r}")
        if table is None:
            raise ValueError(f"budget='auto' needs a budget table searched for this drafter and tree on {device_type!r} "
                             f"(budget_{device_type}.json; python python/search_budget.py); have: "
                             f"{sorted(drafter.budget_tables) or 'none'}")
        return StepBudget(full, table=table)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be None, 'adaptive', 'auto' or an int node count, got {budget!r}")
    levels = drafter.budget_levels(tree)
    if budget not in levels:
        raise ValueError(f"budget={budget}: this drafter and tree can run steps of {list(levels)} nodes "
                         "(1 = a plain step)")
    return StepBudget(full, pinned=budget)


def default_is_adaptive(table: BudgetTable | None, device_type: str, greedy: bool) -> bool:
    """Does budget=None run the adaptive budget? Where the table would be the default (a table searched for this
    drafter, tree and device class: every shipped kind on the CPU), on the CPU, under greedy acceptance. Why each:
    - the table: the adaptive budget replaces it as the choice. Where it is known, a (batch, context) table is
      blind to whether this step's draft is likely accepted: it runs plain steps at short contexts (nothing pays on
      average) where the adaptive budget drafts when the text copies or an answer runs long. A drafter without one
      (made or trained by the user, never searched) keeps the tree it was given, every step, as before;
    - the CPU: on CUDA the default replays steps from CUDA graphs (the decode runner), which cannot report the
      accepted node ids the adaptive budget learns from, and its small host reads would be syncs there;
    - greedy: the output is plain greedy decoding's whatever the budget does. A sampled run under the adaptive
      budget is exact in law, but the measured times steer which draws a step consumes, so a seed would no longer
      give the same tokens on every run: the table keeps seeds reproducible (budget="adaptive" opts in).
    budget="auto" keeps the table. Measured: benchmarks/results/README.md, the adaptive budget (issue 45)."""
    return table is not None and device_type == "cpu" and greedy


def whole_tree_budget(drafter, tree, device_type: str) -> int | None:
    """generate()'s budget that runs the drafter's whole tree every step, its budget table off: what a
    tokens/step figure of the drafter itself (not of the batch-size policy) must be measured with. None
    where a tree is passed (a pinned tree already runs whole). A drafter held to fewer nodes than its bound
    (the combined drafter's node_budget) runs its largest budget level."""
    if tree is not None:
        return None
    return max(drafter.budget_levels(drafter.resolve_tree(None, device_type)))
