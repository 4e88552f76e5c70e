"""The Triton ops as torch.library custom ops (torch.ops.hydra_kernels_triton.<op>) with fake kernels, so
torch.compile traces a call to them as one opaque node (no graph break into the launcher's Python) and
CUDA graph capture records their launches.

Only traced code takes this route (the "triton" backend's functions check torch.compiler.is_compiling()):
an eager call goes straight to the launcher. Measured 2026-11-24, 2-core EPYC, torch 2.13 CPU (a
throwaway timeit script, min of 5 x 20k calls of a clone of 4 floats): direct 0.85 us, behind the
is_compiling() guard 0.95 us, through a custom op 6.3-6.5 us; a decoding step makes ~100 such calls.

Each op's eager body imports its kernel module on first use (ops/triton/__init__.py: Triton fixes
interpreter mode when a kernel is decorated). Schemas are inferred from the annotations; the contracts
are the public ops' (hydra_kernels/ops/__init__.py). tree_attention takes its mask bit-packed
(pack_kernel_mask: bits and batch stride), the form a step packs once for every layer.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from .tree_mask import PackedTreeMask, pack_kernel_mask

NS = "hydra_kernels_triton"


def _kernel(module: str):
    return importlib.import_module(f"{__package__}.{module}")


@torch.library.custom_op(f"{NS}::tree_attention", mutates_args=())
def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, mask_bits: Tensor,
                   mask_batch_stride: int, sm_scale: Optional[float] = None) -> Tensor:
    packed = PackedTreeMask(mask_bits, mask_batch_stride)
    return _kernel("tree_attention").tree_attention(q, k_cache, v_cache, cache_seqlens, packed, sm_scale)


@tree_attention.register_fake
def _(q, k_cache, v_cache, cache_seqlens, mask_bits, mask_batch_stride, sm_scale=None):
    return torch.empty_like(q)


@torch.library.custom_op(f"{NS}::commit_kv", mutates_args=("kv_cache",))
def commit_kv(kv_cache: Tensor, cache_seqlens: Tensor, accept_indices: Tensor, accept_lengths: Tensor) -> None:
    _kernel("commit_kv").commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths)


@commit_kv.register_fake
def _(kv_cache, cache_seqlens, accept_indices, accept_lengths):
    return None


def _verification_fake(B: int, D1: int, like: Tensor):
    """accept_lengths [B], accept_indices [B, D+1], next_root [B], last_node [B], all int64."""
    new = lambda *s: like.new_empty(s, dtype=torch.long)  # noqa: E731
    return new(B), new(B, D1), new(B), new(B)


@torch.library.custom_op(f"{NS}::greedy_verify", mutates_args=())
def greedy_verify(target_tokens: Tensor, tree_tokens: Tensor, paths: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_kernel("greedy_verify").greedy_verify(target_tokens, tree_tokens, paths))


@greedy_verify.register_fake
def _(target_tokens, tree_tokens, paths):
    return _verification_fake(tree_tokens.shape[0], paths.shape[-1], tree_tokens)


@torch.library.custom_op(f"{NS}::typical_accept", mutates_args=())
def typical_accept(lse: Tensor, entropy: Tensor, child_logits: Tensor, samples: Tensor, paths: Tensor,
                   posterior_threshold: float, posterior_alpha: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_kernel("typical_accept").typical_accept(lse, entropy, child_logits, samples, paths,
                                                          posterior_threshold, posterior_alpha))


@typical_accept.register_fake
def _(lse, entropy, child_logits, samples, paths, posterior_threshold, posterior_alpha):
    return _verification_fake(lse.shape[0], paths.shape[-1], lse)


@torch.library.custom_op(f"{NS}::lm_head_topk", mutates_args=())
def lm_head_topk(x: Tensor, weight: Tensor, k: int) -> tuple[Tensor, Tensor]:
    return tuple(_kernel("lm_head_topk").lm_head_topk(x, weight, k))


@lm_head_topk.register_fake
def _(x, weight, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.long)


@torch.library.custom_op(f"{NS}::lm_head_sample_stats", mutates_args=())
def lm_head_sample_stats(x: Tensor, weight: Tensor, temperature: float, seed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_kernel("lm_head_sample_stats").lm_head_sample_stats(x, weight, temperature, seed))


@lm_head_sample_stats.register_fake
def _(x, weight, temperature, seed):
    lead = x.shape[:-1]
    return x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.long)


@torch.library.custom_op(f"{NS}::hydra_first_layer", mutates_args=())
def hydra_first_layer(h: Tensor, path_tokens: Tensor, emb: Tensor, w_lin: Tensor, b_lin: Optional[Tensor],
                      w_res: Tensor, b_res: Optional[Tensor]) -> Tensor:
    return _kernel("hydra_first_layer").hydra_first_layer(h, path_tokens, emb, w_lin, b_lin, w_res, b_res)


@hydra_first_layer.register_fake
def _(h, path_tokens, emb, w_lin, b_lin, w_res, b_res):
    return h.new_empty(path_tokens.shape[0], path_tokens.shape[1], h.shape[1])


@torch.library.custom_op(f"{NS}::resblock", mutates_args=())
def resblock(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return _kernel("resblock").resblock(x, weight, bias)


@resblock.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::lm_head_residual_sample", mutates_args=())
def lm_head_residual_sample(x: Tensor, weight: Tensor, temperature: float, seed: Tensor,
                            exclude: Tensor) -> tuple[Tensor, Tensor]:
    return tuple(_kernel("lm_head_residual_sample").lm_head_residual_sample(x, weight, temperature, seed, exclude))


@lm_head_residual_sample.register_fake
def _(x, weight, temperature, seed, exclude):
    lead = x.shape[:-1]
    return x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.long)


@torch.library.custom_op(f"{NS}::rejection_accept", mutates_args=())
def rejection_accept(lse: Tensor, child_logits: Tensor, samples: Tensor, uniforms: Tensor, tree_tokens: Tensor,
                     parents: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_kernel("rejection_accept").rejection_accept(lse, child_logits, samples, uniforms, tree_tokens,
                                                              parents, depth))


@rejection_accept.register_fake
def _(lse, child_logits, samples, uniforms, tree_tokens, parents, depth):
    return _verification_fake(lse.shape[0], depth + 1, lse)


@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, add: Optional[Tensor]) -> list[Tensor]:
    out = _kernel("rms_norm").rms_norm(x, weight, eps, add)
    return list(out) if add is not None else [out]


@rms_norm.register_fake
def _(x, weight, eps, add):
    return [x.new_empty(x.shape) for _ in range(1 if add is None else 2)]  # contiguous, as the kernel's


@torch.library.custom_op(f"{NS}::rope_write_kv", mutates_args=("kv",))
def rope_write_kv(qkv: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, rows: Tensor, n_heads: int,
                  n_kv_heads: int) -> Tensor:
    return _kernel("rope_write_kv").rope_write_kv(qkv, cos, sin, kv, rows, n_heads, n_kv_heads)


@rope_write_kv.register_fake
def _(qkv, cos, sin, kv, rows, n_heads, n_kv_heads):
    return qkv.new_empty(*qkv.shape[:2], n_heads, qkv.shape[3])


@torch.library.custom_op(f"{NS}::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    return _kernel("silu_mul").silu_mul(gate_up)


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def traced_call(name: str, args: tuple, kwargs: dict):
    """The library op `name` called as the "triton" backend's function `name` is (same arguments); for
    tree_attention the mask goes in packed, as pack_kernel_mask makes it (in the traced graph when a bool
    mask is given)."""
    if name == "tree_attention":
        q, k_cache, v_cache, cache_seqlens, tree_mask, *rest = args
        sm_scale = rest[0] if rest else kwargs.get("sm_scale")
        packed = tree_mask if isinstance(tree_mask, PackedTreeMask) else pack_kernel_mask(tree_mask)
        return tree_attention(q, k_cache, v_cache, cache_seqlens, packed.bits, packed.batch_stride, sm_scale)
    if name == "rms_norm":  # the op returns a list (one schema for both forms): back to y or (h, y)
        out = rms_norm(*args, **kwargs)
        return out[0] if len(out) == 1 else tuple(out)
    return getattr(torch.ops.hydra_kernels_triton, name)(*args, **kwargs)
