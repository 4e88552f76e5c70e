"""Search a drafter's budget table (hydra_kernels/budget.py) on this device: the node budget of each step
for each (batch size, context) bucket, down to 1 (a plain step) where speculation does not pay.

tokens/s of a budget n at batch B and context C is predicted as B * a(n) / s(B, C, n):
- a(n): tokens per step with n nodes, measured by real greedy decoding of held-out prompts at that budget
  (one batched run per budget; acceptance does not depend on the batch size).
- s(B, C, n): seconds per step, measured by the real decoding loop (speculative.py, the drafter's real
  propose / skip_step, verify, commit; an n-gram part made to draft every step, timed_as_costliest) from a
  synthetic state: a KV buffer whose first C rows count as the
  committed context (their values do not change the time) and random hidden states, so no C-token
  prefill is paid per point (16 x 8k tokens would take minutes on a CPU). Per-step time = the difference
  of two runs of different lengths / their difference in steps, which drops one-off work (a drafter's
  first pass over the prompt).
- plain decoding: the plain loop (generate's), timed the same way.
A bucket keeps the fastest budget when its prediction beats plain decoding by `margin`, else 1: the worst
case is then plain decoding (a greedy plain step inside a speculative run costs what a plain step costs).
The default margin (MARGIN, 15%) covers how far the prediction ran from real decoding on the EPYC VM
(2026-11-24): synthetic step times ~5% below real ones (batch 4, 2 nodes: 17.0 vs 18.0 ms), held-out
acceptance up to ~5% above MT-Bench's (1.52 vs 1.45 tokens/step, 3 nodes); at 3% the table kept 2-node
trees at batch 8, context 2048 and batch 2 / 4, context 8000, which decoded at 0.82x / 0.95x / 0.94x plain;
at 8% it kept them at batch 2, context 8000 (predicted 1.108x; decoded at 1.00x, 0.83x and 0.93x plain in
three runs of benchmarks/bench_scaling.py) and batch 4, context 128 (predicted 1.084x; decoded at 1.06x
and 0.97x). The smallest prediction that decoded above plain in every run was 1.18x. Then no bucket drafts more nodes than the bucket of the next smaller
batch at its context: the extra rows of a tree cost relatively more as the batch grows, so a larger budget
there is timing noise (two searches on the same machine differed by up to 10% at some points).
"""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..budget import BudgetTable, StepBudget, tree_key
from ..drafters.combined import CombinedDrafter
from ..drafters.ngram import NgramDrafter, trie
from ..emit import Emitter

BATCH_SIZES = (1, 2, 4, 8, 16)
CONTEXTS = (128, 2048, 8000)
MARGIN = 1.15  # a budget > 1 must be predicted this much faster than plain decoding (module docstring)


def candidate_budgets(levels: tuple[int, ...], max_candidates: int = 6) -> list[int]:
    """The budgets worth timing, > 1: the full tree and up to max_candidates - 1 sizes spread
    geometrically below it (a 64-node tree: 2, 4, 8, 16, 32, 64)."""
    above = [n for n in levels if n > 1]
    if len(above) <= max_candidates:
        return above
    picks = {above[-1]}
    n = 2
    while len(picks) < max_candidates and n < above[-1]:
        picks.add(min(above, key=lambda x: abs(x - n)))
        n *= 2
    return sorted(picks)


def tokens_per_step(model, drafter, tree_arg, prompts: list[list[int]], budgets: list[int], new_tokens: int,
                    batch: int = 8) -> dict[int, float]:
    """Mean tokens emitted per step per sequence at each budget, by greedy decoding of `prompts`."""
    from ..generate import generate

    out = {}
    for n in tqdm(budgets, desc="tokens/step per budget"):
        toks = steps = 0
        for i in range(0, len(prompts), batch):
            r = generate(model, prompts[i: i + batch], drafter=drafter, tree=tree_arg, budget=n,
                         max_new_tokens=new_tokens)
            toks += sum(map(sum, r.accept_lengths))
            steps += sum(len(a) for a in r.accept_lengths)
        out[n] = toks / max(1, steps)
    return out


