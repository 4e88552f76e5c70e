"""The acceptance rates a drafter ships with (acceptance_rates.json beside its weights or budget tables): where the
adaptive budget (adaptive.py) starts its conditional acceptance rates in a process that has not run the drafter yet.

Why: the adaptive budget learns P(node right | parent right) per (part, depth, confidence class) during a process's
runs, each unseen key starting from adaptive.PRIOR_RATE (0.4). In a fresh process, say one CLI or `make demo` answer,
every key starts there, so the heads' unconfident guesses look worth a row until several of them have been rejected.
Xeon AMX VM, 2026-11-30, the demo's prompt ("Why is the sky blue?", 200 tokens, 9 fresh processes, interleaved with
plain decoding and the table): the adaptive budget ran 0.90 of plain (total; median process 0.92) where the table, plain
steps throughout there, ran 0.97. A warm process ran 0.99 on MT-Bench answers. The rates learned over many answers
(python/calibrate_acceptance.py, on training-split ShareGPT prompts, never the evaluation sets) are a better start.

The rates are the drafter's and its text's, not the machine's (the step costs are timed per machine: adaptive.StepCosts),
so one file serves every device. A run's learned rates still take over from the next run on (adaptive.memory).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = "acceptance_rates.json"


@dataclass
class AcceptancePrior:
    """rates[(part * max_depth_key + depth - 1) * signals + signal]: the conditional acceptance rate of a node of
    `parts[part]` at `depth` (the last depth key shared by every deeper node) whose confidence class is `signal`
    (adaptive.Calibration's keys). `tested`: how many nodes of each key the rate was learned from (0: the pooled prior).
    `measured`: how, on what, when."""

    parts: list[str]
    max_depth_key: int
    signals: int
    rates: list[float]
    tested: list[float]
    measured: str = ""

    def __post_init__(self):
        n = len(self.parts) * self.max_depth_key * self.signals
        if not self.parts or self.max_depth_key < 1 or self.signals < 1:
            raise ValueError(f"an acceptance prior needs parts, depths and signals, got {self.parts!r}, "
                             f"{self.max_depth_key!r}, {self.signals!r}")
        if len(self.rates) != n or len(self.tested) != n:
            raise ValueError(f"an acceptance prior of {len(self.parts)} parts x {self.max_depth_key} depths x "
                             f"{self.signals} signals holds {n} rates and counts, got {len(self.rates)} and "
                             f"{len(self.tested)}")
        if any(not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 <= r <= 1.0 for r in self.rates):
            raise ValueError("acceptance prior rates must be numbers in [0, 1]")
        if any(not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 for t in self.tested):
            raise ValueError("acceptance prior counts must be numbers >= 0")

    def fits(self, parts, max_depth_key: int, signals: int) -> bool:
        """Does it key the nodes as a run of a drafter with these parts and this calibration layout does?"""
        return list(parts) == list(self.parts) and (max_depth_key, signals) == (self.max_depth_key, self.signals)

    def save(self, directory) -> Path:
        path = Path(directory) / FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path) -> "AcceptancePrior":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError; missing / unknown fields: TypeError
            raise ValueError(f"{path} is not an acceptance prior ({e}); delete it or measure it again "
                             "(python python/calibrate_acceptance.py)") from e


def load_prior(directory) -> AcceptancePrior | None:
    """A drafter directory's acceptance prior, or None where it has none."""
    path = Path(directory) / FILE
    return AcceptancePrior.load(path) if path.is_file() else None
