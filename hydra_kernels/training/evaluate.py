"""How well heads guess the base model: per-head ranks of its greedy tokens, top-k accuracy.

On a sequence the base model produced greedily (prompt + its own continuation), the token at p+1 is
the root the base model predicts from h_p, and head d's target is token p+2+d. Feeding the head the
real path (teacher forcing) gives, for every position, the rank of the right token in each head's
ranking: ranks[p, d]. A tree node with rank path (r_0, ..., r_d) is accepted at p exactly when
ranks[p, :d+1] == (r_0, ..., r_d), which is what tree search needs (tree_search.py).
"""
from __future__ import annotations

import torch

from .heads import head_inputs
from .hidden_cache import HiddenStates, compute_hidden_states

UNRANKED = 1 << 20  # outside the head's top max_rank, or outside its draft vocabulary


@torch.no_grad()
def head_ranks(model, drafter, sequences: list[list[int]], starts: list[int], max_rank: int = 16,
               data: HiddenStates | None = None) -> torch.Tensor:
    """sequences: base-model greedy sequences; starts[i]: first position of sequence i whose next tokens
    are the model's own (len(prompt) - 1). -> ranks int64 [n_positions, num_heads]: rank of the true
    token in head d's ranking (UNRANKED if not in its top max_rank), -1 where the sequence has ended."""
    data = data or compute_hidden_states(model, sequences, progress=False)
    if getattr(drafter, "kind", None) == "amphista":
        return _amphista_ranks(model, drafter, sequences, starts, max_rank, data)
    if getattr(drafter, "kind", None) == "mlp_speculator":
        return _speculator_ranks(model, drafter, sequences, starts, max_rank, data)
    dev, dtype = model.device, model.dtype
    ids = data.ids.to(dev)
    out, offset = [], 0
    for seq, s0 in zip(sequences, starts):
        L = len(seq)
        span = torch.arange(offset, offset + L)
        h = data.hidden[span].to(dev, dtype)
        if drafter.prefix is not None:
            h = drafter.prefix.forward_full(h[None])[0]
        pos = torch.arange(max(0, s0), L - 2)  # positions with at least the root and head 0's target after
        ranks = torch.full((pos.numel(), drafter.num_heads), -1, dtype=torch.long)
        for d in range(drafter.num_heads):
            ok = pos + 2 + d < L
            p = pos[ok]
            if p.numel() == 0:
                continue
            x = head_inputs(model, drafter, ids, h[p.to(dev)], (p + offset).to(dev), d)
            top = drafter.token_ids(drafter.logits(model, d, x).topk(max_rank, dim=-1).indices)  # [n, max_rank]
            hit = top == ids[(p + offset + 2 + d).to(dev)][:, None]
            r = torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(hit[:, 0], UNRANKED, dtype=torch.long))
            ranks[ok.nonzero().flatten(), d] = r.cpu().long()
        out.append(ranks)
        offset += L
    return torch.cat(out)


def _ranks_by_sequence(ids: torch.Tensor, sequences, starts, K: int, top_tokens) -> torch.Tensor:
    """head_ranks for drafters that rank all K heads of a sequence's positions at once: ids, the
    concatenated sequences' tokens on the drafting device; top_tokens(offset, L, pos) -> token ids [n, K, k]
    of each head's top k at positions pos (the sequence at rows offset..offset+L) -> ranks [positions, K]
    (UNRANKED outside the top k, -1 past the sequence's end)."""
    out, offset = [], 0
    for seq, s0 in zip(sequences, starts):
        L = len(seq)
        pos = torch.arange(max(0, s0), L - 2)
        ranks = torch.full((pos.numel(), K), -1, dtype=torch.long)
        if pos.numel():
            top = top_tokens(offset, L, pos)  # [n, K, k]
            target = pos[:, None] + 2 + torch.arange(K)  # [n, K] positions of head d's tokens
            hit = top == ids[offset + target.clamp(max=L - 1).to(ids.device)][..., None]
            r = torch.where(hit.any(-1), hit.float().argmax(-1).long(), UNRANKED).cpu()
            ranks = torch.where(target < L, r, -1)
        out.append(ranks)
        offset += L
    return torch.cat(out)


def _amphista_ranks(model, drafter, sequences, starts, max_rank: int, data: HiddenStates) -> torch.Tensor:
    """head_ranks for an Amphista drafter (drafters/amphista.py): its heads all read the adaptation layers'
    outputs at p, fed (h_t, x_{t+1}) for t <= p (x_{p+1}: the root), so one causal pass per sequence
    ranks every head at every position."""
    dev, dtype = model.device, model.dtype
    ids = data.ids.to(dev)
    k = min(max_rank, drafter.config.draft_vocab_size or drafter.config.vocab_size)

    def top_tokens(offset, L, pos):
        stages = drafter.adapt_full(model, data.hidden[offset: offset + L - 1].to(dev, dtype)[None],
                                    ids[offset + 1: offset + L][None])
        y = drafter.head_states([o[0, pos.to(dev)] for o in stages])  # [n, K, H]
        return drafter.token_ids(drafter.logits(model, y).topk(k, dim=-1).indices)

    return _ranks_by_sequence(ids, sequences, starts, drafter.num_heads, top_tokens)


def _speculator_ranks(model, drafter, sequences, starts, max_rank: int, data: HiddenStates) -> torch.Tensor:
    """head_ranks for an MLPSpeculator (drafters/mlp_speculator.py): stage d at p runs the chain from h_p
    fed the true tokens x_{p+1}..x_{p+1+d} (teacher forcing, chain_logits), which is the state it drafts
    from when every earlier stage guessed right: a rank path of a static tree is accepted exactly then.
    (Its own drafting keeps the best n_candidates of the per-stage top-k product instead of a fixed tree.)"""
    dev, dtype = model.device, model.dtype
    ids = data.ids.to(dev)
    P = drafter.n_predict
    k = min(max_rank, drafter.config.draft_vocab_size or drafter.config.vocab_size)

    def top_tokens(offset, L, pos):
        at = lambda off: ids[offset + (pos + off).clamp(max=L - 1).to(dev)]  # noqa: E731 (past the end: masked)
        tokens = torch.stack([at(1 + d) for d in range(P)], dim=1)  # [n, P] x_{p+1+d}
        logits = drafter.chain_logits(data.hidden[offset + pos].to(dev, dtype), tokens, model)
        return torch.stack([drafter.token_ids(lg.topk(k, dim=-1).indices) for lg in logits], dim=1)

    return _ranks_by_sequence(ids, sequences, starts, P, top_tokens)


def split_ranks(ranks: torch.Tensor, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """head_ranks' rows, one block per sequence again (sequence i: positions starts[i] .. len - 3)."""
    return list(torch.split(ranks, [max(0, len(s) - 2 - max(0, s0)) for s, s0 in zip(sequences, starts)]))


def topk_accuracy(ranks: torch.Tensor, ks=(1, 5, 10)) -> list[dict]:
    """Per head: fraction of positions where the true token is in its top-k (positions it can see)."""
    rows = []
    for d in range(ranks.shape[1]):
        r = ranks[:, d]
        r = r[r >= 0]
        rows.append({"head": d + 1, "positions": int(r.numel()),
                     **{f"top{k}": float((r < k).float().mean()) if r.numel() else float("nan") for k in ks}})
    return rows
