"""Triton RoPE + KV-cache write of a decoding step (ops.rope_write_kv): the fused QKV projection's q heads
rotated into a new [B, T, Hq, D] tensor, its k heads rotated and its v heads copied into the cache rows of
the step's tokens, in one launch (torch: negate, concatenate, two multiplies, an add, a stack and an
index_put: ~7 launches a layer).

Grid: (B * T tokens, Hq + 2 Hkv heads); a program reads one head's two halves (HF rotate-half layout:
out[:D/2] = x1 cos1 - x2 sin1, out[D/2:] = x2 cos2 + x1 sin2). The rounding steps are torch's in the
input dtype: each product rounded, then the sum (fp contraction off), so the values equal the definition's
bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2, round_to


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, rows_ptr, T, NQ, NKV, S,
                          s_xb, s_xt, s_xh, s_cb, s_ct, s_qb, s_qt, s_qh, s_kp, s_kb, s_ks, s_kh,
                          HALF: tl.constexpr, BLOCK: tl.constexpr):
    bt = tl.program_id(0)
    head = tl.program_id(1)
    b = (bt // T).to(tl.int64)
    t = (bt % T).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    src = qkv_ptr + b * s_xb + t * s_xt + head * s_xh
    x1 = tl.load(src + offs, mask=m, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=m, other=0.0)
    dt = qkv_ptr.dtype.element_ty
    if head < NQ + NKV:  # q or k: rotated
        cs = cos_ptr + b * s_cb + t * s_ct
        sn = sin_ptr + b * s_cb + t * s_ct
        c1 = tl.load(cs + offs, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF + offs, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sn + offs, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sn + HALF + offs, mask=m, other=0.0).to(tl.float32)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        o1 = round_to(round_to(f1 * c1, dt).to(tl.float32) + round_to(-f2 * s1, dt).to(tl.float32), dt)
        o2 = round_to(round_to(f2 * c2, dt).to(tl.float32) + round_to(f1 * s2, dt).to(tl.float32), dt)
    else:  # v: copied
        o1 = x1
        o2 = x2
    if head < NQ:
        dst = q_ptr + b * s_qb + t * s_qt + head * s_qh
    else:
        plane = (head >= NQ + NKV).to(tl.int64)
        kvh = (head - NQ - plane * NKV).to(tl.int64)
        row = tl.load(rows_ptr + b * T + t)
        rr = row + offs * 0  # the row as a block, so the mask stays a block of int1
        m = m & (rr >= 0) & (rr < S)  # a row past the buffer is not written (never into the next sequence's)
        dst = kv_ptr + plane * s_kp + b * s_kb + row * s_ks + kvh * s_kh
    tl.store(dst + offs, o1, mask=m)
    tl.store(dst + HALF + offs, o2, mask=m)


def rope_write_kv(qkv, cos, sin, kv, rows, n_heads, n_kv_heads):
    """Same contract as reference.rope_write_kv (shapes checked by ops.rope_write_kv); kv's last dim must
    have unit stride (the model's static buffer does)."""
    B, T, NH, D = qkv.shape
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin, rows = cos.contiguous(), sin.contiguous(), rows.contiguous()
    if kv.stride(-1) != 1:
        raise ValueError("rope_write_kv (triton): kv's last dim must be contiguous (it is the model's static buffer)")
    q = torch.empty(B, T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
    if B * T:
        half = D // 2
        _rope_write_kv_kernel[(B * T, NH)](
            qkv, cos, sin, q, kv, rows, T, n_heads, n_kv_heads, kv.shape[2],
            qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0), cos.stride(1),
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            HALF=half, BLOCK=pow2(half), num_warps=1, enable_fp_fusion=False)
    return q
