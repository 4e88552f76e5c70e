"""What the Triton kernels share: the fp32-exact dot switch, the block-size choices, how a tree buffer
(shared by the batch or one per sequence) reaches a kernel, and two tile helpers (the LM head's logits
tile, the leaf-path tile of the verifiers).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """The kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1: the CPU test tier)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def ieee_dots(dtype: torch.dtype) -> bool:
    """Upcast tiles to fp32 and run tl.dot with IEEE products? fp32 inputs: yes (no TF32, so results match
    the fp32 reference). bf16 under the interpreter: yes (Triton 3.9's interpreter computes bf16 tl.dot
    wrongly). Otherwise (fp16 anywhere, bf16 on a GPU) the tensor-core dot of the input dtype."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: how many programs fill the GPU (the split choices of
    tree_attention and the head kernels). Off a GPU (interpreter) 4; benchmarks/triton_aot.py patches in
    the target's count."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def row_block(n: int) -> int:
    """Rows per program for n rows (decode-sized: nodes x sequences): 16, 32 or 64; tl.dot needs >= 16 and
    a small n should not pay for a 64-row tile."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


def k_splits(K: int, programs: int, device: torch.device, splits: int | None = None) -> tuple[int, int]:
    """Split-K of a weight-bound kernel -> (splits, K columns per split; (1, K) unsplit). A grid of
    `programs` smaller than the GPU's SM count leaves SMs idle while the weight streams (SmolLM2's H = 576
    head blocks at decode size: 9 programs on 132 SMs; Llama-3-8B: 64), so the reduction over K is cut
    into up to ceil(SMs / programs) slices -- about one wave of programs, each reading one slice of the
    weight; the launcher adds the fp32 partial sums in a fixed order in a second pass (deterministic: no
    atomics). Slices are whole 64-column steps (every config's K step divides them, and a slice is never
    shorter than one step); `splits` forces a count (tests), in slices of 16 (fewer when K is short)."""
    if splits is None:
        sms = num_sms(device)
        splits, align = (1 if programs >= sms else min(triton.cdiv(sms, programs), triton.cdiv(K, 64))), 64
    else:
        align = 16
    if splits <= 1:
        return 1, K
    per = triton.cdiv(triton.cdiv(K, splits), align) * align
    return triton.cdiv(K, per), per


def k_step(dtype: torch.dtype) -> int:
    """Reduction step (BLOCK_K / BLOCK_H) of the GEMM-shaped kernels' hand-picked config. 16-bit: 64 (tensor
    cores). fp32: 16 -- its IEEE dots run on FMA units, for which Triton keeps a [rows, step] and a
    [cols, step] slice per thread in registers: a step of 64 spilled up to 6 KB of stack on sm_80 (the
    head kernels, the LM-head tiles), 16 leaves them at <= ~200 registers and no stack (triton_aot.csv)."""
    return 16 if dtype == torch.float32 else 64


def vocab_block(V: int) -> int:
    """Vocabulary tile of the LM-head kernels for a vocabulary of V. GPU: 128 (many programs stream the
    weight); the interpreter pays per program, so it gets few wide tiles, no wider than V needs (same
    math, ~8x faster tests)."""
    return min(4096, max(16, pow2(V))) if interpreted() else 128


def pow2(n: int) -> int:
    """The smallest power of two >= n (tile sizes covering a whole dimension, e.g. leaf paths or depth)."""
    return triton.next_power_of_2(n)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] -> [N, H] rows with unit stride along H (a view when x allows; kernels take the row stride)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def tree_buffer(x: torch.Tensor, inner_dims: int) -> tuple[torch.Tensor, int]:
    """A tree buffer with `inner_dims` dims shared by the batch (given as is, or as an expanded [B, ...] view)
    or one per sequence ([B, ...]) -> (x with contiguous inner dims, its batch stride in elements: 0 when
    shared). The shared form is read in place: no per-step copy or expansion."""
    if x.dim() > inner_dims and x.stride(0) == 0:
        x = x[0]
    x = x.contiguous()
    return x, (x.stride(0) if x.dim() > inner_dims else 0)


@triton.jit
def rows_dot_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, K, s_xn, s_wv, s_wh, BLOCK_N: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    """x[offs_n, :K] @ W[offs_v, :K]^T in BLOCK_H steps -> fp32 [BLOCK_N, BLOCK_V] (rows past N, columns past
    V: 0). x: unit stride along k. A K slice: pointers moved to its start, K its length."""
    n_ok = offs_n < N
    v_ok = offs_v < V
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for h0 in range(0, K, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < K
        x = tl.load(x_ptr + offs_n[:, None].to(tl.int64) * s_xn + offs_h[None, :], mask=n_ok[:, None] & h_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * s_wv + offs_h[None, :] * s_wh,
                    mask=v_ok[:, None] & h_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def logits_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    """x[offs_n] @ W[offs_v]^T over H in BLOCK_H steps -> fp32 [BLOCK_N, BLOCK_V]; columns past V are -inf."""
    acc = rows_dot_tile(x_ptr, w_ptr, offs_n, offs_v, N, V, H, s_xn, s_wv, s_wh, BLOCK_N, BLOCK_V, BLOCK_H, IEEE)
    return tl.where((offs_v < V)[None, :], acc, float("-inf"))


@triton.jit
def path_tile(paths_ptr, P, D1, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [paths, depth] tile of one tree's leaf paths [P, D1] (node ids, -1 padding) and each element's
    parent (the previous one). paths_ptr: that tree's first row (per sequence: base + b * batch stride)."""
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    in_p = p < P
    in_d = d < D1
    node = tl.load(paths_ptr + p[:, None] * D1 + d[None, :], mask=in_p[:, None] & in_d[None, :], other=-1)
    parent = tl.load(paths_ptr + p[:, None] * D1 + d[None, :] - 1,
                     mask=in_p[:, None] & in_d[None, :] & (d[None, :] >= 1), other=0)
    return p, d, in_p, in_d, node, parent


@triton.jit
def round_to(x, dt: tl.constexpr):
    """fp32 x in dtype dt, rounded to nearest even as torch rounds. bf16 by integer arithmetic on the bits
    (add 0x7FFF plus the kept part's lowest bit, drop 16 bits; +-inf stay inf, NaN is kept apart: the carry
    would turn it into +-0 or inf): what a GPU's cvt.rn does, and what Triton's interpreter does not (its
    fp32 -> bf16 cast truncates), so the CPU tier tests the GPU's values bit for bit."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(dt)
