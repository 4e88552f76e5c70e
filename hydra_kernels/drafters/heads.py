"""Draft heads (Medusa, Hydra, Hydra++) and tree drafting.

Head d (0-based) proposes the tokens at depth d+1 of the tree. A Medusa head sees only h, the
drafter's hidden state for the last committed position; a Hydra head sees cat(h, E(root), E(x1),
..., E(x_d)) -- h first, then the input embeddings of the path to the node it extends.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.backend import op_backend
from ..model.llama import Llama
from ..tree import Tree
from .config import DrafterConfig
from .cpu_packed import packed_draft_heads
from .prefix import PrefixLayer


class ResBlock(nn.Module):
    """y = R x + SiLU(W x + b); R is the identity when widths match, else a learned projection
    (Hydra's first block maps (d+2)H -> H). W starts at zero so a fresh block is R x + SiLU(b)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.res_connection = nn.Linear(in_features, out_features) if in_features != out_features else None
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        res = x if self.res_connection is None else self.res_connection(x)
        return res + F.silu(self.linear(x))


class DraftHead(nn.Module):
    """ResBlocks applied in `schedule` order (a repeated index = one shared module), then its LM head."""

    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        H, L = cfg.hidden_size, cfg.num_layers
        in_features = H * (index + 2) if cfg.grounded else H
        if not cfg.shared_resblocks:
            self.blocks = nn.ModuleList([ResBlock(in_features, H)] + [ResBlock(H, H) for _ in range(L - 1)])
            self.schedule = list(range(L))
        elif in_features != H:  # Hydra original: a first block, then one block repeated L-1 times
            self.blocks = nn.ModuleList([ResBlock(in_features, H)] + ([ResBlock(H, H)] if L > 1 else []))
            self.schedule = [0] + [1] * (L - 1)
        else:  # Medusa original: one block repeated L times
            self.blocks = nn.ModuleList([ResBlock(H, H)])
            self.schedule = [0] * L
        V = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_head = nn.Linear(H, V, bias=cfg.lm_head_bias) if cfg.lm_head == "per_head" else None

    def hidden(self, x):
        """Training path (autograd through the modules)."""
        for i in self.schedule:
            x = self.blocks[i](x)
        return x

    def run_blocks(self, x, schedule, backend: str = "auto"):
        """Inference path: the blocks of `schedule` (indices into self.blocks) on x; H -> H blocks run
        as the fused ops.resblock (one launch each, all nodes of a depth at once)."""
        for i in schedule:
            blk = self.blocks[i]
            if blk.res_connection is None:
                x = ops.resblock(x, blk.linear.weight, blk.linear.bias, backend=backend)
            else:
                x = blk(x)
        return x


class Drafter(nn.Module):
    """All heads of one drafter, plus the Hydra++ prefix layer when configured.

    Decoding protocol (generate() drives it; everything stays on the device):
      state = drafter.start(model, B, S_max)
      h = drafter.after_prefill(state, all_hidden [B, L, H], lengths [B])
      loop: tokens = drafter.draft(model, h, root, tree)          # [B, T], tokens[:, 0] = root
            ... verify, commit ...
            h = drafter.after_step(state, accepted_hidden [B, K+1, H], accept_lengths [B])
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.heads = nn.ModuleList(DraftHead(cfg, i) for i in range(cfg.num_heads))
        V = cfg.draft_vocab_size or cfg.vocab_size
        self.shared_lm_head = (nn.Linear(cfg.hidden_size, V, bias=cfg.lm_head_bias)
                               if cfg.lm_head == "shared" else None)
        self.prefix = PrefixLayer(cfg.base_config, cfg.prefix_final_norm) if cfg.prefix_layer else None
        # draft index -> token id (None: the identity over the whole vocabulary)
        self.register_buffer("draft_vocab", torch.arange(V) if cfg.draft_vocab_size else None)
        self._tied_slice, self._tied_key = None, None
        self.trees: dict = {}  # device type ("cpu", "cuda") -> the Tree searched for it (saved with the heads)

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def check_model(self, model: Llama) -> None:
        """Clear errors when this drafter cannot serve `model` (before any work)."""
        mc = model.config
        if self.vocab_size != mc.vocab_size:
            raise ValueError(f"drafter vocab ({self.vocab_size}) does not match the model's ({mc.vocab_size}): "
                             "these heads were trained for another model")
        if self.hidden_size != mc.hidden_size:
            raise ValueError(f"drafter hidden size ({self.hidden_size}) does not match the model's "
                             f"({mc.hidden_size}): these heads were trained for another model")
        if self.prefix is not None:
            self.prefix.check_model(model)
        p = next(self.parameters(), None)
        if p is not None and (p.device != model.device or p.dtype != model.dtype):
            raise ValueError(f"drafter is {p.dtype} on {p.device} but the model is {model.dtype} on {model.device}; "
                             "call drafter.to(model.device, model.dtype)")

    def logits(self, model: Llama, head: int, x: torch.Tensor) -> torch.Tensor:
        """Head `head` on inputs x [..., in_features] -> logits [..., Vd] over the draft vocabulary
        (column j is token draft_vocab[j]; the whole vocabulary when draft_vocab is None)."""
        hidden = self.heads[head].hidden(x)
        lm = self.heads[head].lm_head or self.shared_lm_head
        if lm is not None:
            return lm(hidden)
        return F.linear(hidden, self.tied_lm_weight(model))

    def tied_lm_weight(self, model: Llama) -> torch.Tensor:
        """The base model's LM head rows of the draft vocabulary [Vd, H], gathered once and cached
        (refreshed if the model's weight or the vocabulary changes). On the CPU the slice is stored
        input-major like the model's weights: the small-M GEMV streams it ~2x faster."""
        w = model.output.weight
        if self.draft_vocab is None:
            return w
        key = (w.data_ptr(), w._version, self.draft_vocab.data_ptr(), self.draft_vocab._version, w.dtype)
        if self._tied_key != key:
            with torch.no_grad():
                s = w.index_select(0, self.draft_vocab)
                self._tied_slice = s.t().contiguous().t() if s.device.type == "cpu" else s.contiguous()
            self._tied_key = key
        return self._tied_slice

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def topk_tokens(self, model: Llama, head: int, x: torch.Tensor, k: int, backend: str = "auto") -> torch.Tensor:
        """Token ids of head `head`'s k best guesses for inputs x [..., in_features] -> [..., k]."""
        hd = self.heads[head]
        hidden = hd.run_blocks(x, hd.schedule, op_backend("resblock", backend, x.device))
        return self.topk_from_hidden(model, head, hidden, k, backend)

    def topk_from_hidden(self, model: Llama, head: int, hidden: torch.Tensor, k: int, backend: str = "auto"):
        """Head output [..., H] -> token ids of its k best guesses [..., k]. With the tied LM head the
        top-k is fused into it (ops.lm_head_topk: no logits written)."""
        lm = self.heads[head].lm_head or self.shared_lm_head
        if lm is None:
            idx = ops.lm_head_topk(hidden, self.tied_lm_weight(model), k, backend=backend)[1]
        else:
            idx = lm(hidden).topk(k, dim=-1).indices
        return self.token_ids(idx)

    def hydra_hidden(self, model: Llama, head: int, h: torch.Tensor, path_tokens: torch.Tensor,
                     backend: str = "auto") -> torch.Tensor:
        """Hydra head `head` on nodes given by their paths: h [B, H], path_tokens [B, n, head+1] -> [B, n, H].
        The first ResBlock runs as ops.hydra_first_layer (embeddings gathered by id, no concatenation)."""
        hd = self.heads[head]
        b0 = hd.blocks[hd.schedule[0]]
        x = ops.hydra_first_layer(h, path_tokens, model.tok_embeddings.weight, b0.linear.weight, b0.linear.bias,
                                  b0.res_connection.weight, b0.res_connection.bias, backend=backend)
        return hd.run_blocks(x, hd.schedule[1:], op_backend("resblock", backend, h.device))

    def head_input(self, model: Llama, h: torch.Tensor, tokens: torch.Tensor, tree: Tree, depth: int,
                   nodes: torch.Tensor) -> torch.Tensor:
        """Input of head `depth` for the given tree nodes at that depth: [B, n, (depth+2)H] for Hydra
        (h, then the embeddings of the node's path from the root, root first), [B, n, H] for Medusa."""
        B, n = tokens.shape[0], nodes.shape[0]
        if not self.config.grounded:
            return h[:, None, :].expand(B, n, h.shape[-1])
        path = tree.ancestors[nodes, : depth + 1]  # [n, depth+1] node ids, root first
        emb = model.tok_embeddings(tokens[:, path])  # [B, n, depth+1, H]
        return torch.cat([h[:, None, None, :].expand(B, n, 1, h.shape[-1]), emb], dim=2).flatten(2)

    def draft(self, model: Llama, h: torch.Tensor, root: torch.Tensor, tree: Tree, backend: str = "auto") -> torch.Tensor:
        """h [B, H], root [B] -> tree tokens [B, T] (node 0 = root). One head call per depth for every
        node that has children, top-k over the vocabulary, children take their rank's token."""
        backend_of = lambda op: op_backend(op, backend, h.device)  # noqa: E731  (ops without this backend use "auto")
        B = h.shape[0]
        packed = packed_draft_heads(self, model, h, backend, B * max((len(p.parents) for p in tree.plans), default=1))
        tokens = torch.zeros(B, tree.num_nodes, dtype=torch.long, device=h.device)
        tokens[:, 0] = root
        for d, plan in enumerate(tree.plans):
            if self.config.grounded:
                path = tree.ancestors[plan.parents, : d + 1]  # [n_parents, d+1] node ids, root first
                if packed is not None:  # CPU: bf16 packed weights, x = cat(h, E(path)) built once
                    x = torch.cat([h[:, None, :].expand(B, path.shape[0], h.shape[-1]),
                                   model.tok_embeddings.weight[tokens[:, path]].flatten(2)], dim=-1)
                    top = self.token_ids(packed.topk(d, packed.run_blocks(d, x), plan.topk))
                else:
                    hidden = self.hydra_hidden(model, d, h, tokens[:, path], backend_of("hydra_first_layer"))
                    top = self.topk_from_hidden(model, d, hidden, plan.topk, backend_of("lm_head_topk"))
                tokens[:, plan.children] = top[:, plan.child_slot, plan.child_rank]  # top [B, n_p, k]
            else:  # Medusa: one distribution per depth, the same for every parent
                top = self._medusa_topk(model, d, h, plan.topk, backend, packed)  # [B, k]
                tokens[:, plan.children] = top[:, plan.child_rank]
        return tokens

    def medusa_candidates(self, model: Llama, h: torch.Tensor, tree: Tree, backend: str = "auto") -> torch.Tensor:
        """Medusa only: every depth's top-k from h, concatenated -> [B, sum of k] (node t's token is
        column tree.flat_source[t]; ops.tree_inputs builds the tree tokens from it on the device)."""
        if self.config.grounded:
            raise ValueError("medusa_candidates is for path-independent (Medusa) heads; Hydra heads use draft()")
        packed = packed_draft_heads(self, model, h, backend, h.shape[0])
        return torch.cat([self._medusa_topk(model, d, h, plan.topk, backend, packed)
                          for d, plan in enumerate(tree.plans)], dim=1)

    def _medusa_topk(self, model: Llama, head: int, h: torch.Tensor, k: int, backend: str, packed) -> torch.Tensor:
        """Medusa head `head`'s k best token ids from h [B, H] -> [B, k] (packed CPU weights when given)."""
        if packed is not None:
            return self.token_ids(packed.topk(head, packed.run_blocks(head, h), k))
        return self.topk_tokens(model, head, h, k, op_backend("lm_head_topk", backend, h.device))

    # ---- the hidden state h the heads start from ------------------------------------------------
    def start(self, model: Llama, batch_size: int, max_seq_len: int):
        return self.prefix.new_cache(batch_size, max_seq_len, model) if self.prefix is not None else None

    def after_prefill(self, state, all_hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """all_hidden [B, L, H] (right-padded prompt hidden states), lengths [B] -> h [B, H]."""
        out = all_hidden if self.prefix is None else self.prefix(all_hidden, state)
        if state is not None:
            state.seqlens.copy_(lengths)
        return _at(out, lengths.long() - 1)

    def after_step(self, state, accepted_hidden: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
        """accepted_hidden [B, K+1, H] (valid up to accept_lengths[b]) -> h [B, H]."""
        out = accepted_hidden if self.prefix is None else self.prefix(accepted_hidden, state)
        if state is not None:
            state.advance(accept_lengths.to(state.seqlens.dtype))
        return _at(out, (accept_lengths.long() - 1).clamp(min=0))


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, H], index [B] -> x[b, index[b]] [B, H]."""
    return x[torch.arange(x.shape[0], device=x.device), index]
