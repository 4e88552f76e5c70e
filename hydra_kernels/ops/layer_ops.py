"""The base model's layer ops: the elementwise work of a decoding step between its GEMMs, fused (Triton).

Unfused, one Llama layer's step is ~38 launches (RMSNorm alone is eight: cast, square, mean, add, rsqrt,
multiply, cast, weight); with these three it is ~10: norm, QKV GEMM, rope_write_kv, attention, O GEMM,
residual add + norm, W1|W3 GEMM, silu_mul, W2 GEMM, residual add. A launch costs ~2 us even replayed from
a CUDA graph, which at batch 1 is what separated the graphed step from the weights' copy time (H200,
2026-11-27: 6.07 ms a step at Llama-3-8B shapes where the weights take ~4 ms; ~1200 launches).

The model picks them through its BackendPlan (Llama.step: plan["rms_norm"] for all three; "reference" is the
module path in model/layers.py, the same math) and resolves them once per step (AttentionSite.layer_kernels),
calling the implementations without the checks below: its shapes come from its own modules, and a step makes
~100 of these calls. Every row's result is computed alone (no reduction across rows), so a token's values do
not depend on what else is in the step (plain and speculative decoding agree).
"""
from __future__ import annotations

import torch

from . import reference
from .backend import register, resolve


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def rms_norm(x, weight, eps: float, *, add=None, backend: str = "auto"):
    """reference.rms_norm: y = weight * (h / sqrt(mean(h^2) + eps)) over the last dim, h = x (or x + add:
    returns (h, y)). x, add [..., H] of one dtype; weight [H] in x's dtype."""
    _check(weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.dtype == x.dtype,
           f"rms_norm: weight must be [H={x.shape[-1]}] in x's dtype {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    _check(add is None or (add.shape == x.shape and add.dtype == x.dtype),
           f"rms_norm: add must have x's shape {tuple(x.shape)} and dtype {x.dtype}")
    _check(weight.device == x.device and (add is None or add.device == x.device),
           "rms_norm: x, add and weight must be on one device")
    return resolve("rms_norm", backend, x.device)(x, weight, eps, add)


def rope_write_kv(qkv, cos, sin, kv, rows, n_heads: int, n_kv_heads: int, *, backend: str = "auto"):
    """reference.rope_write_kv: RoPE on a step's q and k heads, k and v written to the cache rows `rows`,
    roped q returned [B, T, n_heads, D]. qkv [B, T, n_heads + 2 n_kv_heads, D]; cos/sin [B, T, D] in qkv's
    dtype; kv [2, B, S, n_kv_heads, D]; rows int64 [B, T], each in [0, S) (values are checked by the caller's
    AttentionSite in an eager CPU call; on a GPU nothing reads them on the host: a row outside is not written)."""
    B, T, NH, D = qkv.shape
    _check(n_kv_heads > 0 and n_heads % n_kv_heads == 0,
           f"rope_write_kv: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    _check(len({t.device for t in (qkv, cos, sin, kv, rows)}) == 1, "rope_write_kv: all inputs must be on one device")
    _check(NH == n_heads + 2 * n_kv_heads and D % 2 == 0,
           f"rope_write_kv: qkv must be [B, T, {n_heads} + 2 * {n_kv_heads}, even D], got {tuple(qkv.shape)}")
    _check(cos.shape == (B, T, D) and sin.shape == (B, T, D) and cos.dtype == qkv.dtype == sin.dtype,
           f"rope_write_kv: cos/sin must be [B, T, D] = {(B, T, D)} in {qkv.dtype}")
    _check(kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[1] == B and tuple(kv.shape[3:]) == (n_kv_heads, D)
           and kv.dtype == qkv.dtype, f"rope_write_kv: kv must be [2, {B}, S, {n_kv_heads}, {D}] in {qkv.dtype}, "
                                      f"got {tuple(kv.shape)} {kv.dtype}")
    _check(rows.shape == (B, T) and rows.dtype == torch.int64, f"rope_write_kv: rows must be int64 [{B}, {T}]")
    return resolve("rope_write_kv", backend, qkv.device)(qkv, cos, sin, kv, rows, n_heads, n_kv_heads)


def silu_mul(gate_up, *, backend: str = "auto"):
    """reference.silu_mul: gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    _check(gate_up.shape[-1] % 2 == 0, f"silu_mul: the last dim must be 2I (gate | up), got {gate_up.shape[-1]}")
    return resolve("silu_mul", backend, gate_up.device)(gate_up)


register("rms_norm", "reference", reference.rms_norm)
register("rope_write_kv", "reference", reference.rope_write_kv)
register("silu_mul", "reference", reference.silu_mul)
