"""Pure-PyTorch definitions of every op. Kernels are tested against these; they favour clarity.

Attention math is done in fp32 whatever the input dtype; outputs come back in the input dtype.
"""
from __future__ import annotations

import torch


def tree_key_mask(cache_seqlens: torch.Tensor, tree_mask: torch.Tensor, s_max: int) -> torch.Tensor:
    """allowed[b, i, j]: may tree node i of sequence b attend to cache row j?  -> bool [B, T, S_max].

    Row j is the committed prefix when j < seqlens[b]; it is tree node j - seqlens[b] when that lies in
    [0, T), allowed when tree_mask[i, j - seqlens[b]] (ancestor-or-self); every other row is masked.
    """
    T = tree_mask.shape[0]
    pos = torch.arange(s_max, device=cache_seqlens.device)
    start = cache_seqlens.long()[:, None]  # [B, 1]
    rel = pos[None, :] - start  # [B, S]: index into the tree, valid where 0 <= rel < T
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < T)
    node = torch.arange(T, device=tree_mask.device)
    tree_allowed = tree_mask[node[None, :, None], rel.clamp(0, T - 1)[:, None, :]]  # [B, T, S]
    return in_prefix[:, None, :] | (in_tree[:, None, :] & tree_allowed)


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=None):
    """out[b, i, h] = softmax_j(scale * q[b,i,h] . k[b,j,h//G]) v[b,j,h//G] over allowed rows j.

    q [B, T, Hq, D]; k_cache, v_cache [B, S_max, Hkv, D]; cache_seqlens int [B]; tree_mask bool [T, T].
    GQA: query head h reads KV head h // (Hq // Hkv). Returns [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    qf = q.float().reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kf = k_cache.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, S, D]
    vf = v_cache.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hkv, G, T, S]
    allowed = tree_key_mask(cache_seqlens, tree_mask, S)[:, None, None]  # [B, 1, 1, T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [B, Hkv, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)
