"""A CPU greedy verify step in one native call (csrc/tree_step_cpu.cpp): a drafted tree through the model
(plain_step's greedy forward, every node's argmax), greedy acceptance along its leaf paths and the commit of the
accepted rows. The greedy steps of a speculative run (speculative.greedy_verify_step's callers) run it wherever it
applies: where the native plain step does (model/plain_step.native_step_model) and no layer's inputs are captured.

Why: around the native stack, the module path's verify step (Llama.step, Llama.greedy_tokens, ops.greedy_verify,
commit_step) spends ~0.5-0.7 ms of Python and ATen beyond the kernels, which every drafted step paid on top of its
rows (2026-11-28, EPYC VM, SmolLM2-135M, `benchmarks/bench_verify_step.py`: at batch 1 a 2-node step 7.05 ms on the
module path, 6.49 native, beside a 5.40 ms plain step; 0.52-0.68 ms saved at batch 1 and 4, T = 1-6).

Exactness: the functions the module path runs, so the same tokens, acceptance, KV cache and seqlens bit for bit
(tests/test_tree_step.py compares them step by step).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ops import Verification
from ..ops.native import extension_op
from .plain_step import native_step_model

TREE_GREEDY_STEP = extension_op("tree_greedy_step")


def native_tree_step(model, cache, backends) -> Callable | None:
    """step(tokens, tree, active, positions, kv_len, attend=None) for the greedy verify steps of `cache`'s batch:
    tokens int64 [B, T] over `tree` (a Tree or TreeBatch), active int64 [B] (0: commits nothing), positions [B, T] or
    None (seqlens + the tree's depths), kv_len a host bound on seqlens + T -> (the final hidden states [B, T, H], the
    argmax after every node [B, T], the Verification, the committed lengths n [B]), as greedy_verify_step returns
    them; seqlens advanced by n. attend int64 [B] or None: a sequence with attend 0 (finished: give it active 0 too)
    attends over its first T cache rows alone, not its prefix; its outputs are unspecified, the others' bit for bit
    the same. None where it does not apply (the module path then runs)."""
    model_args = native_step_model(model, cache, backends) if TREE_GREEDY_STEP is not None else None
    if model_args is None:
        return None

    def step(tokens: torch.Tensor, tree, active: torch.Tensor, positions: torch.Tensor | None, kv_len: int,
             attend: torch.Tensor | None = None):
        # a drafter's tokens may be a view (MLPSpeculator's candidates): the op reads contiguous int64
        hidden, target, *v, n = TREE_GREEDY_STEP(tokens.contiguous(), tree.mask, tree.depths, positions, tree.paths,
                                                 active, *model_args(), cache.kv, cache.seqlens,
                                                 min(kv_len, cache.max_seq_len), attend)
        return hidden, target, Verification(*v), n
    return step
