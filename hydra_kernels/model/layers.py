"""Llama building blocks: RMSNorm, GQA attention projections with RoPE, SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .packed_linear import Linear
from .rope import apply_rope


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


class Attention(nn.Module):
    """Q, K and V in one fused projection (one GEMM instead of three: fewer launches per layer)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.wo = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def qkv(self, x, cos, sin):
        """x [B, T, H] -> roped q [B, T, Hq, D], roped k and v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(B, T, self.n_kv_heads, self.head_dim)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x W1) * x W3), with W1 and W3 fused into one GEMM."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.w13(x).split([self.inter, self.inter], dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)


def run_blocks(blocks, x, cos, sin, attend):
    """x [B, T, H] through each TransformerBlock; attend(i, q, k, v) -> [B, T, Hq, D] does block i's
    attention (and any KV-cache writes). Returns the residual stream (not normed)."""
    for i, block in enumerate(blocks):
        q, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)
        x = x + block.attention.wo(attend(i, q, k, v).flatten(2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return x
