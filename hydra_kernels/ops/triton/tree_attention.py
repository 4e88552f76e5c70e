"""Triton tree attention: split-KV flash decoding with GQA packing and a bit-packed tree mask.

Decode-shaped attention is memory-bound: every prefix K/V byte should leave DRAM once per step. So one
program owns one KV head of one sequence and packs all T tree queries x all G query heads of that
head's GQA group into the M dimension of its tiles (row m = t * G + g): one K/V tile load serves
T * G queries, and the QK^T / PV products are real matmuls (tensor cores) even for T = 1 when G >= 2.

B * Hkv programs cannot fill a GPU (SmolLM2 batch 1: 3), so the prefix is cut into splits, each
program producing a partial (normalised output, log-sum-exp); one extra split per (sequence, KV
head) handles the tree block, the only place the ancestor mask applies (as bits: tree_mask row t is
ceil(T/32) int32 words; sequence b's mask at bits + b * s_mb, s_mb = 0 when one tree serves the batch,
so a shared tree is packed once, never expanded; and once per step: the model's AttentionSite packs it
with pack_kernel_mask and every layer passes the packed form). A second kernel merges the splits with
log-sum-exp weights.

Grid of the first kernel: (M tiles, prefix splits + 1, B * Hkv). Softmax runs in base 2 (exp2) with
the scale folded into log2(e) * sm_scale.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import ieee_dots, num_sms, row_block
from .tree_mask import PackedTreeMask, pack_kernel_mask
from .tuning import cfg, launch

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One online-softmax update of rows q [BM, D] with keys k [BN, D], values v [BN, D]."""
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _tree_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, seqlens_ptr, bits_ptr, s_mb, po_ptr, plse_ptr,
        s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
        T, G, Hkv, W, M_PAD, D, split_size, n_prefix_splits, qk_scale,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // Hkv
    kvh = bh % Hkv
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // G  # tree node of row m
    g = offs_m % G  # query head within the GQA group
    m_ok = offs_m < T * G
    offs_d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two >= 16 (tl.dot's minimum)
    d_ok = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + t[:, None] * s_qt + (kvh * G + g)[:, None] * s_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    seqlen = tl.load(seqlens_ptr + b).to(tl.int32)
    k_base = k_ptr + b.to(tl.int64) * s_kb + kvh * s_kh
    v_base = v_ptr + b.to(tl.int64) * s_vb + kvh * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if split < n_prefix_splits:  # committed prefix rows [lo, hi): every query sees every row
        lo = split * split_size
        hi = tl.minimum(lo + split_size, seqlen)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * s_ks + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None].to(tl.int64) * s_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, n_ok[None, :], m_i, l_i, acc, qk_scale, IEEE)
    else:  # the tree block: rows seqlen + j, j < T, where bit j of tree_mask row t is set
        for start in range(0, T, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < T
            rows = (seqlen + offs_n).to(tl.int64)
            k = tl.load(k_base + rows[:, None] * s_ks + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + rows[:, None] * s_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            both = m_ok[:, None] & n_ok[None, :]
            word = tl.load(bits_ptr + b * s_mb + t[:, None] * W + offs_n[None, :] // 32, mask=both, other=0)
            allowed = both & (((word >> (offs_n[None, :] % 32)) & 1) != 0)
            m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # base 2
    row = (bh * (n_prefix_splits + 1) + split).to(tl.int64) * M_PAD + offs_m
    tl.store(po_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(plse_ptr + row, lse)


@triton.jit
def _tree_attention_merge_kernel(po_ptr, plse_ptr, o_ptr, s_ob, s_ot, s_oh, T, G, Hkv, M_PAD, D, n_splits,
                                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """out = sum_s 2^(lse_s - lse) o_s with lse = log2 sum_s 2^lse_s (splits with no rows add 0)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, n_splits):
        row = (bh * n_splits + s).to(tl.int64) * M_PAD + offs_m
        lse = tl.load(plse_ptr + row)
        o = tl.load(po_ptr + row[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.exp2(m - m_safe)
        a_s = tl.exp2(lse - m_safe)
        acc = acc * a_old[:, None] + o * a_s[:, None]
        l = l * a_old + a_s
        m = m_new
    t = offs_m // G
    g = offs_m % G
    ok = offs_m < T * G
    out = acc / tl.where(ok, l, 1.0)[:, None]  # l == 0 only for a row with no allowed key (NaN, as in the reference)
    ptr = o_ptr + b.to(tl.int64) * s_ob + t[:, None] * s_ot + (kvh * G + g)[:, None] * s_oh + offs_d[None, :]
    tl.store(ptr, out.to(o_ptr.dtype.element_ty), mask=ok[:, None] & (offs_d < D)[None, :])


_SPLIT_ALIGN = 64  # prefix splits are whole BLOCK_N tiles for every BLOCK_N of the configs below


def _block_m(M: int, dtype: torch.dtype) -> int:
    """Rows (tree nodes x GQA heads) per program. fp32 at most 32: its IEEE dots run on FMA units with a
    [BLOCK_M, head_dim] slice of q per thread; 64 rows spilled 10 KB of stack on sm_80 (head_dim 128)."""
    return min(row_block(M), 32) if dtype == torch.float32 else row_block(M)


def _configs(dtype: torch.dtype, BLOCK_D: int) -> list:
    """Launch configs of the split kernel (tuning.py), the hand-picked one first: the KV tile BLOCK_N,
    warps, stages (every BLOCK_N divides _SPLIT_ALIGN). fp32: 16-row KV tiles (32 spilled on sm_80 / sm_90
    beside a 32-row q tile and head_dim 128, at 4 warps and at 8: FMA dots), then 8 warps.
    16-bit: 64 rows, 32 from head_dim 128 (the [BLOCK_N, D] K and V tiles), then the other KV tile and a
    variant in warps / stages: the split kernel streams K and V, so the bytes in flight decide."""
    if dtype == torch.float32:
        return [cfg(BLOCK_N=16), cfg(BLOCK_N=16, num_warps=8)]
    if BLOCK_D <= 64:
        return [cfg(BLOCK_N=64), cfg(BLOCK_N=32), cfg(BLOCK_N=64, num_warps=8)]
    return [cfg(BLOCK_N=32), cfg(BLOCK_N=64, num_warps=8), cfg(BLOCK_N=32, num_stages=4)]


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=None, *, split_size: int | None = None,
                   block_m: int | None = None, config=None):
    """Same contract as reference.tree_attention (tree_mask [T, T] or [B, T, T]; any head_dim up to 256:
    tiles pad it to a power of two). tree_mask may also be pack_kernel_mask's result: a caller running
    every layer with one mask (AttentionSite) packs it once per step; a bool mask is packed here.
    split_size / block_m / config: tuning overrides (tests use them to force several splits, or a config)."""
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    if D > 256:
        raise ValueError(f"tree_attention (triton) supports head_dim <= 256, got {D}; use backend='reference'")
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    scale = D**-0.5 if sm_scale is None else sm_scale
    M = T * G
    BLOCK_M = block_m or _block_m(M, q.dtype)
    m_tiles = triton.cdiv(M, BLOCK_M)
    M_PAD = m_tiles * BLOCK_M
    if split_size is None:
        # enough programs for ~2 waves over the SMs, but no split shorter than 256 rows (each split
        # pays a partial write + merge read of M_PAD x D floats)
        want = max(1, math.ceil(2 * num_sms(q.device) / (B * Hkv * m_tiles)))
        n_splits = max(1, min(want, triton.cdiv(S, 256)))
        split_size = triton.cdiv(triton.cdiv(S, n_splits), _SPLIT_ALIGN) * _SPLIT_ALIGN
    n_prefix = max(1, triton.cdiv(S, split_size))
    n_total = n_prefix + 1
    dev = q.device
    packed = tree_mask if isinstance(tree_mask, PackedTreeMask) else pack_kernel_mask(tree_mask)
    bits, s_mb = packed  # int32 [T, W] or [B, T, W], its batch stride
    po = torch.empty(B * Hkv * n_total * M_PAD, BLOCK_D, dtype=torch.float32, device=dev)
    plse = torch.empty(B * Hkv * n_total * M_PAD, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    launch(_tree_attention_split_kernel, (m_tiles, n_total, B * Hkv),
           (q, k_cache, v_cache, cache_seqlens, bits, s_mb, po, plse,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            T, G, Hkv, bits.shape[-1], M_PAD, D, split_size, n_prefix, scale * _LOG2E),
           dict(BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, IEEE=ieee_dots(q.dtype)), _configs(q.dtype, BLOCK_D),
           key=["T", "G", "Hkv", "D", "split_size"], config=config)
    _tree_attention_merge_kernel[(m_tiles, B * Hkv)](
        po, plse, out, out.stride(0), out.stride(1), out.stride(2), T, G, Hkv, M_PAD, D, n_total,
        BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M)
    return out
