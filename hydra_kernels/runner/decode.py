"""DecodeRunner: owns a model's decode-step buffers and runs each step through an executor (graphs.py).

Per batch bucket (the batch padded up: BATCH_BUCKETS) it keeps one StepBuffers: the KV cache (reused by
every generate() call whose request fits it, so that captured graphs stay valid), the token buffer a plain
step reads and writes, `live` / `active` masks (padding rows: 0), and the Philox seed / offset of sampling.
A step's host ints are reduced to buckets before they reach a step function: kv_len is kv_bucket(context +
T) (a power of two, at least KV_MIN rows, at most the cache's), so a graph is reused for many steps and
no value that changes per step is baked into one. Keys: (kind, batch bucket, KV bucket, tree or node
budget, capture, sampler constants, backends, dtype).

The loop (generate/ plain decoding, speculative.py) decides the step (budget, drafter, acceptance), calls
plain() or spec(), and reads the step's result once with read() (CUDA: one pinned, non-blocking
copy and an event; the CPU: tolist).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..model.kv_cache import KV_MIN, kv_bucket  # noqa: F401 (KV_MIN: re-exported)
from ..tree import Tree
from .graphs import CudaGraphs, Eager, warn_once
from .steps import Sampler, SpecOut, greedy_spec_step, plain_step, rejection_spec_step

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def batch_bucket(batch: int) -> int:
    """The batch size a step of `batch` sequences runs at: the smallest bucket >= batch (past the largest
    bucket: the next multiple of 16)."""
    for b in BATCH_BUCKETS:
        if b >= batch:
            return b
    return -(-batch // 16) * 16


def plan_key(plan) -> tuple:
    """A BackendPlan as a hashable key part (its ops and packed flag decide the kernels a graph holds)."""
    return plan.requested, plan.device_type, tuple(sorted(plan.ops.items())), plan.packed_linear


class StaticTree(NamedTuple):
    """A tree's tensors as a step reads them (greedy_verify_step: mask, depths, paths): copies the runner
    owns, so a captured graph never reads a drafter's tensors, which may be freed or replaced."""

    mask: torch.Tensor
    depths: torch.Tensor
    paths: torch.Tensor


@dataclass
class StepBuffers:
    """One batch bucket's static buffers. cache: KVCache [.., bucket, S, ..]; tokens int64 [bucket] (a plain
    step's input and output); live int32 [bucket] (1: a real sequence; plain decoding commits its row);
    active int64 [bucket] (speculative: 0 for a finished or padding row); seed / offset int64 [1]."""

    cache: object
    tokens: torch.Tensor
    live: torch.Tensor
    active: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor
    spec: dict = field(default_factory=dict)  # spec key -> (tokens [bucket, T], StaticTree)
    steps: dict = field(default_factory=dict)  # key -> the bound zero-argument step (one per key: a stable closure)

    @property
    def bucket(self) -> int:
        return self.tokens.shape[0]


