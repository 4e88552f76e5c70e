"""How the adaptive policy's forecasts came true, per drafter part and depth (issue 45): for every node a drafted step
verified (an active sequence's, below the root), its forecast P (the product of the policy's conditional rates down its
path, as the cut ranked it) beside whether it was right, summed per (part, depth). Right: under greedy acceptance, on
the base model's own continuation (its token the base argmax after its parent, its parent right: what the rates learn,
adaptive._correct_nodes), so a right sibling the accepted path did not take counts right (the combined drafter's n-gram
and heads may guess the same token); under sampled acceptance, on the accepted path.

Why: a forecast that errs high drafts steps that do not pay, and one that errs low leaves steps undrafted that would.
ab_adaptive.py --calibration reports these sums for each variant.

What it costs the run: the rates are read on the host (Calibration.host_rates: a read, no pending decay applied), and
the time this takes is handed back to the policy's clock (ab_adaptive.py moves its last_t on by it), so the policy's
cost fit does not see it; the run's total time and the timed step kinds still include it (read ratios from a run without
--calibration). The forecast is read at the step's observe, before the rates learn from the step: the rates the cut
used (nothing touches them between the cut and its observe; the host cut's own P are float64 products of the same
rates). CPU tensors (the CPU policy's; a device's are copied first)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hydra_kernels.adaptive import _correct_nodes, path_products  # noqa: E402

MAX_DEPTH = 3  # depths past this one are counted with it


class ForecastCalibration:
    def __init__(self):
        self.sums: dict[tuple[int, int], list[float]] = {}  # (part, depth) -> [nodes, forecast P summed, right]

    def record(self, policy, step, accept_indices: torch.Tensor | None, tokens: torch.Tensor | None = None,
               target: torch.Tensor | None = None) -> None:
        """One step of `policy` (an adaptive.AdaptiveBudget whose step in flight is `step`, read before its observe;
        accept_indices, tokens, target: what that observe is given): nothing unless it verified a drafted tree (its
        step's verified nodes: keys, depths, valid, parents, groups)."""
        if accept_indices is None or not isinstance(step, tuple) or len(step) < 5 or step[3] is None:
            return
        keys, depths, valid, parents, groups = (t.cpu() for t in step[3])
        act = step[4]
        B, T = keys.shape
        live = act.cpu().bool() if act is not None else torch.ones(B, dtype=torch.bool)
        rows = [b for b in range(B) if live[b]]
        rates = policy.calib.host_rates({b: keys[b].tolist() for b in rows})
        P = torch.ones(B, T, dtype=torch.float64)  # a padding node's P is not counted (below)
        for b in rows:
            P[b] = torch.tensor(path_products(parents[b].tolist(), rates[b]), dtype=torch.float64)
        if target is not None:  # greedy: every right node
            right = _correct_nodes(tokens.cpu(), target.cpu(), parents, depths, valid).double()
        else:  # sampled: the accepted path
            right = torch.zeros(B, T + 1, dtype=torch.float64)
            right.scatter_(1, torch.where(accept_indices >= 0, accept_indices, T).long().cpu(), 1.0)
            right = right[:, :T]
        counted = valid & (depths > 0) & live[:, None]
        d = depths.clamp(max=MAX_DEPTH)
        for g, dep, p, a in zip(groups[counted].tolist(), d[counted].tolist(), P[counted].tolist(),
                                right[counted].tolist()):
            s = self.sums.setdefault((g, dep), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += p
            s[2] += a

    def columns(self, parts: tuple[str, ...]) -> dict:
        """Per part and depth 1 .. MAX_DEPTH: nodes verified, mean forecast P, share right (None where none)."""
        out = {}
        for g, name in enumerate(parts):
            for dep in range(1, MAX_DEPTH + 1):
                n, p, a = self.sums.get((g, dep), (0, 0.0, 0.0))
                out[f"nodes_{name}_d{dep}"] = n
                out[f"forecast_{name}_d{dep}"] = p / n if n else None
                out[f"right_{name}_d{dep}"] = a / n if n else None
        return out
