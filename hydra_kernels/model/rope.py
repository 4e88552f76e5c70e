"""Rotary position embeddings (plain, linear and llama3 frequency scaling), HF rotate-half layout."""
from __future__ import annotations

import math

import torch

from ..ops.reference import apply_rope  # noqa: F401  (x*cos + rotate_half(x)*sin: defined there, used here)
from .config import LlamaConfig


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/D), i < D/2, fp32, with the config's frequency scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(inv_freq: torch.Tensor, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_positions, D] fp32, angle(p, i) = p * inv_freq[i mod D/2] (halves repeated, as HF)."""
    t = torch.arange(n_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RopeCache:
    """fp32 cos/sin table grown on demand, on the device of the positions asked for."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor, n_positions: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, D] in `dtype` for integer positions [B, T], all < n_positions."""
        cos, sin = self.table(n_positions, positions.device)
        return cos[positions].to(dtype), sin[positions].to(dtype)

    def table(self, n_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 tables cos, sin [n, D] on `device` with n >= n_positions rows (grown by doubling)."""
        table = self._table
        if table is None or table[0].shape[0] < n_positions or table[0].device != device:
            inv_freq = rope_inv_freq(self.cfg).to(device)
            size = max(n_positions, 256 if table is None else 2 * table[0].shape[0])
            table = self._table = rope_table(inv_freq, size)
        return table
