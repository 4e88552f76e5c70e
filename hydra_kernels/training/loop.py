"""What every drafter's training run shares: AdamW with linear warmup then cosine decay, gradient
clipping, the base model frozen while the drafter trains, and a checkpoint that resumes only the run
that wrote it (named by run_fingerprint: the model, the drafter's shapes and draft vocabulary, the
data and the settings)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .hidden_cache import HiddenStates, _model_key


def run_fingerprint(model, drafter, data: HiddenStates, settings: dict) -> str:
    """16 hex digits naming what a training run depends on: the base model (config, a weight sample), the
    drafter's kind, parameter shapes and draft vocabulary, the data's token ids and trained positions,
    and the optimisation settings. Hidden states are not hashed: they follow from ids and model."""
    h = hashlib.sha256()
    h.update(_model_key(model, model.dtype).encode())
    h.update(json.dumps({"kind": drafter.kind, **{k: str(v) for k, v in settings.items()},
                         "shapes": [[k, list(v.shape)] for k, v in drafter.state_dict().items()]}).encode())
    if getattr(drafter, "draft_vocab", None) is not None:
        h.update(drafter.draft_vocab.cpu().numpy().tobytes())
    for t in (data.ids, data.after, data.trainable):
        if t is not None:
            h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class TrainingRun:
    """The optimiser, schedule, sampling generator, history and checkpoint of one drafter's training.

    checkpoint: a file, written every checkpoint_every steps and at the end, resumed from when it exists
    and the same run wrote it (else a ValueError before any step); checkpoint_dir instead: the file is
    <dir>/ckpt-<kind>-<fingerprint>.pt, so another run (new data, other settings) starts afresh beside it.
    param_groups: optimiser groups (default: every trainable parameter at lr)."""

    def __init__(self, model, drafter, data: HiddenStates, settings: dict, *, steps: int, lr: float, warmup: int,
                 grad_clip: float, seed: int, history: dict, weight_decay: float = 0.0, param_groups=None,
                 checkpoint: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 100):
        if checkpoint is not None and checkpoint_dir is not None:
            raise ValueError("pass checkpoint (a file) or checkpoint_dir (a folder), not both")
        self.model, self.drafter, self.steps, self.grad_clip = model, drafter, steps, grad_clip
        self.fingerprint = run_fingerprint(model, drafter, data, settings)
        if checkpoint_dir is not None:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            checkpoint = Path(checkpoint_dir) / f"ckpt-{drafter.kind}-{self.fingerprint}.pt"
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.every = checkpoint_every
        self.gen = torch.Generator().manual_seed(seed)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        groups = param_groups if param_groups is not None else [{"params": self.params, "lr": lr}]
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: min(1.0, (s + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        self.history, self.start = history, 0
        if self.checkpoint is not None and self.checkpoint.exists():
            state = torch.load(self.checkpoint, map_location="cpu", weights_only=False)  # the generator state is CPU-only; load_state_dict moves the rest
            if state.get("fingerprint") != self.fingerprint:  # resuming it would hand back another run's drafter
                raise ValueError(f"checkpoint {self.checkpoint} was written by a different training run (other data, "
                                 "drafter, draft vocabulary or settings): delete it, or pass another checkpoint path "
                                 "or checkpoint_dir")
            drafter.load_state_dict(state["drafter"])
            self.opt.load_state_dict(state["opt"])
            self.sched.load_state_dict(state["sched"])
            self.gen.set_state(state["gen"])
            self.history, self.start = state["history"], state["step"]

    def save(self, step: int) -> None:
        if self.checkpoint is None:
            return
        tmp = Path(str(self.checkpoint) + ".tmp")
        torch.save({"drafter": self.drafter.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "gen": self.gen.get_state(), "history": self.history,
                    "step": step, "fingerprint": self.fingerprint}, tmp)
        tmp.replace(self.checkpoint)

    def update(self, loss) -> float:
        """One optimiser step on `loss` (a step whose batch trained nothing still advances the schedule);
        returns the loss as a float."""
        self.opt.zero_grad(set_to_none=True)
        if torch.is_tensor(loss) and loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.opt.step()
        self.sched.step()
        return float(loss.detach()) if torch.is_tensor(loss) else float(loss)

    def done(self, step: int) -> None:
        """After step `step` (0-based): checkpoint every `checkpoint_every` steps."""
        if (step + 1) % self.every == 0:
            self.save(step + 1)

    @contextlib.contextmanager
    def steps_left(self, desc: str, progress: bool = True):
        """The remaining steps (a tqdm bar), the base model frozen and the drafter in train mode meanwhile;
        at a normal end, the final checkpoint; always, both modules back as they were."""
        model_grad = [p.requires_grad for p in self.model.parameters()]
        self.model.requires_grad_(False)
        self.drafter.train()
        try:
            yield tqdm(range(self.start, self.steps), desc=desc, disable=not progress, initial=self.start,
                       total=self.steps)
            self.save(self.steps)
        finally:
            self.drafter.eval()
            for p, g in zip(self.model.parameters(), model_grad):
                p.requires_grad_(g)


def steps_within(budget_s, time_steps, probes: tuple[int, int] = (3, 13)) -> int:
    """How many training steps fit in budget_s seconds. time_steps(n) runs n steps of a throwaway copy
    of the run and returns the seconds it took. budget_s: seconds, or a function returning the seconds left,
    asked after the probes (a deadline for the whole run: the probes' own time is then spent from it). A first, untimed probe takes the one-time costs (on a GPU:
    loading kernels, the first backward, the allocator's growth); the cost of a step is then the difference
    of the two timed probes over their step difference, so each run's fixed costs (building the optimiser)
    drop out, or the longer probe's mean where noise makes the difference vanish. For a fixed-length
    schedule (the cosine decay here) on a machine of unknown speed, e.g. a lent GPU's one timed call."""
    lo, hi = probes
    if not callable(budget_s) and budget_s <= 0:
        raise ValueError(f"a time budget must be > 0 seconds, got {budget_s}")
    if not 0 < lo < hi:
        raise ValueError(f"probes must be two step counts 0 < lo < hi, got {probes}")
    time_steps(lo)  # warm-up, not timed
    t_lo, t_hi = time_steps(lo), time_steps(hi)
    if callable(budget_s):
        budget_s = budget_s()
        if budget_s <= 0:
            raise ValueError(f"no time is left to train in ({budget_s:.0f} s after loading, the hidden states and "
                             "the probes): give the run a later deadline")
    per_step = (t_hi - t_lo) / (hi - lo)
    if per_step < 0.1 * t_hi / hi:  # the difference is noise: a step costs at most the longer probe's mean
        per_step = t_hi / hi
    return max(1, int(budget_s / per_step))
