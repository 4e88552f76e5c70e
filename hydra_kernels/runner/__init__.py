"""The decode runner: where a decoding step runs (issue 43).

generate() (plain decoding) and speculative.py (the speculative loop) decide what a step is; the runner
runs it over static buffers it owns (decode.py), through step functions that take no host int that
changes per step (steps.py), either eagerly or replayed from CUDA graphs captured per (batch bucket, KV
bucket, tree or node budget, dtype, ...) into one memory pool and cached on the model (graphs.py). The
host reads each step's result once (DecodeRunner.read).

What goes through it: plain decoding (greedy, and sampling with device-side Philox noise) and speculative
decoding with greedy or exact rejection acceptance (the verify forward, the acceptance with Philox noise
for rejection, commit_kv and the seqlens advance; a proposal's static Tree gets its own graph, a TreeBatch
is padded to the step's node budget). The drafter's propose and after_step run eagerly between replays;
a proposal of sampled drafts (draft_probs) is verified eagerly. Typical acceptance is not captured: such
a run is eager, with a warning (choose).

`choose(cuda_graphs, model, ...)` is generate()'s decision: on CUDA, graphs unless cuda_graphs=False or
the case cannot be captured (then a warning naming the reason, once per reason); elsewhere no runner
(the CPU keeps its eager loop and its speed), unless a caller asked for the static-buffer path with
`static_buffers()` (tests: the same buffers and step functions as the graphs, run eagerly or traced).
"""
from __future__ import annotations

import contextlib
import contextvars

from .decode import (BATCH_BUCKETS, KV_MIN, DecodeRunner, StepBuffers, batch_bucket, kv_bucket,  # noqa: F401
                     runner_for)
from .graphs import _WARNED, Compiled, CudaGraphs, Eager, warn_once  # noqa: F401
from .steps import Sampler, SpecOut, greedy_spec_step, plain_step, rejection_spec_step, sample_tokens  # noqa: F401

_STATIC = contextvars.ContextVar("hydra_kernels_static_buffers", default=None)


@contextlib.contextmanager
def static_buffers(executor=None):
    """Inside this block generate() runs its steps through the runner on any device, with `executor`
    (default graphs.Eager(): the static-buffer path without graphs; graphs.Compiled(): traced by
    torch.compile) instead of CUDA graphs. For tests: the CPU checks the exact path the graphs replay."""
    token = _STATIC.set(executor or Eager())
    try:
        yield
    finally:
        _STATIC.reset(token)


def uncapturable(drafter, acceptance: str, temperature: float) -> str | None:
    """Why this request's steps cannot go through the runner, or None."""
    if drafter is not None and temperature > 0.0 and acceptance == "typical":
        return "typical acceptance is not captured yet; the run decodes eagerly"
    return None


def choose(cuda_graphs, model, drafter, acceptance: str, temperature: float) -> DecodeRunner | None:
    """The runner generate() uses for this request, or None (the eager loop). cuda_graphs: None (on where it
    applies: a CUDA model), True (asked for: a warning where it cannot apply), False (never)."""
    executor = _STATIC.get()
    why = uncapturable(drafter, acceptance, temperature)
    if executor is not None:  # static_buffers(): the runner's path on any device, eagerly or traced
        if why is not None:
            warn_once(why)
            return None
        return runner_for(model, "static", executor)
    if cuda_graphs is False:
        return None
    if model.device.type != "cuda":
        if cuda_graphs:
            warn_once(f"cuda_graphs=True needs a CUDA model (this one is on {model.device.type}); the run decodes "
                      "eagerly")
        return None
    if why is not None:
        warn_once(why)
        return None
    return runner_for(model, "graphs")