def _synthetic_run(model, drafter, tree, B: int, C: int, nodes: int | None, steps: int, backends, seed: int) -> tuple[float, int]:
    """One timed decoding run from a synthetic state at context C: (seconds, steps taken). nodes=None:
    the plain loop; else the speculative loop with that budget every step."""
    from ..generate import GenerateOutput, _plain_loop
    from ..speculative import speculative_loop

    g = torch.Generator().manual_seed(seed)
    V, H = model.config.vocab_size, model.config.hidden_size
    dev = model.device
    extra = 0 if nodes is None else tree.num_nodes + tree.depth
    cache = model.new_kv_cache(B, C + (steps + 2) * (tree.depth + 1) + extra)
    cache.seqlens.fill_(C)
    root = torch.randint(0, V, (B,), generator=g).to(dev)
    emitter = Emitter(B, steps, set(), None)
    stats = GenerateOutput(sequences=emitter.sequences, accept_lengths=emitter.accept_lengths)
    for b in range(B):
        emitter.emit(b, [int(root[b])], in_step=False)
    with torch.inference_mode():
        if nodes is None:
            t = time.perf_counter()
            # greedy, as generate() runs it (on the CPU the native plain step: model/plain_step.py)
            _plain_loop(model, cache, root, emitter, lambda h: model.greedy_tokens(h, backends), backends, C, stats,
                        greedy=True)
            return time.perf_counter() - t, stats.num_steps
        F = H * len(drafter.feature_layers or [0])
        hidden = torch.randn(B, C, F, generator=g).to(dev, model.dtype)
        prompts = torch.randint(0, V, (B, C), generator=g).tolist()
        lengths = torch.full((B,), C, dtype=torch.int32, device=dev)
        t = time.perf_counter()
        speculative_loop(model, drafter, tree, cache, hidden, lengths, root, emitter, temperature=0.0,
                         acceptance="greedy", posterior_threshold=0.09, posterior_alpha=0.3, generator=None,
                         backends=backends, host_seqlens=[C] * B, stats=stats, prompts=prompts,
                         budget=StepBudget(tree.num_nodes, pinned=nodes))
        return time.perf_counter() - t, stats.num_steps


class _MatchingEveryStep(NgramDrafter):
    """The n-gram drafter as the step timing needs it: the synthetic state's random text matches nothing,
    so the real drafter would draft no n-gram node and a budget's step would be timed at the heads' nodes
    alone. This one runs the same lookup (its cost included) and, where it finds nothing, drafts a
    continuation anyway (the text's last tokens, as a match of max_ngram tokens: the long match a
    CombinedDrafter serves first), so every step drafts its whole budget: the costliest case of each
    budget, which the table must afford."""

    def draft_lists(self, state):
        parents, tokens = super().draft_lists(state)
        k, nb = state.num_tokens, self.config.num_branches
        for b, p in enumerate(parents):
            text = state.indexes[b].text
            if len(p) < nb * k + 1 and not state.finished[b] and text:
                # nb continuations of k tokens with distinct first tokens (ids 0..nb-1): a trie of nb * k + 1 nodes
                tail = [text[-1 - (i % len(text))] for i in range(1, k)]
                parents[b], tokens[b] = trie(text[-1], [[j, *tail] for j in range(nb)])
                state.matched[b] = self.config.max_ngram
        return parents, tokens


def timed_as_costliest(drafter):
    """The drafter whose steps the search times: an n-gram part made to draft every step
    (_MatchingEveryStep), the rest as it is; acceptance is measured with the real drafter."""
    if isinstance(drafter, CombinedDrafter):
        return CombinedDrafter(_MatchingEveryStep(drafter.ngram.config), drafter.heads, drafter.node_budget,
                               drafter.strong_match)
    if isinstance(drafter, NgramDrafter):
        return _MatchingEveryStep(drafter.config)
    return drafter


def implausible_steps(plain_s: float, spec_s: dict[int, float], slack: float = 0.9) -> dict[int, float]:
    """The budgets whose measured step time is under `slack` x the plain step's, or not positive (every
    budget, when the plain step's is not): a speculative step does the plain step's work and more, so such a
    figure is a failed measurement."""
    return {n: s for n, s in spec_s.items() if not (plain_s > 0 and s >= slack * plain_s)}