class DecodeRunner:
    """A model's decode runner (runner_for caches one per model and executor kind). executor: Eager (the
    static-buffer path without graphs), CudaGraphs, or graphs.Compiled (tests)."""

    def __init__(self, model, executor):
        self.model = model
        self.executor = executor
        self.buffers: dict[int, StepBuffers] = {}
        self._host: dict = {}  # (shape, dtype) -> pinned host tensor of the step read (CUDA)
        self._event = torch.cuda.Event() if executor.graphs else None
        self._weights = None  # the parameters' storages the graphs were captured over

    # ---- buffers ----------------------------------------------------------------------------------
    def start(self, batch: int, max_seq_len: int) -> StepBuffers:
        """The buffers of `batch`'s bucket with a KV cache of at least max_seq_len rows (kept from an earlier
        call when it fits: its graphs stay valid; else a new cache and that bucket's graphs dropped); rows
        [0, batch) live and active, the padding rows after them not."""
        m = self.model
        weights = tuple(p.data_ptr() for p in m.parameters())
        if weights != self._weights and isinstance(self.executor, CudaGraphs):  # model.to(), new weights: recapture
            self.executor.drop(lambda k: True)
        self._weights = weights
        Bb = batch_bucket(batch)
        bufs = self.buffers.get(Bb)
        c = None if bufs is None else bufs.cache
        if c is None or c.max_seq_len < max_seq_len or c.kv.dtype != m.dtype or c.kv.device != m.device:
            dev = m.device
            cache = m.new_kv_cache(Bb, max_seq_len)
            z = lambda dt: torch.zeros(Bb, dtype=dt, device=dev)  # noqa: E731
            bufs = StepBuffers(cache, z(torch.long), z(torch.int32), z(torch.long),
                               torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
            self.buffers[Bb] = bufs
            if isinstance(self.executor, CudaGraphs):  # graphs over the replaced buffers
                self.executor.drop(lambda k: k[1] == Bb)
        mask = torch.arange(Bb) < batch
        bufs.live.copy_(mask.to(torch.int32))
        bufs.active.copy_(mask.long())
        bufs.cache.reset()
        return bufs

    def release(self) -> None:
        """Free the buffers (the KV caches kept for later calls) and the graphs; a later call starts afresh."""
        self.buffers.clear()
        self._host.clear()
        if isinstance(self.executor, CudaGraphs):
            self.executor.drop(lambda k: True)

    def seed(self, bufs: StepBuffers, seed: int) -> None:
        """Sampling draws from Philox(seed, offset 0, 1, ...) from now on."""
        bufs.seed.fill_(seed)
        bufs.offset.zero_()

    def sampler(self, bufs: StepBuffers, temperature: float, top_k: int, top_p: float) -> Sampler | None:
        return None if temperature == 0 else Sampler(temperature, top_k, top_p, bufs.seed, bufs.offset)

    # ---- steps ------------------------------------------------------------------------------------
    def plain(self, bufs: StepBuffers, context: int, backends, sampler: Sampler | None = None, *, capture=None,
              live: torch.Tensor | None = None, keep: bool = False):
        """One plain step: bufs.tokens (each sequence's last token) in, the next tokens out (also left in
        bufs.tokens) with the step's features. context: a host bound on every committed length before the
        step. live: the rows that commit (default bufs.live; a speculative loop passes bufs.active).
        keep: the outputs outlive the next step (a replay rewrites a graph's outputs: copies)."""
        c = bufs.cache
        kv = kv_bucket(context + 1, c.max_seq_len)
        live = bufs.live if live is None else live
        skey = None if sampler is None else sampler[:3]
        key = ("plain", bufs.bucket, kv, capture, skey, live is bufs.active, plan_key(backends), self.model.dtype)
        step = bufs.steps.get(key)
        if step is None:
            m = self.model

            def step():
                return plain_step(m, c, bufs.tokens, live, kv_len=kv, backends=backends, sampler=sampler,
                                  capture=capture)
            bufs.steps[key] = step
        out = self.executor.run(key, step, lambda: _snapshot(c.seqlens, bufs.tokens, bufs.offset), self._hold)
        return tuple(t.clone() for t in out) if keep and self.executor.graphs else out

    def spec(self, bufs: StepBuffers, tokens: torch.Tensor, tree, context: int, backends, *, capture=None,
             nodes: int | None = None, depth: int | None = None, sampler: Sampler | None = None) -> SpecOut | None:
        """One speculative step over a proposal: tokens [bucket, T] and its tree (a Tree: its own graph per
        tree; a TreeBatch: padded into buffers of `nodes` nodes and `depth` levels, the step's bounds, so
        that every step of one budget shares a graph), accepted greedily (sampler None) or by exact
        rejection sampling with the sampler's law and Philox noise (rejection_spec_step). context: a host
        bound on every committed length. Returns the step's outputs (rows past the proposal's own depth
        trimmed) or None when the proposal does not fit the bounds (the caller runs that step eagerly)."""
        c = bufs.cache
        if isinstance(tree, Tree):
            T, D = tree.num_nodes, tree.depth
            shape = ("tree", tuple(tree.choices))
        else:
            T, D = nodes, min(depth, nodes - 1)
            shape = ("batch", T, max(T - 1, 1), D)
            if tree.num_nodes > T or tree.depth > D or tree.paths.shape[1] > shape[2]:
                warn_once(f"a proposal larger than its step's budget ({tree.num_nodes} nodes, depth {tree.depth}, "
                          f"{tree.paths.shape[1]} leaves for {nodes} nodes) is verified eagerly")
                return None
        kv = kv_bucket(context + T, c.max_seq_len)
        skey = None if sampler is None else sampler[:3]
        key = ("spec", bufs.bucket, kv, capture, shape, skey, plan_key(backends), self.model.dtype)
        inputs = bufs.spec.get(shape)
        if inputs is None:
            inputs = bufs.spec[shape] = _spec_inputs(tree, bufs.bucket, shape, c.kv.device)
        tok_in, st = inputs
        if isinstance(tree, Tree):
            tok_in.copy_(tokens, non_blocking=True)
        else:
            _pad_tree_batch(tok_in, st, tokens, tree)
        step = bufs.steps.get(key)
        if step is None:
            m = self.model

            if sampler is None:
                def step():
                    return greedy_spec_step(m, c, tok_in, st, bufs.active, kv_len=kv, backends=backends,
                                            capture=capture)
            else:
                def step():
                    return rejection_spec_step(m, c, tok_in, st, bufs.active, kv_len=kv, backends=backends,
                                               sampler=sampler, capture=capture)
            bufs.steps[key] = step
        out = self.executor.run(key, step, lambda: _snapshot(c.seqlens, bufs.offset), self._hold)
        if self.executor.graphs:  # the drafter may keep what it gets past the next replay: its own copies
            out = SpecOut(*(t.clone() for t in out))
        if not isinstance(tree, Tree):  # the proposal's own depth: what the eager step hands the drafter
            d = tree.depth + 1
            out = out._replace(accepted_feats=out.accepted_feats[:, :d], accepted_tokens=out.accepted_tokens[:, :d],
                               target=out.target[:, :tree.num_nodes])
        return out

    def _hold(self):
        """What a captured step reads that its owner may replace later: the model's RoPE table (a longer
        cache grows it: a new table, the old one freed unless a graph keeps it)."""
        return self.model._rope._table

    # ---- the host read ----------------------------------------------------------------------------
    def read(self, t: torch.Tensor) -> list:
        """t's values on the host, the step's one read: on CUDA one non-blocking copy into a pinned buffer
        and an event waited on; elsewhere tolist."""
        if t.device.type != "cuda":
            return t.tolist()
        key = (tuple(t.shape), t.dtype)
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        event = self._event or torch.cuda.Event()
        host.copy_(t, non_blocking=True)
        event.record()
        event.synchronize()
        return host.tolist()


def _snapshot(*tensors: torch.Tensor):
    """Copies of what a step mutates, and the function that puts them back (a graph's warm-up calls run the
    step for real: undone so that the first replay is the step's first run)."""
    saved = [t.clone() for t in tensors]

    def undo():
        for t, s in zip(tensors, saved):
            t.copy_(s)
    return undo


def _spec_inputs(tree, Bb: int, shape: tuple, device) -> tuple[torch.Tensor, StaticTree]:
    """(tokens [Bb, T], StaticTree) of a spec key: a Tree's tensors copied once; a TreeBatch's buffers."""
    if shape[0] == "tree":
        st = StaticTree(tree.mask.to(device).clone(), tree.depths.to(device).clone(), tree.paths.to(device).clone())
        return torch.zeros(Bb, tree.num_nodes, dtype=torch.long, device=device), st
    _, T, P, D = shape
    st = StaticTree(torch.zeros(Bb, T, T, dtype=torch.bool, device=device),
                    torch.zeros(Bb, T, dtype=torch.long, device=device),
                    torch.zeros(Bb, P, D + 1, dtype=torch.long, device=device))
    return torch.zeros(Bb, T, dtype=torch.long, device=device), st


def _pad_tree_batch(tok_in: torch.Tensor, st: StaticTree, tokens: torch.Tensor, tb) -> None:
    """A TreeBatch proposal written into a step's padded buffers: extra nodes are token 0, depth 0, seeing
    only themselves and on no path (never accepted, as TreeBatch pads); extra leaf rows are [0, -1, ...]
    (accept nothing, and after the real rows: never chosen on a tie); extra path columns -1."""
    T, (P, D1) = tb.num_nodes, tb.paths.shape[1:]
    tok_in.zero_()
    tok_in[:, :T] = tokens
    st.mask.copy_(torch.eye(st.mask.shape[-1], dtype=torch.bool, device=st.mask.device).expand_as(st.mask))
    st.mask[:, :T, :T] = tb.mask
    st.depths.zero_()
    st.depths[:, :T] = tb.depths
    st.paths.fill_(-1)
    st.paths[:, :, 0] = 0
    st.paths[:, :P, :D1] = tb.paths


# ---- which runner, if any ----------------------------------------------------------------------------
_RUNNER_ATTR = "_decode_runners"


class _Runners(dict):
    """A model's runners (kind -> DecodeRunner). A copy or a pickle of the model starts with none: graphs
    and buffers belong to the model they were captured on."""

    def __deepcopy__(self, memo):
        return _Runners()

    def __reduce__(self):
        return _Runners, ()


def runner_for(model, kind: str = "graphs", executor=None) -> DecodeRunner:
    """The model's runner of this kind ("graphs": CUDA graphs; "eager": the static-buffer path without
    graphs), created on first use and cached on the model (its graphs and buffers are reused across
    generate() calls). executor: a custom one (tests: graphs.Compiled), cached under its own identity."""
    runners = model.__dict__.setdefault(_RUNNER_ATTR, _Runners())
    key = kind if executor is None else (kind, id(executor))
    r = runners.get(key)
    if r is None:
        if executor is None:
            executor = CudaGraphs() if kind == "graphs" else Eager()
        r = runners[key] = DecodeRunner(model, executor)
    return r
