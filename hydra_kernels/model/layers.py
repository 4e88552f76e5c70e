"""Llama building blocks: RMSNorm, SwiGLU MLP, and the decoder block (attention: model/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import reference
from ..ops.native import extension_op
from .attention import Attention, AttentionSite
from .config import LlamaConfig
from .packed_linear import Linear

# y = (x * r) * w, r = 1 / sqrt(sum(x^2) / H + eps) summed in a fixed order (csrc/decode_stack_cpu.cpp); None
# without the extension
RMS_NORM_ROWS = extension_op("rms_norm_rows")


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 (as transformers computes it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and x.is_cpu and self.weight.dtype is torch.float32:
            # one op instead of seven (~60 norms run in every decoding step, where each op's dispatch costs
            # microseconds): the native row norm, which the CPU decode stack runs too (their values then agree
            # bit for bit), wherever no autograd graph is needed; else ATen's
            if RMS_NORM_ROWS is not None and not (torch.is_grad_enabled()
                                                  and (x.requires_grad or self.weight.requires_grad)):
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
