"""Public ops. Each checks its inputs, then dispatches to a backend (see ops/backend.py)."""
from __future__ import annotations

import torch

from . import reference
from .backend import BACKENDS, native_available, register, resolve, triton_available

__all__ = ["tree_attention", "BACKENDS", "native_available", "triton_available", "reference"]

register("tree_attention", "reference", reference.tree_attention)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, *, sm_scale=None, backend="auto"):
    """Attention of T packed tree tokens over a committed prefix plus their tree ancestors.

    Parameters
    ----------
    q : [B, T, Hq, D] queries of the tree nodes (node 0 is the root; T == 1 is plain decode).
    k_cache, v_cache : [B, S_max, Hkv, D] with the tree's K/V already written at rows
        [cache_seqlens[b], cache_seqlens[b] + T). Hq % Hkv == 0 (GQA).
    cache_seqlens : int32/int64 [B], committed prefix length of each sequence.
    tree_mask : bool [T, T], tree_mask[i, j] when node j is an ancestor of node i or i itself.
    sm_scale : softmax scale, default D ** -0.5.

    Returns
    -------
    [B, T, Hq, D] in q's dtype: node i attends to keys [0, seqlens[b]) and to tree keys j with
    tree_mask[i, j].
    """
    _check(q.dim() == 4, f"q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    _check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
           f"k_cache and v_cache must both be [B, S_max, Hkv, D], got {tuple(k_cache.shape)} and "
           f"{tuple(v_cache.shape)}")
    _check(k_cache.shape[0] == B and k_cache.shape[3] == D,
           f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    _check(Hq % k_cache.shape[2] == 0, f"Hq={Hq} is not a multiple of Hkv={k_cache.shape[2]}")
    _check(T <= k_cache.shape[1], f"T={T} tree tokens do not fit a cache of {k_cache.shape[1]} rows")
    _check(q.dtype == k_cache.dtype == v_cache.dtype,
           f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _check(tuple(tree_mask.shape) == (T, T) and tree_mask.dtype == torch.bool,
           f"tree_mask must be bool [T, T] = [{T}, {T}], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    _check(tuple(cache_seqlens.shape) == (B,) and cache_seqlens.dtype in (torch.int32, torch.int64),
           f"cache_seqlens must be int32/int64 [B] = [{B}], got {cache_seqlens.dtype} "
           f"{tuple(cache_seqlens.shape)}")
    devs = {t.device for t in (q, k_cache, v_cache, cache_seqlens, tree_mask)}
    _check(len(devs) == 1, f"all inputs must be on one device, got {sorted(map(str, devs))}")
    fn = resolve("tree_attention", backend, q.device)
    return fn(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=sm_scale)
