"""One depth of Hydra's greedy drafting in one native call (csrc/hydra_head_cpu.cpp): each parent node's first-block
input cat(h, E(path)), the ResBlock, the LM-head rows of the draft vocabulary, its top-k guesses as token ids and
their probabilities.

Where it applies: top-k drafts (not sampled ones) of a head that is its first block alone (num_layers 1, the shipped
Hydra heads) ranking with the base model's tied LM-head rows, on the CPU kernels (the run's BackendPlan packs the
drafter's linears; fp32 inference, no autograd, no forward hook on the modules it skips), with an fp32 or quantized
token embedding. Elsewhere native_head_topk returns None and HydraDrafter keeps its module path.

Why: with 4096 draft-vocabulary rows the kernels of a depth take ~0.13 ms and the module path around them about as
long again (csrc/hydra_head_cpu.cpp); a drafted step of the default drafter runs one depth per head.

Exactness: the same functions as the module path, so the same guesses and probabilities bit for bit
(tests/test_hydra_head_native.py).
A draft's guesses never change what generate() emits (the base model verifies), only how fast.
"""
from __future__ import annotations

import torch

from ..model.packed_linear import MAX_PACKED_ROWS
from ..model.plain_step import embedding_spec, without_hooks
from ..ops.native import extension_op
from ..ops.quantized_linear import QuantizedPanels

HYDRA_HEAD_TOPK = extension_op("hydra_head_topk")


def native_head_topk(drafter, model, head: int, h: torch.Tensor, path_tokens: torch.Tensor, k: int,
                     backends) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Head `head`'s k best guesses as token ids [B, n, k] (best first) and their probabilities fp32 [B, n, k] for
    the n parents given by their paths path_tokens int64 [B, n, head + 1] (root first), from h fp32 [B, H]: what
    HydraDrafter.first_block then head_guesses return, in one native call; None where it does not apply (see the
    module docstring)."""
    if (HYDRA_HEAD_TOPK is None or not backends.packed_linear or not h.is_cpu or h.dtype is not torch.float32
            or torch.is_grad_enabled() or drafter.shared_lm_head is not None):
        return None
    dh = drafter.heads[head]
    B, n = path_tokens.shape[:2]
    if len(dh.schedule) != 1 or dh.lm_head is not None or B * n > MAX_PACKED_ROWS:
        return None
    blk = dh.blocks[dh.schedule[0]]
    if blk.res_connection is None or not without_hooks(blk, blk.linear, blk.res_connection, model.tok_embeddings):
        return None
    lin, res, emb = blk.linear.step_weights(B * n), blk.res_connection.step_weights(B * n), \
        embedding_spec(model.tok_embeddings)
    if lin is None or res is None or emb is None:
        return None
    return HYDRA_HEAD_TOPK(h.contiguous(), path_tokens.contiguous(), *emb, *lin, blk.linear.bias, *res, blk.res_connection.bias,
                           *tied_rows_spec(drafter, model), drafter.draft_vocab, k)


def tied_rows_spec(drafter, model) -> tuple[torch.Tensor, int, int]:
    """(weights, kind, rows) of the LM-head rows of the drafter's draft vocabulary that head_topk's packed path reads
    (TiedLMHead: the head's own quantized blocks, or bf16 panels), as the op takes them."""
    rows = drafter._tied._cpu_panels(model, drafter.draft_vocab)
    V = drafter.draft_vocab.numel() if drafter.draft_vocab is not None else model.output.out_features
    return (rows.step_tensor, rows.kind, V) if isinstance(rows, QuantizedPanels) else (rows, 0, V)
