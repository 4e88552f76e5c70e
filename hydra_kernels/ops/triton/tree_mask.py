"""The tree mask as the Triton tree_attention kernel reads it: bit-packed, made once per step.

Pure torch, no Triton import: ops/triton/__init__.py registers pack_kernel_mask as the kernel's mask form
at import (kernel modules load lazily, see there), and torch.compile traces it into the step's graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class PackedTreeMask(NamedTuple):
    """A tree mask in the form the kernel reads, made once per step (pack_kernel_mask) and passed to every
    layer's call, so no layer repacks it. bits: int32 [T, W] (one tree: read in place with batch stride
    0) or [B, T, W] (a tree per sequence); batch_stride: its batch stride in elements (0 when shared)."""

    bits: torch.Tensor
    batch_stride: int


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """bool [..., T, T] -> int32 [..., T, ceil(T/32)]: bit j % 32 of word j // 32 in row i is tree_mask[..., i, j]."""
    T = tree_mask.shape[-1]
    W = (T + 31) // 32
    padded = torch.zeros(*tree_mask.shape[:-1], W * 32, dtype=torch.int64, device=tree_mask.device)
    padded[..., :T] = tree_mask.to(torch.int64)
    words = (padded.view(*tree_mask.shape[:-1], W, 32) << torch.arange(32, device=tree_mask.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def pack_kernel_mask(tree_mask: torch.Tensor) -> PackedTreeMask:
    """bool [T, T] (or an expanded [B, T, T] view of one: packed once, never expanded) or [B, T, T] (a
    tree per sequence) -> the PackedTreeMask the kernel reads. (common.tree_buffer's rule, not imported:
    common.py defines Triton functions.)"""
    if tree_mask.dim() > 2 and tree_mask.stride(0) == 0:
        tree_mask = tree_mask[0]
    bits = pack_tree_mask(tree_mask).contiguous()
    return PackedTreeMask(bits, bits.stride(0) if bits.dim() > 2 else 0)
