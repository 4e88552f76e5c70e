"""Drafting on the CPU through the native packed small-M kernel, with the head weights in bf16.

A CPU drafting step is bound by reading weights: per depth, a Hydra head's first ResBlock (two
[H, (d+2)H] matrices, 2.7-6.6 MB in fp32 for SmolLM2) and the LM-head rows of the draft vocabulary
([Vd, H]: 16k x 576 fp32 = 38 MB, read again at every depth). With MKL on the fp32 weights that was
~10 ms of a ~37 ms step on the 2-core dev CPU, more than the tree adds to the verify forward. Here
every head matrix is packed once for `hydra_kernels::packed_linear` in bf16 (fp32 accumulation): half
the bytes, and the 19 MB LM-head slice fits a 32 MB L3, so depths after the first read it from cache.
The first ResBlock's two matrices are packed as one [2H, (d+2)H] panel set (one pass over x).

Drafting precision never changes what generate() emits: every token is decided by the fp32 base model
in verification. It can only change which guesses are proposed (the heads train under bf16 autocast
and ship in bf16). `DRAFT_PACK_DTYPE = torch.float32` keeps fp32 weights (same kernel) for comparison.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.packed_linear import MAX_PACKED_ROWS, packed_linear_available

DRAFT_PACK_DTYPE = torch.bfloat16


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.hydra_kernels.pack_linear_weight(w.detach().float(), DRAFT_PACK_DTYPE)


def _bias(b: torch.Tensor | None) -> torch.Tensor | None:
    return None if b is None else b.detach().float().contiguous()


class _Packed:
    """One packed matrix: y [..., N] = x [..., K] W^T + b through the native kernel."""

    __slots__ = ("panels", "n", "bias")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.panels, self.n, self.bias = _pack(w), w.shape[0], _bias(b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hydra_kernels.packed_linear(x, self.panels, self.n, self.bias)


class PackedDraftHeads:
    """A drafter's inference weights packed for the CPU kernel (built by `packed_draft_heads`).

    blocks[d]: head d's ResBlocks in schedule order, each (packed, kind): kind "first" is a [2H, in]
    pack of (W, R) giving R x + b_R + SiLU(W x + b_W); kind "res" is x + SiLU(W x + b).
    lm[d]: head d's LM head over the draft vocabulary (the tied slice, its own, or the shared one).
    """

    def __init__(self, drafter, model):
        H = drafter.hidden_size
        self.blocks = []
        for head in drafter.heads:
            packed, seen = [], {}
            for i in head.schedule:  # a repeated index is one shared module: pack it once
                blk = head.blocks[i]
                if i not in seen:
                    if blk.res_connection is None:
                        seen[i] = (_Packed(blk.linear.weight, blk.linear.bias), "res")
                    else:
                        lb = blk.linear.bias if blk.linear.bias is not None else torch.zeros(H)
                        rb = blk.res_connection.bias if blk.res_connection.bias is not None else torch.zeros(H)
                        w = torch.cat([blk.linear.weight, blk.res_connection.weight])
                        seen[i] = (_Packed(w, torch.cat([lb, rb])), "first")
                packed.append(seen[i])
            self.blocks.append(packed)
        tied = None
        self.lm = []
        for head in drafter.heads:
            lm = head.lm_head or drafter.shared_lm_head
            if lm is None:
                if tied is None:  # one copy for all heads
                    tied = _Packed(drafter.tied_lm_weight(model), None)
                self.lm.append(tied)
            else:
                self.lm.append(_Packed(lm.weight, lm.bias))

    def run_blocks(self, head: int, x: torch.Tensor) -> torch.Tensor:
        """Head `head`'s ResBlocks on its input x [..., in] -> [..., H]."""
        for packed, kind in self.blocks[head]:
            y = packed(x)
            if kind == "first":
                lin, res = y.chunk(2, dim=-1)
                x = res + F.silu(lin)
            else:
                x = x + F.silu(y)
        return x

    def topk(self, head: int, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head output [..., H] -> draft-vocabulary indices of its k largest logits [..., k]."""
        logits = self.lm[head](hidden)
        if k == 1:
            return logits.argmax(dim=-1, keepdim=True)
        return logits.topk(k, dim=-1).indices


def _weights_key(drafter, model) -> tuple:
    # what identifies the packed copies: every parameter's storage and version (training in place and
    # .data = ... both change one of them), the tied LM head's, the draft vocabulary's, the storage dtype
    w = model.output.weight
    key = [DRAFT_PACK_DTYPE] + [(p.data_ptr(), p._version) for p in drafter.parameters()]
    key.append((w.data_ptr(), w._version))
    if drafter.draft_vocab is not None:
        key.append((drafter.draft_vocab.data_ptr(), drafter.draft_vocab._version))
    return tuple(key)


def packed_draft_heads(drafter, model, h: torch.Tensor, backend: str, rows: int) -> PackedDraftHeads | None:
    """The drafter's packed CPU weights when this drafting call may use them, else None (the ops path).

    Used for fp32 CPU inference with backend "auto" / "native" on a model that runs its own steps on
    the packed kernel (hk.load_model on a CPU with AVX-512: `model.output._packed` is set), when a
    head call drafts at most MAX_PACKED_ROWS rows (`rows`: batch x the most parents at one depth).
    Packed on first use; repacked when any weight changed since."""
    if (backend not in ("auto", "native") or not h.is_cpu or h.dtype is not torch.float32
            or getattr(model.output, "_packed", None) is None or torch.is_grad_enabled()
            or rows > MAX_PACKED_ROWS or not packed_linear_available()):
        return None
    key = _weights_key(drafter, model)
    cached = drafter.__dict__.get("_cpu_packed")
    if cached is None or cached[0] != key:
        cached = (key, PackedDraftHeads(drafter, model))
        drafter.__dict__["_cpu_packed"] = cached
    return cached[1]
