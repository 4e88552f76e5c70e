"""Grouped-query attention with RoPE, and the three ways a forward runs it:

(a) no cache (``site=None``): causal attention over the T tokens alone (full forward, training);
(b) prefill (``site=PREFILL``, or ``prefill_site(start)`` for a later chunk of a chunked prefill): the T
    tokens' keys/values become rows [start, start + T) of the static buffer, attention causal over rows
    [0, start + T) (flash-attn on CUDA when installed, else torch SDPA);
(c) step (``site=AttentionSite(rows, ...)``): the T tokens' keys/values go to rows [seqlens[b],
    seqlens[b] + T) and each token attends to the committed prefix plus the tokens its tree mask allows,
    through ``ops.tree_attention``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.backend import kernel_mask, resolve, resolved_name
from .config import LlamaConfig
from .packed_linear import Linear
from .rope import apply_rope

try:  # optional: flash-attn's causal kernel for prefill on CUDA (torch SDPA otherwise)
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D], causal, GQA by head groups."""
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_func(q, k, v, causal=True)  # takes [B, L, H, D] and GQA natively
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


# torch's CPU flash attention with its log-sum-exp (private; absent in some builds: then the masked path)
_cpu_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def suffix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A later prefill chunk: q [B, T, Hq, D] at positions [P, P + T), k/v [B, P + T, Hkv, D] (rows [0, P)
    written by the chunks before) -> [B, T, Hq, D]; query i sees keys [0, P + i] (causal, bottom-right)."""
    B, T, Hq, D = q.shape
    P, Hkv = k.shape[1] - T, k.shape[2]
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_func(q, k, v, causal=True)  # causal is bottom-right when the keys outnumber queries
    if q.device.type != "cpu" or _cpu_flash_with_lse is None:  # SDPA's is_causal is top-left: a mask
        mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(P)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=Hq != Hkv).transpose(1, 2)
    # Two exact parts merged by their log-sum-exps: the prefix (no mask) and the chunk itself (causal).
    # A [T, P + T] mask instead makes flash attention compute the masked-out half of the diagonal block
    # (measured 1.1-1.3x slower at T = 2000, P = 6000); the prefix part also reads each K/V row once per
    # GQA group, the group's query heads folded into its rows: [B, Hkv, G * T, D].
    G = Hq // Hkv
    qf = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    o1, l1 = _cpu_flash_with_lse(qf, k[:, :P].transpose(1, 2), v[:, :P].transpose(1, 2))
    o1, l1 = o1.reshape(B, Hq, T, D), l1.reshape(B, Hq, T)  # back to heads: head h = kv head h // G
    kd = k[:, P:].transpose(1, 2).repeat_interleave(G, 1)  # [B, Hq, T, D]: T rows only, cheap
    vd = v[:, P:].transpose(1, 2).repeat_interleave(G, 1)
    o2, l2 = _cpu_flash_with_lse(q.transpose(1, 2), kd, vd, is_causal=True)
    # softmax over both parts: o = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2), shifted by max(l1, l2)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp()[..., None], (l2 - m).exp()[..., None]
    o = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return o.to(q.dtype).transpose(1, 2)


class LayerKernels(NamedTuple):
    """The layer ops' implementations of one backend (ops/layer_ops.py), called without the public ops'
    checks: a step's shapes come from the model's own modules."""

    rms_norm: Callable
    rope_write_kv: Callable
    silu_mul: Callable


@dataclass
class AttentionSite:
    """Where one forward's new keys/values go in the static KV buffer and what its queries see.

    One per forward, shared by every layer (each layer brings its own buffer view, see KVCache.layers),
    so a decoding step allocates nothing per layer for it.

    rows: None for prefill (rows [prefill_start, prefill_start + T) of every sequence, attention causal
        over rows [0, prefill_start + T)); else int64 [B, T], the buffer rows of sequence b's new tokens
        (seqlens[b] + i).
    prefill_start: prefill only: the chunk's first row (0: the whole prompt, or a chunked prefill's first chunk).
    seqlens: int [B], committed rows before the step (step only).
    tree_mask: bool [T, T] (one tree for the batch) or [B, T, T] (a tree per sequence), ancestor-or-self.
    kv_len: attention reads buffer rows [0, kv_len) only (a host-known bound on seqlens + T).
    backend: ops.tree_attention's backend (a BackendPlan entry: chosen once by the caller).
    layer_backend: the layer ops' backend (ops.rms_norm / rope_write_kv / silu_mul, Llama._layer_ops_backend):
        "reference" runs a step's layers through the modules (TransformerBlock.forward), another one through
        the fused ops (TransformerBlock._fused_step, with layer_kernels). Steps only; prefill runs the modules.
    """

    rows: torch.Tensor | None = None
    seqlens: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    kv_len: int = 0
    backend: str = "auto"
    prefill_start: int = 0
    layer_backend: str = "reference"
    batch_index: torch.Tensor | None = field(init=False, repr=False)  # [B, 1], pairs with rows in index_put
    # ops.tree_attention's concrete backend and kernel, resolved once per step
    kernel_backend: str = field(init=False, repr=False, default="")
    kernel: object = field(init=False, repr=False, default=None)
    # tree_mask in the form the kernel reads (Triton: bit-packed), made at the first layer for every layer
    kernel_tree_mask: object = field(init=False, repr=False, default=None)
    # the layer ops' kernels (rms_norm, rope_write_kv, silu_mul), resolved once per step, not at each of a
    # step's ~100 calls (a resolve costs ~7 us of host time); None on the module path
    layer_kernels: LayerKernels | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        rows = self.rows
        self.batch_index = None if rows is None else torch.arange(rows.shape[0], device=rows.device)[:, None]
        if rows is not None:
            self.kernel_backend = resolved_name("tree_attention", self.backend, rows.device)
            self.kernel = resolve("tree_attention", self.kernel_backend, rows.device)
            if self.layer_backend != "reference":
                self.layer_kernels = LayerKernels(*(resolve(op, self.layer_backend, rows.device)
                                                    for op in LayerKernels._fields))

    def prepare(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """At the first layer of a step: the op's preconditions, then the mask in the kernel's form. Once
        per step, not per layer: every layer reads the same seqlens and mask with the same shapes (30
        checks a step would be 29 too many), and packing the mask per layer (Triton) would repeat it too."""
        if self.kernel_tree_mask is None:
            ops.check_tree_attention(q, k_cache, v_cache, self.seqlens, self.tree_mask)
            self.kernel_tree_mask = kernel_mask("tree_attention", self.kernel_backend, self.tree_mask)


PREFILL = AttentionSite()  # rows [0, T) of an empty buffer, causal attention among the new tokens


def prefill_site(start: int) -> AttentionSite:
    """The site of a prefill chunk whose first row is `start` (rows before it already written)."""
    return PREFILL if start == 0 else AttentionSite(prefill_start=start)


class Attention(nn.Module):
    """Q, K and V in one fused projection (one GEMM instead of three: fewer launches per layer)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.wo = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> roped q [B, T, Hq, D], roped k and v [B, T, Hkv, D]; cos/sin [B, T, D]."""
        B, T, _ = x.shape
        heads = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        # q and k heads are adjacent in the fused output: one rotation for both (the same values as two: the
        # rotation is per element), half the small ops of a decoding step's RoPE
        qk = apply_rope(heads[:, :, :self.n_heads + self.n_kv_heads], cos, sin)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=2)
        return q, k, heads[:, :, self.n_heads + self.n_kv_heads:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: AttentionSite | None = None,
                kv: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H] (normed) -> attention output [B, T, H]. site: see AttentionSite (None: no cache);
        kv: this layer's buffer [2, B, S_max, Hkv, D] (index 0: K, 1: V), written in place."""
        q, k, v = self.qkv(x, cos, sin)  # q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]
        if site is None:  # (a) no cache
            o = causal_attention(q, k, v)
        elif site.rows is None:  # (b) prefill: rows [s, s + T) after the chunks before it (rows [0, s))
            s, T = site.prefill_start, q.shape[1]
            kv[0, :, s:s + T] = k
            kv[1, :, s:s + T] = v
            o = causal_attention(q, k, v) if s == 0 else suffix_causal_attention(q, kv[0, :, :s + T], kv[1, :, :s + T])
        else:  # (c) step: write rows seqlens[b] + i, attend to the prefix and the allowed new rows
            n = site.kv_len
            k_cache, v_cache = kv[0, :, :n], kv[1, :, :n]  # views: they see the write below
            site.prepare(q, k_cache, v_cache)  # before the write: bad seqlens must not write (or index) past rows
            kv[:, site.batch_index, site.rows] = torch.stack((k, v))  # both halves in one index_put
            o = site.kernel(q, k_cache, v_cache, site.seqlens, site.kernel_tree_mask)
        return self.wo(o.flatten(2))  # o: [B, T, Hq, D]
