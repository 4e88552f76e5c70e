"""Hydra and Hydra++: sequentially dependent heads. Head d sees cat(h, E(root), E(x1), ..., E(x_d)):
h first, then the input embeddings of the path from the root to the node it extends, so the tree is
drafted depth by depth, each depth's nodes in one head call. Hydra++ adds a prefix decoder layer over
the base model's hidden states (drafters/prefix.py) and deeper heads. Sampled drafts
(draft_temperature > 0): a parent's children are i.i.d. draws from its head's q at that parent.

Original format (github.com/zankner/Hydra): drafters/hydra_original.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..tree import Tree
from .draft_heads import HeadDrafter, HeadState
from .medusa import MedusaDrafter
from .native_heads import native_head_topk
from .protocol import Proposal, confidence_class


class HydraDrafter(HeadDrafter):
    kinds = ("hydra", "hydra++")

    def first_block(self, model, head: int, h: torch.Tensor, path_tokens: torch.Tensor, backends) -> torch.Tensor:
        """Head `head`'s first ResBlock on nodes given by their paths: h [B, H], path_tokens
        [B, n, head+1] (root first) -> [B, n, H]. On packed CPU weights the concatenated input is built
        once for the module; elsewhere ops.hydra_first_layer gathers the embeddings by id, no concat."""
        blk = self.heads[head].blocks[self.heads[head].schedule[0]]
        if blk.linear.packed_on:
            B, n = path_tokens.shape[:2]
            x = torch.cat([h[:, None, :].expand(B, n, h.shape[-1]),
                           model.tok_embeddings(path_tokens).flatten(2)], dim=-1)  # [B, n, (head+2)H]
            return blk(x)
        return ops.hydra_first_layer(h, path_tokens, model.embedding_weight(), blk.linear.weight, blk.linear.bias,
                                     blk.res_connection.weight, blk.res_connection.bias,
                                     backend=backends["hydra_first_layer"])

    def _draft(self, model, h: torch.Tensor, root: torch.Tensor, tree: Tree, backends) -> torch.Tensor:
        """h [B, H], root [B] -> tree tokens [B, T] (node 0 = root). One head call per depth for every
        node that has children; children take their rank's token of the parent's top-k."""
        return self._tokens(model, h, root, tree, backends)[0]

    def _tokens(self, model, h: torch.Tensor, root: torch.Tensor, tree: Tree, backends, state: HeadState | None = None):
        """_draft's walk -> (tokens [B, T], draft_probs, conf). state with draft_temperature > 0: child of rank
        r takes draw r of k i.i.d. draws from the head's q at its parent, and draft_probs fp32 [B, T, V]
        holds that q in the child's row (the root's: 0); else top-k drafts and draft_probs None. conf fp32
        [B, T]: each node's probability under its head at its parent (the root's: 1), the adaptive budget's
        signal (Proposal.signal, confidence_class); None where the run's proposals report none
        (HeadDrafter.reports_confidence; state None: a draft outside a run, reported)."""
        B = h.shape[0]
        tokens = torch.zeros(B, tree.num_nodes, dtype=torch.long, device=h.device)
        tokens[:, 0] = root
        sampled = state is not None and state.draft_temperature > 0
        want = state is None or self.reports_confidence(state)  # conf: None where no policy reads it
        conf = torch.ones(B, tree.num_nodes, dtype=torch.float32, device=h.device) if want else None
        probs = h.new_zeros(B, tree.num_nodes, self.vocab_size, dtype=torch.float32) if sampled else None
        for d, plan in enumerate(tree.plans):
            path = tree.ancestors[plan.parents, : d + 1]  # [n_parents, d+1] node ids, root first
            top = None if sampled else native_head_topk(self, model, d, h, tokens[:, path], plan.topk, backends)
            if top is None:
                hidden = self.heads[d].infer(self.first_block(model, d, h, tokens[:, path], backends), backends, first=1)
                if sampled:
                    ids, q = self.head_draws(model, d, hidden, plan.topk, state)  # [B, n_parents, k], [B, n_parents, V]
                    probs[:, plan.children] = q[:, plan.child_slot]
                    top = (ids, None)
                else:
                    top = self.head_guesses(model, d, hidden, plan.topk, backends, want)  # [B, n_parents, k] twice
            # else the depth in one native call (drafters/native_heads.py): the same guesses
            ids, p = top
            tokens[:, plan.children] = ids[:, plan.child_slot, plan.child_rank]
            if conf is not None:
                conf[:, plan.children] = p[:, plan.child_slot, plan.child_rank]
        return tokens, probs, conf

    def propose(self, state: HeadState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        tokens, draft_probs, conf = self._tokens(state.model, state.h, root, state.tree, state.backends, state)
        return Proposal(tokens, state.tree, draft_probs=draft_probs,
                        signal=None if conf is None else confidence_class(conf))

    # ---- the original Hydra format ----------------------------------------------------------------
    @staticmethod
    def recognizes(cfg_dict: dict) -> bool:
        from .hydra_original import recognizes

        return recognizes(cfg_dict)

    @classmethod
    def load_original(cls, path: Path, cfg_dict: dict, model=None) -> HeadDrafter:
        """An original Hydra checkpoint (drafters/hydra_original.py); grounded_heads false: Medusa heads."""
        from .hydra_original import load_original

        return load_original(cls, MedusaDrafter, path, cfg_dict, model)
