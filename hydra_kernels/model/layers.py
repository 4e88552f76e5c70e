"""Llama building blocks: RMSNorm, SwiGLU MLP, and the decoder block (attention: model/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, AttentionSite
from .config import LlamaConfig
from .packed_linear import Linear


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 (as transformers computes it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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
        h = x + self.attention(self.attention_norm(x), cos, sin, site, kv)
        return h + self.feed_forward(self.ffn_norm(h))
