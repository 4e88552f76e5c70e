"""How the runner executes a step function: eagerly, replayed from a CUDA graph, or traced by torch.compile.

A step is a zero-argument callable over the runner's static buffers (runner/decode.py binds them) that
mutates some of them (the KV rows past the committed prefix, seqlens, the token and noise-offset buffers)
and returns its outputs. Each executor maps (key, step) -> outputs; the key names everything that fixes
the step's shapes and constants (batch bucket, node budget or tree, KV bucket, dtype, backends, sampler).

CudaGraphs captures each key once (torch.cuda.CUDAGraph into one memory pool shared by the model's
graphs), after warm-up calls on a side stream (Triton autotuning and compiles, the extension's first calls,
the RoPE table, allocator pools settle off the capture); the warm-up's writes to the mutated buffers are
undone (`restore`) so that the first replay is the step's first run. Replays reuse the captured outputs.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

_WARNED: set[str] = set()


def warn_once(reason: str) -> None:
    """One warning per reason per process: a case that cannot be captured runs eagerly, never silently."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"CUDA graphs not used: {reason}", RuntimeWarning, stacklevel=3)


def warm_up(step: Callable, undo: Callable[[], None], calls: int) -> None:
    """Run the step `calls` times, each undone (undo: restore()'s, over a snapshot of what the step mutates),
    so that the state after is the state before."""
    for _ in range(calls):
        step()
        undo()


class Eager:
    """Calls the step: the static-buffer path without graphs (what the CPU tests run)."""

    graphs = False

    def run(self, key, step: Callable, restore, hold=None):
        return step()


class Compiled:
    """torch.compile(fullgraph=True, dynamic=False) of each key's step (tests: `compiles` counts the traces;
    a host int that changes per step would retrace every step)."""

    graphs = False

    def __init__(self, backend="aot_eager"):
        self.backend = backend
        self.fns: dict = {}
        self.compiles = 0

    def run(self, key, step: Callable, restore, hold=None):
        fn = self.fns.get(key)
        if fn is None:
            def count(gm, example_inputs):
                self.compiles += 1
                if callable(self.backend):
                    return self.backend(gm, example_inputs)
                return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

            fn = self.fns[key] = torch.compile(_call, fullgraph=True, dynamic=False, backend=count)
        return fn(step)


def _call(step):  # the traced frame: the step's closure (static buffers, constants) is what dynamo guards on
    return step()


class CudaGraphs:
    """One CUDA graph per key, captured on first use into a pool shared by all of them, replayed after.
    A key whose capture fails runs its step eagerly from then on, with a warning naming the error (once)."""

    graphs = True

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()
        # key -> (CUDAGraph, captured outputs: static, rewritten by every replay, what it must keep alive),
        # or None: the key's capture failed, its step runs eagerly
        self.entries: dict = {}
        self.replays = 0
        # None, or a list that each replay appends (key, start event, end event) to (benchmarks: the replay's
        # device time, and the device's idle gap between replays = the host's time per step)
        self.timed: list | None = None

    def run(self, key, step: Callable, restore: Callable[[], Callable[[], None]], hold: Callable | None = None):
        """Replay key's graph (captured now if new). restore() snapshots what the step mutates and returns
        the function that puts it back; hold() names tensors the graph reads that their owner may replace
        (the model's RoPE table): kept alive with the graph, so that a replaced one is never freed under it."""
        if key not in self.entries:
            self.entries[key] = self._capture(key, step, restore, hold)
        entry = self.entries[key]
        if entry is None:
            return step()
        if self.timed is None:
            entry[0].replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entry[0].replay()
            end.record()
            self.timed.append((key, start, end))
        self.replays += 1
        return entry[1]

    def _capture(self, key, step, restore, hold):
        undo = restore()  # snapshot of what the step mutates
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm_up(step, undo, self.warmup)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()
        except Exception as exc:  # noqa: BLE001 - reported; the step still runs, eagerly
            torch.cuda.synchronize()
            undo()
            warn_once(f"capturing the {key[0]} step failed ({type(exc).__name__}: {str(exc)[:200]}); "
                      "those steps run eagerly")
            return None
        return graph, out, None if hold is None else hold()

    def drop(self, predicate: Callable[[tuple], bool]) -> None:
        """Forget the graphs whose key matches (their buffers were replaced)."""
        for k in [k for k in self.entries if predicate(k)]:
            del self.entries[k]
        if all(v is None for v in self.entries.values()):
            # the old pool was released with its last graph (use count 0) while blocks of it may still be
            # alive; torch's allocator asserts on a capture into such a pool: later captures take a new one
            self.pool = torch.cuda.graph_pool_handle()
