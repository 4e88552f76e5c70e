"""A CPU decoding step's whole layer stack in one native call (csrc/decode_stack_cpu.cpp).

Where it runs: Llama.step on fp32 CPU models whose every projection has packed or quantized panels (the CPU
default after hk.load_model), with the native tree_attention and no autograd. There a step is one call into C++
that loops over the layers: no Python between the layers, no ATen dispatch for the elementwise work.

Why: at SmolLM2-135M a step's kernels take ~5 ms, and the host work around them was about as large again
(2026-11-27, EPYC VM: a plain step 9.8 ms, of which 2.4 ms was the Python picking each layer's arguments and
~2.4 ms small ATen ops inside the per-layer native calls it replaced). Per step this module only collects the
layers' weights (a list walk) and checks the step's attention inputs once.

Exactness: the stack computes the module path's math in its rounding order, with the same row norm
(rms_norm_rows, which RMSNorm.forward runs on the CPU too: layers.RMS_NORM_ROWS) and ATen's SiLU, so hidden states, logits and the KV
cache equal the Python layers' bit for bit (tests/test_decode_stack.py); each row depends only on itself.
"""
from __future__ import annotations

import torch

from ..ops.native import extension_op
from .layers import block_linears, block_weights
from .packed_linear import layout_version


DECODE_STACK = extension_op("decode_stack")


def stack_weights(model, rows: int, memo: dict | None = None):
    """(weights, kinds, biases, norms, eps) of model's layers for decode_stack (layers.block_weights of each, in
    order), or None where a layer cannot take it or the layers' norms differ in eps.

    memo (KVCache.stack_memo: one run's): the result kept for the run's later steps, while the model's blocks are
    the same objects, no Linear or norm was assigned new weights (packed_linear.layout_version) and every projection
    holds its panels as its weight (Linear.holds_panels: nothing is rebuilt from a weight changed in place). Collecting
    it walks ~1,800 module attributes, which a step's weight stream has just evicted from the caches: ~0.5 ms a step
    inside generate() where it took 0.1 ms in a loop of its own (2026-11-28, EPYC VM, SmolLM2)."""
    if torch.compiler.is_compiling():  # a traced step walks once, at trace time; a memo would only add guards
        memo = None
    blocks = tuple(model.layers._modules.values())
    version = layout_version()
    if memo is not None:  # (panels held: the same weights for any row count)
        hit = memo.get("stack")
        if hit is not None and hit[0] == version and len(hit[1]) == len(blocks) and all(
                a is b for a, b in zip(hit[1], blocks)):
            return hit[2]
    weights, kinds, biases, norms, eps = [], [], [], [], None
    for block in blocks:
        spec = block_weights(block, rows)
        if spec is None or (eps is not None and spec[4] != eps):
            return None
        weights += spec[0]
        kinds += spec[1]
        biases += spec[2]
        norms += spec[3]
        eps = spec[4]
    out = weights, kinds, biases, norms, eps
    if memo is not None and all(lin.holds_panels for block in blocks for lin in block_linears(block)):
        memo["stack"] = (version, blocks, out)
    return out


def run_stack(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site, cache, capture):
    """Llama.step's layers in one native call: (the last layer's output [B, T, H], the captured layers' inputs
    [B, T, len(capture) * H] or None), or None where the stack does not apply (the caller runs the layers)."""
    if (DECODE_STACK is None or site.kernel_backend != "native" or not x.is_cpu or x.dtype is not torch.float32
            or torch.is_grad_enabled() or cache.kv.dtype is not torch.float32):
        return None
    B, T, _ = x.shape
    spec = stack_weights(model, B * T, getattr(cache, "stack_memo", None))
    if spec is None:
        return None
    weights, kinds, biases, norms, eps = spec
    a, f = model.layers[0].attention, model.layers[0].feed_forward
    # the step's attention inputs checked once, with their messages, before anything is written (the kernel
    # checks them again in C++; a query of the right shape stands in for the projections' output)
    kv_len = min(site.kv_len, cache.max_seq_len)  # the layers' kv[:, :, :kv_len] views stop at the buffer too
    k_cache = cache.kv[0, 0, :, :kv_len]
    site.prepare(x.new_empty(()).expand(B, T, a.n_heads, a.head_dim), k_cache, k_cache)
    out, feats = DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter, cos, sin,
                              cache.kv, site.rows, site.seqlens, site.kernel_tree_mask, kv_len, list(capture or ()))
    return out, (feats if capture else None)
