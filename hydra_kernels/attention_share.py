"""What share of a decoding step each sequence's attention is: the part of a step a batch stops paying for a sequence
once that sequence has finished (the loop's finished rows skip their attention: speculative.py's `attend`), which
adaptive.py's value of a batched draft counts (bottleneck_expected's `shares`).

A plain step reads every weight once and each active sequence's committed K/V once; both stream from memory at about
the same rate, so their bytes split the step's time. Measured on the EPYC VM (2 cores), 2026-12-01, a SmolLM2-135M
plain step at batch 2 (the native step, K/V of random values; medians of 10): 47.5 ms with both sequences attending
over 8000 keys, 27.3 with one of them finished, 5.8 with neither: the attention 0.88 of the step, where the bytes below
say 0.884; over 2000 keys 16.2 / 11.3 / 5.9 ms: 0.64 measured, 0.66 by bytes; over 100 keys ~0.08, 0.125 by bytes.
"""
from __future__ import annotations

import torch

from .model.packed_linear import Linear


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every projection's packed panels (the LM head's too)
    or its weight where it has none, plus the norms; the embedding gathers one row per token (ignored)."""
    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Linear))
    return total + sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def kv_bytes_per_token(model) -> int:
    """Bytes of one token's K and V over every layer (the cache keeps the model's dtype)."""
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=model.dtype).element_size()


def kv_per_weight_byte(model) -> float:
    """One sequence's K/V bytes per committed token over the bytes of weights a step reads. Computed once per model and
    dtype (kept on the model: walking its modules took ~0.5 ms, once per generate() call before; a model cast to
    another dtype after is measured again)."""
    cache = model.__dict__.setdefault("_kv_per_weight_byte", {})
    if model.dtype not in cache:
        cache[model.dtype] = kv_bytes_per_token(model) / max(weight_bytes_per_step(model), 1)
    return cache[model.dtype]


def attention_shares(contexts: list[int], active: list[int], kv_per_weight: float) -> list[float]:
    """Per sequence b, a_b = (its K/V bytes) / (the weights' bytes + every active sequence's K/V bytes): the share of a
    plain step of this batch that attends to b's K/V. A finished sequence (active 0) attends to nothing: 0. contexts:
    each sequence's committed length (host ints)."""
    total = step_size(contexts, [not a for a in active], kv_per_weight)
    return [kv_per_weight * n / total if a else 0.0 for n, a in zip(contexts, active)]


def step_size(contexts: list[int], done: list[bool], kv_per_weight: float) -> float:
    """A plain step's bytes over the weights' bytes: 1 + every attending sequence's K/V (a done sequence skips its
    attention). A step's time is about this times a plain step's with no context; adaptive.StepCosts fits its costs
    per unit of it, so a step with a sequence finished, or a run at another context, is priced from the same fit.
    EPYC VM, 2026-12-01 (bench_attend_share.py): a batch-2 plain step over 8000 keys 47.0 ms at size 8.6, 26.9 with one
    finished at 4.8, 5.6 with none at 1: 5.5-5.6 ms a unit; over 2000 keys 16.5 / 11.1 ms at 2.9 / 1.95: 5.7."""
    return 1.0 + kv_per_weight * sum(n for n, d in zip(contexts, done) if not d)
