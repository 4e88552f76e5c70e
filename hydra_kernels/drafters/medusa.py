"""Medusa: independent heads. Head d sees only h (the drafter's hidden state at the last committed
position) and proposes depth d+1's tokens, the same for every parent, so all depths are drafted at
once and the tree's tokens are gathered from the per-depth top-k lists on the device. Sampled drafts
(draft_temperature > 0): depth d+1's list holds k i.i.d. draws from head d's q instead, shared by
every parent at depth d like the top-k list (a node's children are distinct draws; a walk tries the
children of one node per depth, so the sharing never makes a tried child depend on another).

Original formats: FasterDecoding/Medusa's medusa_lm_head.(pt|safetensors) (drafters/medusa_original.py) and
vLLM's Medusa layout (drafters/medusa_vllm.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..tree import Tree
from .draft_heads import HeadDrafter, HeadState
from .protocol import Proposal, confidence_class


class MedusaDrafter(HeadDrafter):
    kinds = ("medusa",)

    def candidates(self, model, h: torch.Tensor, tree: Tree, backends) -> torch.Tensor:
        """h [B, H] -> every depth's top-k token ids, concatenated: [B, sum of k] (node t's token is
        column tree.flat_source[t])."""
        return self.guesses(model, h, tree, backends, with_probs=False)[0]

    def guesses(self, model, h: torch.Tensor, tree: Tree, backends, with_probs: bool = True):
        """candidates() and, with_probs, each candidate's probability under its head (fp32 [B, sum of k]; else None)."""
        out = [self.head_guesses(model, d, self.heads[d].infer(h, backends), plan.topk, backends, with_probs)
               for d, plan in enumerate(tree.plans)]
        return torch.cat([x for x, _ in out], dim=1), torch.cat([p for _, p in out], dim=1) if with_probs else None

    def _draft(self, model, h: torch.Tensor, root: torch.Tensor, tree: Tree, backends) -> torch.Tensor:
        """h [B, H], root [B] -> tree tokens [B, T] (node 0 = root)."""
        tokens = self.candidates(model, h, tree, backends)[:, tree.flat_source]
        tokens[:, 0] = root
        return tokens

    def propose(self, state: HeadState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        """The signal for the adaptive budget (where HeadDrafter.reports_confidence): each node's probability under
        its depth's head (the root's: 1)."""
        tree = state.tree
        conf = None
        if state.draft_temperature > 0:
            cand, draft_probs = self.sampled_candidates(state, tree)
        else:
            (cand, conf), draft_probs = self.guesses(state.model, state.h, tree, state.backends,
                                                     self.reports_confidence(state)), None
        tokens, positions = ops.tree_inputs(root, cand, tree.flat_source, tree.depths, seqlens,
                                            backend=state.backends["tree_inputs"])
        if conf is not None:
            conf = conf[:, tree.flat_source]
            conf[:, 0] = 1.0
        return Proposal(tokens, tree, positions, draft_probs, signal=None if conf is None else confidence_class(conf))

    def sampled_candidates(self, state: HeadState, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """Every depth's k i.i.d. draws from its head's q, concatenated: [B, sum of k] (laid out as
        candidates()), and draft_probs fp32 [B, T, V]: row t = q of node t's depth (row 0, the root: 0)."""
        B, V = state.h.shape[0], self.vocab_size
        q = state.h.new_zeros(B, tree.depth + 1, V, dtype=torch.float32)  # [B, D+1, V]: q of depth d's nodes
        draws = []
        for d, plan in enumerate(tree.plans):
            x, q_d = self.head_draws(state.model, d, self.heads[d].infer(state.h, state.backends), plan.topk, state)
            draws.append(x)  # [B, k]
            q[:, d + 1] = q_d  # [B, V]
        return torch.cat(draws, dim=1), q[:, tree.depths]

    # ---- the original Medusa format and vLLM's --------------------------------------------------------
    @staticmethod
    def recognizes(cfg_dict: dict) -> bool:
        from . import medusa_original, medusa_vllm

        return medusa_vllm.recognizes(cfg_dict) or medusa_original.recognizes(cfg_dict)

    @classmethod
    def load_original(cls, path: Path, cfg_dict: dict, model=None) -> "MedusaDrafter":
        """Original Medusa heads (drafters/medusa_original.py) or vLLM's Medusa layout (drafters/medusa_vllm.py)."""
        from . import medusa_original, medusa_vllm

        loader = medusa_vllm if medusa_vllm.recognizes(cfg_dict) else medusa_original
        return loader.load_original(cls, path, cfg_dict, model)
