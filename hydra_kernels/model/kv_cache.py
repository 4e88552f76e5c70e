"""Static KV buffer: one allocation per model and batch, written by index, never reallocated."""
from __future__ import annotations

import torch

from .config import LlamaConfig


class KVCache:
    """kv: [n_layers, 2, B, S_max, Hkv, D] (index 1: 0 = K, 1 = V); seqlens: int32 [B] on the device.

    Rows [0, seqlens[b]) of sequence b are committed. A step writes its T tokens at
    [seqlens[b], seqlens[b] + T); committing (plain decode: `advance`) makes them part of the prefix.
    layers: the per-layer views kv[i] [2, B, S_max, Hkv, D], made once here rather than by every layer
    of every step (a decoding step is bound by Python overhead on the CPU).
    """

    def __init__(self, cfg: LlamaConfig, batch_size: int, max_seq_len: int, *, dtype, device):
        self.kv = torch.zeros(
            cfg.num_layers, 2, batch_size, max_seq_len, cfg.num_kv_heads, cfg.head_dim,
            dtype=dtype, device=device,
        )
        self.layers: tuple[torch.Tensor, ...] = self.kv.unbind(0)
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self.kv.shape[3]

    def advance(self, n: int | torch.Tensor = 1) -> None:
        """Commit the next n rows of every sequence (n an int or an int tensor [B])."""
        self.seqlens += n

    def reset(self) -> None:
        self.seqlens.zero_()
