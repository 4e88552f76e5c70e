"""Training an Amphista drafter (drafters/amphista.py) with the base model frozen.

Data: HiddenStates (the base model's final-normed hidden states h and token ids x of whole sequences).
Each step draws windows of whole sequences (training/eagle.py's _Windows) and runs the two adaptation
layers causally over every window position p, fed (h_p, x_{p+1}) as drafting feeds them (x_{p+1} is the
root at the last committed position p). At `loss_positions` sampled positions all K heads run (per-head
ResBlocks, the bi-directional block across the K heads, the LM head): head d at p proposes x_{p+2+d}, and
is trained toward the base model's distribution for that token, softmax(LM(h_{p+1+d})) recomputed from
the cached hidden states on the draft vocabulary, plus a weighted cross-entropy on the true token:
    loss_d = KL(teacher || head d) + ce_weight * CE(x_{p+2+d}),   loss = mean over heads.
A head trains at p only when its teacher position p+1+d is trainable (HiddenStates.trainable) and inside
the window.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .eagle import _Windows
from .loop import TrainingRun
from .hidden_cache import HiddenStates


def train_amphista(model, drafter, data: HiddenStates, steps: int = 400, lr: float = 1e-3, *, seqs_per_step: int = 8,
                   window: int = 256, loss_positions: int = 256, ce_weight: float = 0.1, warmup: int = 20,
                   weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
                   checkpoint_dir: str | Path | None = None, checkpoint_every: int = 50, amp_dtype=None,
                   progress: bool = True) -> dict:
    """AdamW, linear warmup then cosine decay, gradient clipping. Per step `seqs_per_step` windows of at most
    `window` tokens; the heads' losses at `loss_positions` positions drawn among those where some head trains.
    amp_dtype: torch.bfloat16 to run the drafter under autocast (GPU). Resumable: the checkpoint
    <checkpoint_dir>/ckpt-amphista-<fingerprint>.pt is named by run_fingerprint (same model, drafter shape,
    draft vocabulary, data and settings), written every checkpoint_every steps and at the end.
    Returns {"loss": [per step], "head_loss": [[per head]...], "accuracy": [[top-1 agreement with the base
    model, per head]...], "steps": steps}; a head without a trained position in a step gets nan."""
    if getattr(drafter, "kind", None) != "amphista":
        raise ValueError(f"train_amphista trains an amphista drafter, got {getattr(drafter, 'kind', drafter)!r}")
    if seqs_per_step < 1 or loss_positions < 1 or window < 3:
        raise ValueError("seqs_per_step and loss_positions must be >= 1 and window >= 3")
    if ce_weight < 0:
        raise ValueError(f"ce_weight must be >= 0, got {ce_weight}")
    if not isinstance(data, HiddenStates):
        raise ValueError("data must be HiddenStates (hk.training.compute_hidden_states)")
    drafter.check_model(model)
    settings = dict(steps=steps, lr=lr, seqs_per_step=seqs_per_step, window=window, loss_positions=loss_positions,
                    ce_weight=ce_weight, warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
                    amp_dtype=amp_dtype, stage_split=drafter.config.stage_split)
    dev, dtype = model.device, model.dtype
    K = drafter.num_heads
    run = TrainingRun(model, drafter, data, settings, steps=steps, lr=lr, warmup=warmup, grad_clip=grad_clip, seed=seed,
                      weight_decay=weight_decay, history={"loss": [], "head_loss": [], "accuracy": [], "steps": steps},
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
    gen, history = run.gen, run.history
    windows = _Windows(data, seqs_per_step, window, gen)
    V = model.config.vocab_size
    to_draft = torch.full((V,), -100, dtype=torch.long, device=dev)  # token id -> draft index (-100: none)
    dv = drafter.draft_vocab if drafter.draft_vocab is not None else torch.arange(V, device=dev)
    to_draft[dv] = torch.arange(dv.numel(), device=dev)

    heads = torch.arange(K)
    with run.steps_left("training amphista", progress) as bar:
        for step in bar:
            ids, feats, train, *_ = windows.sample()  # [S, L], [S, L, H], [S, L]
            S, L = ids.shape
            # head d at p trains when its teacher position q = p+1+d is trained (then x_{q+1} is in the window)
            q = torch.arange(L - 1)[:, None] + 1 + heads  # [L-1, K]
            valid = torch.where(q < L, train[:, q.clamp(max=L - 1)], False)  # [S, L-1, K]
            cand = valid.any(-1).nonzero()  # [m, 2] (window, p)
            pick = cand[torch.randperm(cand.shape[0], generator=gen)[:loss_positions]]
            ps, pp = pick[:, 0], pick[:, 1]
            keep = valid[ps, pp].to(dev)  # [n, K]
            qi = (pp[:, None] + 1 + heads).clamp(max=L - 1)  # [n, K] teacher positions
            tgt_tok = ids[ps[:, None], (qi + 1).clamp(max=L - 1)].to(dev)  # x_{p+2+d}
            ids, feats = ids.to(dev), feats.to(dev, dtype)
            with torch.enable_grad(), torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16,
                                                     enabled=amp_dtype is not None):
                stages = drafter.adapt_full(model, feats[:, :-1], ids[:, 1:])  # position p reads (h_p, x_{p+1})
                y = drafter.head_states([o[ps.to(dev), pp.to(dev)] for o in stages])  # [n, K, H]
                log_q = F.log_softmax(drafter.logits(model, y).float(), dim=-1)  # [n, K, Vd]
                with torch.no_grad():
                    teacher_h = feats[ps.to(dev)[:, None], qi.to(dev)]  # [n, K, H]
                    log_p = F.log_softmax(F.linear(teacher_h, drafter.tied_lm_weight(model)).float(), dim=-1)
                tgt = to_draft[tgt_tok]
                total, per_head, acc, n_heads = 0.0, [], [], 0
                for d in range(K):
                    rows = keep[:, d].nonzero().flatten()
                    if rows.numel() == 0:
                        per_head.append(float("nan"))
                        acc.append(float("nan"))
                        continue
                    lq, lp = log_q[rows, d], log_p[rows, d]
                    loss = F.kl_div(lq, lp, log_target=True, reduction="batchmean")
                    t = tgt[rows, d]
                    if ce_weight > 0 and (t != -100).any():
                        loss = loss + ce_weight * F.nll_loss(lq, t, ignore_index=-100)
                    per_head.append(float(loss.detach()))
                    acc.append(float((lq.argmax(-1) == lp.argmax(-1)).float().mean()))
                    total = total + loss
                    n_heads += 1
                total = total / max(1, n_heads)
            history["loss"].append(run.update(total))
            history["head_loss"].append(per_head)
            history["accuracy"].append(acc)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", acc=" ".join(f"{a:.2f}" for a in acc))
            run.done(step)
    return history
