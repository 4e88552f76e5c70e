"""Measure a drafter's acceptance prior (hydra_kernels/acceptance_prior.py): the adaptive budget's conditional acceptance
rate per (part, depth, confidence class), counted over many answers with every part drafting every step and every node
verified, so that every key a run meets is tested, not only those a policy chose to verify.

The counts are the adaptive budget's own (adaptive.Calibration.update under greedy acceptance: each verified node whose
parent was right, and whether it was), summed without the run's decay over every step of every answer; the rates are
Calibration's shrunk rates of those sums (a key never tested: what its part and signal earned at the other depths, else
adaptive.PRIOR_RATE)."""
from __future__ import annotations

import contextlib
import datetime

import torch
from tqdm.auto import tqdm

from .. import adaptive
from ..acceptance_prior import AcceptancePrior
from ..generate import generate


class _DraftEverything(adaptive.AdaptiveBudget):
    """Every part drafts every step and the cut keeps every node (a proposal that cannot be cut is verified whole
    anyway); each update of the run's counts is also added to `totals` (tested, accepted) [K], undecayed."""

    totals: list[torch.Tensor] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first = False  # no plain step to time first: the costs do not steer anything here
        update, totals = self.calib.update, self.totals

        def counted(keys, tested, accepted):
            update(keys, tested, accepted)
            totals[0].index_add_(0, keys.flatten().cpu(), tested.flatten().cpu())
            totals[1].index_add_(0, keys.flatten().cpu(), accepted.flatten().cpu())

        self.calib.update = counted

    def plan(self, contexts=None, done=None) -> tuple[bool, ...]:  # every part, whatever the step's size
        return tuple(True for _ in self.parts)

    def _best_width(self, expected, T0: int, drafted: float) -> int:
        return min(self.cap, T0) if self.prunable else T0


@contextlib.contextmanager
def _drafting_everything(totals: list[torch.Tensor]):
    """generate(budget="adaptive") runs _DraftEverything (StepBudget.policy looks AdaptiveBudget up at each run)."""
    real = adaptive.AdaptiveBudget
    adaptive.AdaptiveBudget = type("DraftEverything", (_DraftEverything,), {"totals": totals})
    try:
        yield
    finally:
        adaptive.AdaptiveBudget = real


def measure_acceptance_prior(model, drafter, prompts: list[list[int]], new_tokens: int, batch: int = 4,
                             measured: str = "") -> AcceptancePrior:
    """Greedy runs of `prompts` (batch at a time, new_tokens each, no early stop) with every node verified -> the
    drafter's acceptance prior. Every run's tokens are checked against plain decoding (lossless or refused)."""
    parts = tuple(drafter.parts)
    K = len(parts) * adaptive.MAX_DEPTH_KEY * adaptive.SIGNALS
    totals = [torch.zeros(K), torch.zeros(K)]  # tested, accepted
    memory = drafter.__dict__.pop("_adaptive_memory", None)  # this measurement starts from nothing learned
    steps = tokens = 0
    try:
        for i in tqdm(range(0, len(prompts), batch), desc="acceptance prior"):
            group = prompts[i:i + batch]
            with _drafting_everything(totals):
                out = generate(model, group, drafter=drafter, budget="adaptive", max_new_tokens=new_tokens,
                               eos_token_id=[])
            want = generate(model, group, max_new_tokens=new_tokens, eos_token_id=[]).sequences
            if out.sequences != want:
                raise RuntimeError(f"prompts {i}-{i + len(group) - 1}: speculative output differs from plain decoding")
            steps, tokens = steps + out.num_steps * len(group), tokens + sum(map(len, out.sequences)) - len(group)
    finally:
        drafter.__dict__.pop("_adaptive_memory", None)
        if memory is not None:
            drafter.__dict__["_adaptive_memory"] = memory
    tested, accepted = totals
    rates = adaptive._shrink(accepted, tested, torch.full((K,), adaptive.PRIOR_RATE), adaptive.RUN_PRIOR_WEIGHT,
                             len(parts))
    note = (f"{measured}; {len(prompts)} prompts x {new_tokens} tokens, batch {batch}, every node verified: "
            f"{tokens / max(steps, 1):.2f} tokens/step, {int(tested.sum())} nodes tested ({datetime.date.today()})")
    return AcceptancePrior(list(parts), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS, [round(float(r), 5) for r in rates],
                           [round(float(t), 2) for t in tested], note)
