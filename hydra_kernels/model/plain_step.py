"""A CPU plain greedy decoding step in one native call (csrc/plain_step_cpu.cpp): each sequence's last token through
the embedding, RoPE, the layer stack (model/decode_stack.py), the final norm, the LM head and the argmax, its cache
row committed. Plain greedy decoding (generate/ _plain_loop) and the plain steps of a greedy speculative run
(speculative._plain_greedy_step) run it wherever it applies.

Where it applies: where Llama.step would run the native layer stack (decode_stack.run_stack: fp32 CPU model and
cache, native tree_attention, no autograd) and Llama.greedy_tokens the LM head's panels (a packed or quantized head
without a bias), with an fp32 or quantized token embedding, and where no forward hook waits on the embedding, the final
norm or the LM head (the step runs none of their forwards). Elsewhere native_plain_step returns None and the loop keeps
Llama.step + KVCache.advance + Llama.greedy_tokens.

Why: with the stack in one call, the work around it was still ~0.55 ms of a ~5.9 ms SmolLM2 step (2026-11-28, EPYC
VM): the embedding lookup and its id checks, the RoPE rows, the step's rows and mask, the final norm, the argmax,
the commit, each an ATen call or a Python walk, while the second thread waited.

Exactness: the same functions the module path runs, so the same tokens, KV cache and seqlens bit for bit
(tests/test_plain_step.py compares them step by step).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..ops.backend import resolved_name
from ..ops.native import extension_op
from .decode_stack import stack_weights
from .layers import RMSNorm
from .quantized_embedding import QuantizedEmbedding

PLAIN_GREEDY_STEP = extension_op("plain_greedy_step")


def without_hooks(*mods: nn.Module) -> bool:
    """None of mods has a forward hook, nor does nn.Module globally: the native step runs no module's forward."""
    from torch.nn.modules import module as m

    if m._global_forward_hooks or m._global_forward_pre_hooks:
        return False
    return not any(mod._forward_hooks or mod._forward_pre_hooks for mod in mods)


def embedding_spec(emb: nn.Module) -> tuple[torch.Tensor, int, int] | None:
    """(table, kind, rows) of the token embedding for the native step: quantized panels (their kind), an fp32 CPU
    table (kind -1), or None (another embedding, or a subclass with its own forward: the module path)."""
    if type(emb) is QuantizedEmbedding and emb.panels is not None:
        p = emb.panels
        return p.packed, p.kind, p.n
    if type(emb) in (nn.Embedding, QuantizedEmbedding) and emb.max_norm is None:
        w = emb.weight
        if w.is_cpu and w.dtype is torch.float32 and not w.is_meta and w.is_contiguous():
            return w, -1, w.shape[0]
    return None


def native_step_model(model, cache, backends) -> Callable[[], tuple] | None:
    """The model's arguments of a native greedy step (plain_greedy_step, tree_greedy_step: the embedding, the stack's
    weights, the final norm, the LM head, the RoPE tables) for `cache`'s batch, as a function read at each step (the
    stack's through the run's memo, so a weight changed between steps is used as the module path would); None where a
    native step does not apply (the module path then runs: see the module docstring)."""
    plan = model.backend_plan(backends)
    if (PLAIN_GREEDY_STEP is None or model.device.type != "cpu" or model.dtype is not torch.float32
            or cache.kv.dtype is not torch.float32 or cache.seqlens.dtype is not torch.int32
            or resolved_name("tree_attention", plan["tree_attention"], model.device) != "native"
            or not (plan.packed_linear and model.has_packed_weights) or model.output.bias is not None
            or type(model.norm) is not RMSNorm or model.norm.weight.dtype is not torch.float32
            or not without_hooks(model.tok_embeddings, model.norm, model.output)):
        return None
    B = cache.batch_size
    if (torch.is_grad_enabled() or embedding_spec(model.tok_embeddings) is None
            or model.output.step_weights(B) is None or stack_weights(model, B, cache.stack_memo) is None):
        return None
    a, f = model.layers[0].attention, model.layers[0].feed_forward
    V = model.output.out_features

    def args() -> tuple:
        spec = stack_weights(model, B, cache.stack_memo)
        emb = embedding_spec(model.tok_embeddings)
        head = model.output.step_weights(B)
        if spec is None or emb is None or head is None:
            raise RuntimeError("the model changed during generation: the native step no longer applies")
        weights, kinds, biases, norms, eps = spec
        cos, sin = model._rope.table(cache.max_seq_len, model.device)
        return (*emb, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter, model.norm.weight,
                model.norm.eps, *head, V, cos, sin)
    return args


def native_plain_step(model, cache, backends) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """step(tokens, kv_len, commit=True, attend=None) for greedy plain decoding of `cache`'s batch: tokens int64 [B]
    (each sequence's last token, written at its row seqlens[b]) -> (the next tokens int64 [B], the final-normed hidden
    states [B, H] that chose them: Llama.step's output, a drafter's features), with commit seqlens advanced by one
    (without: the caller commits); kv_len a host bound on every seqlens + 1. attend int64 [B] or None: a sequence with
    attend 0 (finished: nobody reads its token) attends over its first cache rows alone, not its prefix, and gets an
    unspecified token and hidden state, the others' bit for bit the same (csrc/decode_stack_cpu.cpp). None where the
    native step does not apply (the module path then runs)."""
    model_args = native_step_model(model, cache, backends)
    if model_args is None:
        return None

    def step(tokens: torch.Tensor, kv_len: int, commit: bool = True,
             attend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return PLAIN_GREEDY_STEP(tokens, *model_args(), cache.kv, cache.seqlens, min(kv_len, cache.max_seq_len), commit,
                                 attend)
    return step
