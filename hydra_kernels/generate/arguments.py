"""generate()'s argument checks, in one place: every value a user passes is checked here, before any
work (no prefill, no buffer), and a clear TypeError / ValueError says what to change. Numbers come back
normalised (numpy integers and floats accepted as the Python numbers they stand for).

What is checked elsewhere, once: the tree (tree.as_tree parses it; the drafter's resolve_tree bounds
it by its heads and draft vocabulary), the backend (ops/backend.plan_backends, also for
HYDRA_KERNELS_BACKEND; BackendPlan.check_tree for a backend's limits), a drafter's fit to the model
(Drafter.check_model).
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import torch


def as_int(name: str, value, *, low: int | None = None) -> int:
    """An integer argument (int, numpy / torch integer; not bool, not float) -> int, >= low."""
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    return v


def as_real(name: str, value) -> float:
    """A finite real argument (int, float, numpy scalar; not bool, nan or inf) -> float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def sampling_args(temperature, top_k, top_p, seed, posterior_threshold, posterior_alpha):
    """-> (temperature >= 0, top_k >= 0 (0: off), top_p in (0, 1], seed int or None, threshold, alpha)."""
    temperature = as_real("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_k = as_int("top_k", top_k, low=0)
    top_p = as_real("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if seed is not None:
        seed = as_int("seed", seed)
        if not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    posterior_threshold = as_real("posterior_threshold", posterior_threshold)
    posterior_alpha = as_real("posterior_alpha", posterior_alpha)
    if posterior_threshold < 0 or posterior_alpha < 0:
        raise ValueError(f"posterior_threshold and posterior_alpha must be >= 0, got {posterior_threshold} "
                         f"and {posterior_alpha}")
    return temperature, top_k, top_p, seed, posterior_threshold, posterior_alpha


def prompts(input_ids, vocab_size: int) -> list[list[int]]:
    """LongTensor [B, L] or a list of token lists (ints, numpy integers, 1-D integer tensors or arrays)
    -> validated list of lists of int: a token id that is no integer (a float, a bool) is a TypeError, one outside
    the vocabulary or a tensor on the meta device (no values) a ValueError."""
    if not isinstance(input_ids, (torch.Tensor, Sequence)) and hasattr(input_ids, "__array__"):
        input_ids = torch.as_tensor(input_ids)  # a numpy array [B, L]
    if isinstance(input_ids, torch.Tensor):
        _has_values(input_ids, "input_ids")
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be an integer tensor [B, L], got {input_ids.dtype} {tuple(input_ids.shape)} "
                "(a single prompt: input_ids[None])"
            )
        rows = input_ids.tolist()
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        rows = []
        for b, p in enumerate(input_ids):
            if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
                raise ValueError("input_ids must be a list of token lists (one per sequence); a single prompt: [ids]")
            if isinstance(p, torch.Tensor):
                _has_values(p, f"prompt {b}")
            rows.append(p.tolist() if hasattr(p, "tolist") else list(p))
    else:
        raise TypeError(f"input_ids must be a LongTensor [B, L] or a list of token lists, got {type(input_ids)}")
    if not rows:
        raise ValueError("input_ids holds no sequence")
    out = []
    for b, p in enumerate(rows):
        if not p:
            raise ValueError(f"prompt {b} is empty; every sequence needs at least one token")
        ids = []
        for i, t in enumerate(p):
            try:
                v = None if isinstance(t, bool) else operator.index(t)
            except TypeError:
                v = None
            if v is None:
                raise TypeError(f"prompt {b} has token id {t!r} at position {i}, a {type(t).__name__}: token ids must be "
                                "ints (int(t); a tensor: .long())")
            if not 0 <= v < vocab_size:
                raise ValueError(f"prompt {b} has token id {t!r} at position {i}, outside the vocabulary [0, {vocab_size})")
            ids.append(v)
        out.append(ids)
    return out


def _has_values(t: torch.Tensor, name: str) -> None:
    """A tensor on the meta device has a shape but no values to read: refused before any work."""
    if t.is_meta:
        raise ValueError(f"{name} is a tensor on the meta device, which holds no values; pass one with data (on the "
                         "CPU or the model's device)")


def eos_set(eos_token_id, default: Sequence[int], vocab_size: int) -> set[int]:
    """eos_token_id: None (the model config's `default`), an int or a list of ints in [0, vocab_size)."""
    if eos_token_id is None:
        return set(default)
    if isinstance(eos_token_id, (str, bytes)) or isinstance(eos_token_id, (bool, float)):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    try:
        ids = [operator.index(eos_token_id)]
    except TypeError:
        if not hasattr(eos_token_id, "__iter__"):
            raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}") from None
        ids = [as_int("each eos_token_id", t) for t in eos_token_id]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size}); it could never stop a sequence")
    return set(ids)


def check_streamer(streamer) -> None:
    if streamer is not None and not callable(streamer):
        raise TypeError(f"streamer must be a callable streamer(b, tokens) or None, got {streamer!r}")


def kv_rows(max_seq_len, longest: int, max_new_tokens: int, extra: int, context: int) -> int:
    """KV buffer rows per sequence: max_seq_len (None: what the request needs), checked against the
    request (prompt + new tokens + a step's tree rows `extra`) and the model's context + extra."""
    needed = longest + max_new_tokens
    if needed > context:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
            f"model's context of {context} positions; shorten the prompt or lower max_new_tokens"
        )
    needed += extra
    if max_seq_len is None:
        return needed
    S = as_int("max_seq_len", max_seq_len, low=1)
    if S < needed:
        tree_part = f" + tree nodes and depth ({extra})" if extra else ""
        raise ValueError(
            f"KV buffer too small: max_seq_len={S} rows, but the longest prompt ({longest} tokens) + "
            f"max_new_tokens ({max_new_tokens}){tree_part} needs {needed}; raise max_seq_len or lower max_new_tokens"
        )
    if S > context + extra:
        raise ValueError(
            f"max_seq_len={S} rows exceeds the model's context of {context} positions (+ {extra} rows for a "
            f"step's tree): no position past the context is ever used; pass at most {context + extra} or None"
        )
    return S


def cuda_graphs_arg(value):
    """cuda_graphs: None (CUDA graphs where they apply: a model on CUDA), True (asked for: a warning where they
    cannot apply) or False (never)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"cuda_graphs must be None, True or False, got {value!r}")
    return value
