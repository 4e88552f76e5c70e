"""Medusa: independent heads. Head d sees only h (the drafter's hidden state at the last committed
position) and proposes depth d+1's tokens, the same for every parent, so all depths are drafted at
once and the tree's tokens are gathered from the per-depth top-k lists on the device. Sampled drafts
(draft_temperature > 0): depth d+1's list holds k i.i.d. draws from head d's q instead, shared by
every parent at depth d like the top-k list (a node's children are distinct draws; a walk tries the
children of one node per depth, so the sharing never makes a tried child depend on another).

Original format (github.com/FasterDecoding/Medusa, and vLLM's layout of it): config.json with
medusa_num_heads, medusa_num_layers; medusa_lm_head.(pt|safetensors) holding
{head}.{layer}.linear.weight/bias and {head}.{num_layers}.weight (a head's repeated ResBlocks are one
module object there, so several keys hold one tensor).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..tree import Tree
from .checkpoint import fill_head, original_blocks
from .config import DrafterConfig
from .draft_heads import HeadDrafter, HeadState
from .protocol import Proposal


class MedusaDrafter(HeadDrafter):
    kinds = ("medusa",)

    def candidates(self, model, h: torch.Tensor, tree: Tree, backends) -> torch.Tensor:
        """h [B, H] -> every depth's top-k token ids, concatenated: [B, sum of k] (node t's token is
        column tree.flat_source[t])."""
        return torch.cat([self.head_topk(model, d, self.heads[d].infer(h, backends), plan.topk, backends)
                          for d, plan in enumerate(tree.plans)], dim=1)

    def _draft(self, model, h: torch.Tensor, root: torch.Tensor, tree: Tree, backends) -> torch.Tensor:
        """h [B, H], root [B] -> tree tokens [B, T] (node 0 = root)."""
        tokens = self.candidates(model, h, tree, backends)[:, tree.flat_source]
        tokens[:, 0] = root
        return tokens

    def propose(self, state: HeadState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        tree = state.tree
        if state.draft_temperature > 0:
            cand, draft_probs = self.sampled_candidates(state, tree)
        else:
            cand, draft_probs = self.candidates(state.model, state.h, tree, state.backends), None
        tokens, positions = ops.tree_inputs(root, cand, tree.flat_source, tree.depths, seqlens,
                                            backend=state.backends["tree_inputs"])
        return Proposal(tokens, tree, positions, draft_probs)

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

    # ---- the original Medusa format ---------------------------------------------------------------
    @staticmethod
    def recognizes(cfg_dict: dict) -> bool:
        return "medusa_num_heads" in cfg_dict

    @classmethod
    def load_original(cls, path: Path, cfg_dict: dict, model=None) -> "MedusaDrafter":
        n, L = cfg_dict["medusa_num_heads"], cfg_dict["medusa_num_layers"]
        if (path / "medusa_lm_head.safetensors").exists():
            from safetensors.torch import load_file

            sd = load_file(str(path / "medusa_lm_head.safetensors"))
        else:
            sd = torch.load(path / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
        V, H = sd[f"0.{L}.weight"].shape
        blocks, shared = original_blocks(sd, r"(?P<head>\d+)\.(?P<pos>\d+)\.(?P<name>linear\.(weight|bias))", n, L)
        cfg = DrafterConfig(num_heads=n, num_layers=L, hidden_size=H, vocab_size=V, grounded=False,
                            lm_head="per_head", lm_head_bias=f"0.{L}.bias" in sd, shared_resblocks=shared)
        drafter = cls(cfg)
        for i in range(n):
            fill_head(drafter, i, blocks[i])
            drafter.heads[i].lm_head.load_state_dict({k.split(".", 2)[2]: v for k, v in sd.items()
                                                      if k.startswith(f"{i}.{L}.")})
        return drafter
