"""Training draft heads on token sequences with the base model frozen.

Targets: head d (0-based) at position t predicts token t+2+d. Its input is h_t (the base model's
final-normed hidden state at t, through the prefix layer for Hydra++) for Medusa, and
cat(h_t, E(x_{t+1}), ..., E(x_{t+1+d})) for Hydra -- exactly what drafting feeds it, since x_{t+1}
is the root the base model predicted from h_t. Trained on the base model's own greedy output, the
next-token loss is distillation of its argmax.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def head_training_pairs(model, drafter, ids: torch.Tensor, h: torch.Tensor, head: int, positions: torch.Tensor):
    """ids [L], h [L, H] (drafter-side hidden states), positions [N] with t + 2 + head < L ->
    (head inputs [N, in_features], targets [N])."""
    if drafter.config.grounded:
        parts = [h[positions]] + [model.tok_embeddings(ids[positions + 1 + j]) for j in range(head + 1)]
        x = torch.cat(parts, dim=-1)
    else:
        x = h[positions]
    return x, ids[positions + 2 + head]


def train_drafter(model, drafter, sequences: list[list[int]], steps: int = 100, lr: float = 1e-3,
                  positions_per_step: int = 64, warmup: int = 10, weight_decay: float = 0.0, grad_clip: float = 1.0,
                  seed: int = 0, progress: bool = True) -> list[float]:
    """AdamW with warmup + cosine decay and gradient clipping; each step takes one sequence (round
    robin) and `positions_per_step` random positions per head. Returns the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    dev = model.device
    data = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor(seq, device=dev)
            data.append((ids, model.hidden_states(ids[None])[0]))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model_grad = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    drafter.train()
    losses = []
    try:
        bar = tqdm(range(steps), desc=f"training {drafter.kind} heads", disable=not progress)
        for step in bar:
            ids, base_h = data[step % len(data)]
            with torch.enable_grad():
                h = drafter.prefix.forward_full(base_h[None])[0] if drafter.prefix is not None else base_h
                loss, per_head = 0.0, []
                for d in range(drafter.num_heads):
                    n_valid = ids.shape[0] - 2 - d
                    if n_valid <= 0:
                        continue
                    pos = torch.randint(0, n_valid, (min(positions_per_step, n_valid),), generator=gen).to(dev)
                    x, y = head_training_pairs(model, drafter, ids, h, d, pos)
                    l = F.cross_entropy(drafter.logits(model, d, x).float(), y)
                    per_head.append(l.item())
                    loss = loss + l
                loss = loss / max(1, len(per_head))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
                opt.step()
                sched.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", heads=" ".join(f"{l:.2f}" for l in per_head))
    finally:
        drafter.eval()
        for p, g in zip(model.parameters(), model_grad):
            p.requires_grad_(g)
    return losses
