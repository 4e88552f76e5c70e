"""How the adaptive policy's forecasts came true, per drafter part and depth (issue 45): for every node a drafted step
verified (an active sequence's, below the root), its forecast P (the product of the policy's conditional rates down its
path, as the cut ranked it) beside whether it was accepted (on the accepted path), summed per (part, depth).

Why: a forecast that errs high drafts steps that do not pay. Xeon AMX VM, 2026-12-01, 8000-token prompts, batch 2 (a
`/tmp` log of 43 drafted steps): the steps' predicted times were right to 0.1% but their expected value was 14-15%
above what they reached, and the n-gram's second tokens were forecast at 0.56 and accepted 0.39 of the time (26 nodes).
ab_adaptive.py --calibration reports these sums for each variant (its timings then include this bookkeeping, ~0.1 ms
a drafted step: read them from a run without it).

A forecast here is read from the rates at the step's observe, before they learn from the step: the rates the cut used
(the policy reads no rate between its cut and its observe)."""
from __future__ import annotations

import torch

MAX_DEPTH = 3  # depths past this one are counted with it


class ForecastCalibration:
    def __init__(self):
        self.sums: dict[tuple[int, int], list[float]] = {}  # (part, depth) -> [nodes, forecast P summed, accepted]

    def record(self, policy, step, accept_indices: torch.Tensor | None) -> None:
        """One step of `policy` (an adaptive.AdaptiveBudget whose step in flight is `step`, read before its observe):
        nothing unless it verified a drafted tree (its step's verified nodes: keys, depths, valid, parents, groups)."""
        if accept_indices is None or not isinstance(step, tuple) or len(step) < 5 or step[3] is None:
            return
        keys, depths, valid, parents, groups = step[3]
        act = step[4]
        B, T = keys.shape
        rates = policy.calib.rates(keys).clamp(1e-6, 1.0).double()
        P = torch.ones(B, T, dtype=torch.float64)
        for j in range(1, T):  # tree order: a parent before its children
            P[:, j] = P.gather(1, parents[:, j:j + 1].clamp(min=0))[:, 0] * rates[:, j]
        accepted = torch.zeros(B, T + 1, dtype=torch.float64)
        accepted.scatter_(1, torch.where(accept_indices >= 0, accept_indices, T).long(), 1.0)
        live = act.bool() if act is not None else torch.ones(B, dtype=torch.bool)
        counted = valid & (depths > 0) & live[:, None]
        d = depths.clamp(max=MAX_DEPTH)
        for g, dep, p, a in zip(groups[counted].tolist(), d[counted].tolist(), P[counted].tolist(),
                                accepted[:, :T][counted].tolist()):
            s = self.sums.setdefault((g, dep), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += p
            s[2] += a

    def columns(self, parts: tuple[str, ...]) -> dict:
        """Per part and depth 1 .. MAX_DEPTH: nodes verified, mean forecast P, share accepted (None where none)."""
        out = {}
        for g, name in enumerate(parts):
            for dep in range(1, MAX_DEPTH + 1):
                n, p, a = self.sums.get((g, dep), (0, 0.0, 0.0))
                out[f"nodes_{name}_d{dep}"] = n
                out[f"forecast_{name}_d{dep}"] = p / n if n else None
                out[f"accepted_{name}_d{dep}"] = a / n if n else None
        return out
