"""The compiled extension's ops (torch.ops.hydra_kernels.*, from csrc/), registered as the "native"
backend when hydra_kernels._C imports, with fake kernels so torch.compile can trace them."""
from __future__ import annotations

import torch

from .backend import native_available, register

NATIVE_MAX_ACCEPT = 32  # csrc/hydra_kernels.h HK_MAX_ACCEPT: rows one native commit_kv moves per sequence


def extension_op(name: str):
    """torch.ops.hydra_kernels.<name> where the extension is built, else None (the model's CPU-only ops that
    are not public ops with backends: the decode stack, the row norm)."""
    if not native_available():
        return None
    return getattr(torch.ops.hydra_kernels, name, None)


def _register() -> bool:
    if not native_available():
        return False
    ops = torch.ops.hydra_kernels

    def greedy_verify(target_tokens, tree_tokens, paths):
        return ops.greedy_verify(target_tokens, tree_tokens, paths)

    def commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths):
        ops.commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths)

    def tree_inputs(root, candidates, node_source, depths, cache_seqlens):
        return ops.tree_inputs(root, candidates, node_source, depths, cache_seqlens)

    def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=None):
        return ops.tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale)

    register("tree_attention", "native", tree_attention, devices=("cpu",))  # CUDA: the Triton kernel
    register("greedy_verify", "native", greedy_verify)
    register("commit_kv", "native", commit_kv, limits={"accepted_rows": NATIVE_MAX_ACCEPT})
    register("tree_inputs", "native", tree_inputs)

    @torch.library.register_fake("hydra_kernels::greedy_verify")
    def _(target_tokens, tree_tokens, paths):
        B, D1 = tree_tokens.shape[0], paths.shape[-1]  # paths [P, D+1] or [B, P, D+1]
        new = lambda *s: tree_tokens.new_empty(s, dtype=torch.long)
        return new(B), new(B, D1), new(B), new(B)

    @torch.library.register_fake("hydra_kernels::tree_attention")
    def _(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=None):
        return torch.empty_like(q)

    @torch.library.register_fake("hydra_kernels::commit_kv")
    def _(kv_cache, cache_seqlens, accept_indices, accept_lengths):
        return None  # in place: the graph records the mutation of kv_cache from the schema (Tensor(a!))

    @torch.library.register_fake("hydra_kernels::packed_linear")
    def _(x, packed, N, bias=None):
        return x.new_empty(*x.shape[:-1], N)

    @torch.library.register_fake("hydra_kernels::pack_linear_weight")
    def _(weight, dtype=None):  # traced only where a layer's panels were never built eagerly (DerivedCache.get)
        N, K = weight.shape
        return weight.new_empty((N + 63) // 64, K, 64, dtype=dtype or torch.float32)  # 64: csrc kPanel

    @torch.library.register_fake("hydra_kernels::quantized_linear")
    def _(x, packed, N, bits, offset, bias=None, isa=0, half_scales=False):
        return x.new_empty(*x.shape[:-1], N)

    @torch.library.register_fake("hydra_kernels::int8_dot_linear")
    def _(x, packed, N, bits, offset, bias=None, isa=0, half_scales=False):
        return x.new_empty(*x.shape[:-1], N)

    @torch.library.register_fake("hydra_kernels::quantized_rows")
    def _(packed, ids, N, bits, offset, half_scales=False):
        from .quantized_linear import header_bytes

        G = (packed.shape[2] - header_bytes(offset, half_scales)) * 8 // (64 * bits)  # csrc: group bytes -> inputs
        return packed.new_empty(ids.shape[0], packed.shape[1] * G, dtype=torch.float32)

    @torch.library.register_fake("hydra_kernels::decode_stack")
    def _(x, weights, kinds, biases, norms, eps, n_heads, n_kv_heads, intermediate, cos, sin, kv, rows, seqlens,
          tree_mask, kv_len, capture, attend=None):  # the last layer's output, the captured inputs; kv written in place
        B, T, H = x.shape
        return torch.empty_like(x), x.new_empty((B, T, len(capture) * H) if capture else (0,))

    @torch.library.register_fake("hydra_kernels::hydra_head_topk")
    def _(h, paths, embed, embed_kind, embed_rows, w_lin, lin_kind, b_lin, w_res, res_kind, b_res, lm, lm_kind, vocab,
          vocab_ids, k):  # each parent's k guesses as token ids, and their probabilities
        return paths.new_empty(paths.shape[0], paths.shape[1], k), h.new_empty(paths.shape[0], paths.shape[1], k)

    @torch.library.register_fake("hydra_kernels::plain_greedy_step")
    def _(tokens, embed, embed_kind, embed_rows, weights, kinds, biases, norms, eps, n_heads, n_kv_heads, intermediate,
          final_norm, final_eps, head, head_kind, vocab, cos_table, sin_table, kv, seqlens, kv_len, commit=True,
          attend=None):
        # the next tokens, the final hidden states; kv (and, with commit, seqlens) written in place
        return torch.empty_like(tokens), final_norm.new_empty(tokens.shape[0], final_norm.shape[0])

    @torch.library.register_fake("hydra_kernels::tree_greedy_step")
    def _(tokens, tree_mask, depths, positions, paths, active, embed, embed_kind, embed_rows, weights, kinds, biases,
          norms, eps, n_heads, n_kv_heads, intermediate, final_norm, final_eps, head, head_kind, vocab, cos_table,
          sin_table, kv, seqlens, kv_len, attend=None):
        B, T = tokens.shape
        D1 = paths.shape[-1]
        return (final_norm.new_empty(B, T, final_norm.shape[0]), tokens.new_empty(B, T), tokens.new_empty(B),
                tokens.new_empty(B, D1), tokens.new_empty(B), tokens.new_empty(B), tokens.new_empty(B))

    @torch.library.register_fake("hydra_kernels::rms_norm_rows")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def rms_norm_rows_context(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def rms_norm_rows_backward(ctx, g):
        # y = x r w, r = (mean(x^2) + eps)^(-1/2):
        # dx_i = r w_i g_i - x_i r^3 / H * sum_j g_j w_j x_j; dw = sum over rows of g x r
        x, weight = ctx.saved_tensors
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        gw = g * weight
        dx = r * gw - x * (r.pow(3) / x.shape[-1]) * (gw * x).sum(-1, keepdim=True) if ctx.needs_input_grad[0] else None
        dw = (g * x * r).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dw, None

    # RMSNorm runs the row norm under autograd too, so a model's values do not depend on whether a graph is kept
    torch.library.register_autograd("hydra_kernels::rms_norm_rows", rms_norm_rows_backward,
                                    setup_context=rms_norm_rows_context)

    @torch.library.register_fake("hydra_kernels::tree_inputs")
    def _(root, candidates, node_source, depths, cache_seqlens):
        shape = (root.shape[0], node_source.shape[0])
        return root.new_empty(shape, dtype=torch.long), root.new_empty(shape, dtype=torch.long)

    return True


AVAILABLE = _register()