def step_seconds(model, drafter, tree, B: int, C: int, nodes: int | None, backends, steps=(4, 16), reps: int = 5) -> float:
    """Median over reps of (time(long run) - time(short run)) / (their step difference)."""
    per = []
    for r in range(reps):
        t1, s1 = _synthetic_run(model, drafter, tree, B, C, nodes, steps[0], backends, seed=r)
        t2, s2 = _synthetic_run(model, drafter, tree, B, C, nodes, steps[1], backends, seed=r)
        per.append((t2 - t1) / max(1, s2 - s1))
    per.sort()
    return per[len(per) // 2]


def search_budget_table(model, drafter, prompts: list[list[int]], *, tree_arg=None, batch_sizes=BATCH_SIZES,
                        contexts=CONTEXTS, new_tokens: int = 64, margin: float | None = None, backend: str = "auto",
                        reps: int = 5, budgets: list[int] | None = None) -> BudgetTable:
    """The table for `drafter` with the tree generate(tree=tree_arg) resolves to on this device; reps: timed
    run pairs per step time (medians); budgets: the node budgets > 1 to time (default candidate_budgets)."""
    dev = model.device.type
    tree = drafter.resolve_tree(tree_arg, dev)
    levels = drafter.budget_levels(tree)
    if budgets is None:
        budgets = candidate_budgets(levels)
    elif not budgets or any(n <= 1 or n not in levels for n in budgets):
        raise ValueError(f"budgets must be node counts > 1 that this drafter and tree can run {[n for n in levels if n > 1]}, "
                         f"got {budgets!r}")
    budgets = sorted(set(budgets))
    acc = tokens_per_step(model, drafter, tree_arg, prompts, budgets, new_tokens)
    backends = model.backend_plan(backend)
    limit = model.config.max_position_embeddings - 16 * (tree.depth + 1) - tree.num_nodes
    contexts = [min(c, limit) for c in contexts]
    nodes, measured = [], {"tokens_per_step": {str(n): a for n, a in acc.items()}, "points": []}
    points = [(B, C) for B in batch_sizes for C in contexts]
    timed = timed_as_costliest(drafter)
    for B, C in tqdm(points, desc="step time per batch size and context"):
        plain_s = step_seconds(model, timed, tree, B, C, None, backends, reps=reps)
        spec_s = {n: step_seconds(model, timed, tree, B, C, n, backends, reps=reps) for n in budgets}
        point = {"batch": B, "context": C, "plain_tok_s": B / plain_s if plain_s > 0 else 0.0,
                 **{f"nodes_{n}_tok_s": B * acc[n] / s if s > 0 else 0.0 for n, s in spec_s.items()}}
        invalid = implausible_steps(plain_s, spec_s)
        if invalid:
            # a verify step runs more tokens than a plain step plus the drafting: one timed faster is the
            # differencing failing (Amphista at 8000 tokens, 2026-11-26: negative and 5x-too-fast steps, its
            # first pass over the context varying between runs by more than the steps cost). Not a
            # measurement: the point runs plain steps, and the table says why.
            print(f"budget search: batch {B}, context {C}: speculative steps timed faster than a plain step "
                  f"({', '.join(f'{n} nodes {s * 1e3:.1f} ms' for n, s in invalid.items())} vs "
                  f"{plain_s * 1e3:.1f} ms): not a valid timing; this point runs plain steps (rerun with more reps)")
            point.update({f"nodes_{n}_tok_s": 0.0 for n in budgets}, invalid=sorted(invalid))
        measured["points"].append(point)
    table = BudgetTable(device=dev, tree=tree_key(tree), full=tree.num_nodes, batch_sizes=list(batch_sizes),
                        contexts=list(contexts), nodes=[[1] * len(contexts) for _ in batch_sizes], measured=measured)
    return rechoose(table, MARGIN if margin is None else margin)


def rechoose(table: BudgetTable, margin: float = MARGIN) -> BudgetTable:
    """The table's node budgets chosen again from its stored predictions (table.measured["points"], in
    batch-major order) with `margin`: the one rule the search and a re-choice share. Each point's
    "chosen" is rewritten."""
    points = (table.measured or {}).get("points")
    if not points or len(points) != len(table.batch_sizes) * len(table.contexts):
        raise ValueError("this budget table stores no per-point predictions to choose from; search it again "
                         "(python python/search_budget.py)")
    nodes = []
    for pt in points:
        spec = {int(k.split("_")[1]): v for k, v in pt.items() if k.startswith("nodes_")}
        best = max(spec, key=spec.get)
        valid = not pt.get("invalid") and pt["plain_tok_s"] > 0  # a failed timing runs plain steps
        pt["chosen"] = best if valid and spec[best] >= margin * pt["plain_tok_s"] else 1
        nodes.append(pt["chosen"])
    n_ctx = len(table.contexts)
    grid = [nodes[i * n_ctx:(i + 1) * n_ctx] for i in range(len(table.batch_sizes))]
    for i in range(1, len(grid)):  # a larger batch never drafts more than a smaller one at the same context:
        grid[i] = [min(a, b) for a, b in zip(grid[i], grid[i - 1])]  # extra rows only get costlier (noise guard)
    return BudgetTable(device=table.device, tree=table.tree, full=table.full, batch_sizes=table.batch_sizes,
                       contexts=table.contexts, nodes=grid, measured={**table.measured, "margin": margin})
