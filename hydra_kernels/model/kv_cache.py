"""Static KV buffer: one allocation per model and batch, written by index, never reallocated."""
from __future__ import annotations

import torch

from .config import LlamaConfig

# The smallest KV bucket (rows): contexts below it share one bucket. Attention reads rows [0, kv_len) masked by
# seqlens, so a bucket changes no value on the CPU (the native kernel reads each sequence's own rows); on a
# GPU, Triton's split-KV partition and its tuned launch config are chosen from kv_len (ops/triton/
# tree_attention.py), so steps that read the same bucket split and round alike.
KV_MIN = 256


def kv_bucket(rows: int, max_rows: int) -> int:
    """Rows of the KV buffer a step reads (attention's kv_len) when its sequences need at most `rows`:
    the next power of two >= rows, at least KV_MIN, at most the buffer's max_rows."""
    return min(max_rows, max(KV_MIN, 1 << max(rows - 1, 0).bit_length()))


def attention_rows(kv_len: int | None, max_rows: int, device: torch.device) -> int:
    """The rows [0, n) a decoding step's attention reads, for a host bound kv_len on seqlens + T (None: the
    whole buffer). On CUDA the bucket (kv_bucket), on every path, eager or replayed: the decode runner's
    graphs must read a bucket (no per-step host int in a graph), and an eager step that read its exact
    bound would split attention's rows differently and could take another tuned launch config, so a
    replay would differ from the eager step in the last bits (seen on an H200, 2026-11-27: Llama-3-8B
    shapes, bf16). The Triton kernel stops at each sequence's own seqlen, so the bucket costs it no extra
    rows; the reference backend on CUDA reads the masked rows up to the bucket (at most 2x). Elsewhere the
    bound itself (the CPU's speed is unchanged). Never more than the buffer's max_rows."""
    n = max_rows if kv_len is None else kv_len
    return kv_bucket(n, max_rows) if device.type == "cuda" else n


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
        # what a run's steps memoize about the model they step (decode_stack.stack_weights): a cache serves one run
        self.stack_memo: dict = {}

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
