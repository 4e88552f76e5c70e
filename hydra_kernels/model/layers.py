"""Llama building blocks: RMSNorm, SwiGLU MLP, and the decoder block (attention: model/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import reference
from ..ops.native import extension_op
from .attention import Attention, AttentionSite
from .config import LlamaConfig
from .packed_linear import Linear, bump_layout

# y = (x * r) * w, r = 1 / sqrt(sum(x^2) / H + eps) summed in a fixed order (csrc/decode_stack_cpu.cpp); None
# without the extension
RMS_NORM_ROWS = extension_op("rms_norm_rows")


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 (as transformers computes it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def __setattr__(self, name, value):
        if name in ("weight", "eps"):
            bump_layout()  # a run's memo of the layer stack's weights holds this norm's (decode_stack.stack_weights)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and x.is_cpu and self.weight.dtype is torch.float32:
            # one op instead of seven (~60 norms run in every decoding step, where each op's dispatch costs
            # microseconds): the native row norm, which the CPU decode stack runs too (their values then agree
            # bit for bit; it has a backward, so training sees the same values); ATen's without the extension
            if RMS_NORM_ROWS is not None:
                return RMS_NORM_ROWS(x, self.weight, self.eps)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return reference.rms_norm(x, self.weight, self.eps)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), with W1 and W3 fused into one GEMM."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split([self.inter, self.inter], dim=-1)  # [B, T, I] each
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm decoder layer: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: AttentionSite | None = None,
                kv: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H] residual stream -> [B, T, H]; cos/sin [B, T, D]; site and kv: see Attention.forward."""
        if (site is not None and site.kernel_tree_mask is not None and site.kernel_backend == "native"
                and kv is not None and x.is_cpu and x.dtype is torch.float32 and not torch.is_grad_enabled()):
            native = self._native_step(x, cos, sin, site, kv)  # a drafter's own blocks (Amphista, EAGLE)
            if native is not None:
                return native
        if site is not None and site.layer_kernels is not None:  # a step on the fused layer ops
            return self._fused_step(x, cos, sin, site, kv)
        h = x + self.attention(self.attention_norm(x), cos, sin, site, kv)
        return h + self.feed_forward(self.ffn_norm(h))

    def _fused_step(self, x, cos, sin, site: AttentionSite, kv) -> torch.Tensor:
        """This layer's step with the fused layer ops (ops/layer_ops.py, site.layer_kernels): the module path's
        math in ~10 launches instead of ~38 (norm, QKV GEMM, RoPE + cache write, attention, O GEMM, residual
        add + norm, W1|W3 GEMM, SiLU * up, W2 GEMM, residual add)."""
        a, f, k = self.attention, self.feed_forward, site.layer_kernels
        n1, n2 = self.attention_norm, self.ffn_norm
        B, T, _ = x.shape
        qkv = a.wqkv(k.rms_norm(x, n1.weight, n1.eps, None)).view(B, T, -1, a.head_dim)
        n = site.kv_len
        k_cache, v_cache = kv[0, :, :n], kv[1, :, :n]  # views: they see the write below
        site.prepare(qkv[:, :, :a.n_heads], k_cache, v_cache)  # before the write: bad seqlens must not write
        q = k.rope_write_kv(qkv, cos, sin, kv, site.rows, a.n_heads, a.n_kv_heads)
        o = site.kernel(q, k_cache, v_cache, site.seqlens, site.kernel_tree_mask)
        h, hn = k.rms_norm(x, n2.weight, n2.eps, a.wo(o.flatten(2)))
        return h + f.w2(k.silu_mul(f.w13(hn)))

    def _native_step(self, x, cos, sin, site: AttentionSite, kv) -> torch.Tensor | None:
        """This block's step as a one-layer native decode stack (csrc/decode_stack_cpu.cpp: the module path's
        values bit for bit), for blocks stepped one at a time outside Llama.step's stack (a drafter's
        adaptation or draft layers); None where it cannot run (see block_weights), after the step's first
        layer has checked the site (AttentionSite.prepare)."""
        spec = block_weights(self, x.shape[0] * x.shape[1]) if _DECODE_STACK is not None else None
        if spec is None or kv.dtype is not torch.float32 or not kv.is_contiguous():
            return None
        weights, kinds, biases, norms, eps = spec
        a = self.attention
        return _DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, self.feed_forward.inter,
                             cos, sin, kv.unsqueeze(0), site.rows, site.seqlens, site.kernel_tree_mask,
                             min(site.kv_len, kv.shape[2]), [])[0]


_DECODE_STACK = extension_op("decode_stack")


def block_linears(block: TransformerBlock) -> tuple:
    """The block's projections in the decode stack's order: wqkv, wo, w13, w2."""
    att, ff = block._modules["attention"]._modules, block._modules["feed_forward"]._modules
    return att["wqkv"], att["wo"], ff["w13"], ff["w2"]


def block_weights(block: TransformerBlock, rows: int):
    """(weights, kinds, biases, norms, eps) of one block for the native decode stack (wqkv, wo, w13, w2; the
    attention and FFN norms), or None where it cannot take it: a projection without panels for `rows` rows
    (F.linear), or norms that are not fp32 CPU RMSNorms of one eps. Runs for every layer of every CPU step, so
    it reads the modules' own dicts: through nn.Module.__getattr__ a step's walk over ~200 attributes took
    0.44 ms (2026-11-27, EPYC VM), 7% of a SmolLM2 step."""
    mods = block._modules
    n1, n2 = mods["attention_norm"], mods["ffn_norm"]
    if not (isinstance(n1, RMSNorm) and isinstance(n2, RMSNorm)) or n1.eps != n2.eps:
        return None
    norms = (n1._parameters["weight"], n2._parameters["weight"])
    if any(w.dtype is not torch.float32 or not w.is_cpu for w in norms):
        return None
    lins = block_linears(block)
    weights, kinds = [], []
    for lin in lins:
        spec = lin.step_weights(rows)
        if spec is None:
            return None
        weights.append(spec[0])
        kinds.append(spec[1])
    return weights, kinds, [lin._parameters["bias"] for lin in lins], norms, n1.eps
