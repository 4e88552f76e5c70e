"""Training an MLPSpeculator with the base model frozen (drafters/mlp_speculator.py).

Stage i (0-based) at position p runs the chain of stages from h_p (the base model's final-normed hidden
state at p) fed the true tokens x_{p+1}, ..., x_{p+1+i} (teacher forcing: stage 0 reads x_{p+1}, the
root the base model predicted from h_p) and predicts x_{p+2+i}: the paper's first training stage, and
fms-extras' MLPSpeculator.forward. The teacher is the base model's distribution for that token,
softmax(LM(h_{p+1+i})), recomputed through its LM head from the cached hidden states (as for the heads,
training/heads.py); with a draft vocabulary both distributions live on its tokens.
loss = distill_weight * KL(teacher || stage) + (1 - distill_weight) * CE(x_{p+2+i}), averaged over stages.
The paper's second stage (the base model's own generations) is this function on self-generated data
(python/self_data.py, HiddenStates.train_from to train on the answers only).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .loop import TrainingRun
from .hidden_cache import HiddenStates, compute_hidden_states


def speculator_positions(data: HiddenStates, n_predict: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions p stage 0 trains on: x_{p+2} in p's sequence and, if the data says which, teacher
    position p+1 trainable; keep bool [N, n_predict]: whether stage i trains at p)."""
    N = data.num_tokens
    keep = torch.stack([data.after >= i + 2 for i in range(n_predict)], dim=1)  # x_{p+2+i} in the sequence
    if data.trainable is not None:
        for i in range(n_predict):
            q = (torch.arange(N) + 1 + i).clamp(max=N - 1)
            keep[:, i] &= data.trainable[q]
    valid = keep[:, 0].nonzero().flatten()
    if valid.numel() == 0:
        raise ValueError("the training data has no trainable position (stage 0 needs two tokens after a position)")
    return valid, keep


def train_mlp_speculator(model, drafter, data, steps: int = 100, lr: float = 1e-3, *, positions_per_step: int = 256,
                         warmup: int = 10, weight_decay: float = 0.0, grad_clip: float = 1.0,
                         distill_weight: float = 1.0, seed: int = 0, checkpoint: str | Path | None = None,
                         checkpoint_dir: str | Path | None = None, checkpoint_every: int = 100, amp_dtype=None,
                         progress: bool = True) -> dict:
    """AdamW, linear warmup then cosine decay, gradient clipping; positions_per_step positions p drawn
    uniformly from the trainable ones, every stage trained on each (stage i where x_{p+2+i} exists and
    its teacher position is trainable). data: HiddenStates (compute_hidden_states) or token sequences.
    checkpoint / checkpoint_dir, amp_dtype: as train_drafter (a checkpoint resumes only the run that
    wrote it, named <dir>/ckpt-mlp_speculator-<fingerprint>.pt with checkpoint_dir).
    Returns {"loss": [per step], "stage_loss": [per step, per stage], "steps": steps}."""
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if getattr(drafter, "kind", None) != "mlp_speculator":
        raise ValueError(f"train_mlp_speculator trains an mlp_speculator drafter, got {getattr(drafter, 'kind', drafter)!r} "
                         "(head drafters: hk.training.train_drafter)")
    drafter.check_model(model)
    if not isinstance(data, HiddenStates):
        data = compute_hidden_states(model, data, progress=progress)
    P = drafter.n_predict
    settings = dict(steps=steps, lr=lr, positions_per_step=positions_per_step, warmup=warmup,
                    weight_decay=weight_decay, grad_clip=grad_clip, distill_weight=distill_weight, seed=seed,
                    amp_dtype=amp_dtype, scale_input=drafter.config.scale_input)
    dev, dtype = model.device, model.dtype
    valid, keep = speculator_positions(data, P)
    N = data.num_tokens
    ids = data.ids.to(dev)
    V = model.config.vocab_size
    to_draft = torch.full((V,), -100, dtype=torch.long, device=dev)  # token id -> draft index (-100: none)
    dv = drafter.draft_vocab if drafter.draft_vocab is not None else torch.arange(V, device=dev)
    to_draft[dv] = torch.arange(dv.numel(), device=dev)
    lm = model.lm_head_weight() if drafter.draft_vocab is None else model.lm_head_rows(drafter.draft_vocab)

    run = TrainingRun(model, drafter, data, settings, steps=steps, lr=lr, warmup=warmup, grad_clip=grad_clip, seed=seed,
                      weight_decay=weight_decay, history={"loss": [], "stage_loss": [], "steps": steps},
                      checkpoint=checkpoint, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
    gen, history = run.gen, run.history
    with run.steps_left("training mlp_speculator", progress) as bar:
        for step in bar:
            p = valid[torch.randint(0, valid.numel(), (positions_per_step,), generator=gen)]  # [n] cpu
            at = lambda off: (p + off).clamp(max=N - 1)  # noqa: E731 (rows past a sequence are masked below)
            k = keep[p].to(dev)  # [n, P]
            with torch.enable_grad(), torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16,
                                                     enabled=amp_dtype is not None):
                tokens = torch.stack([ids[at(1 + i).to(dev)] for i in range(P)], dim=1)  # x_{p+1+i}
                logits = drafter.chain_logits(data.hidden[p].to(dev, dtype), tokens, model)
                total, per_stage = 0.0, []
                for i in range(P):
                    rows = k[:, i].nonzero().flatten()
                    if rows.numel() == 0:
                        per_stage.append(float("nan"))
                        continue
                    log_q = F.log_softmax(logits[i][rows].float(), dim=-1)
                    loss = 0.0
                    if distill_weight > 0:
                        with torch.no_grad():
                            teacher_h = data.hidden[at(1 + i)].to(dev, dtype)[rows]
                            log_p = F.log_softmax(F.linear(teacher_h, lm).float(), dim=-1)
                        loss = distill_weight * F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
                    if distill_weight < 1:
                        tgt = to_draft[ids[at(2 + i).to(dev)][rows]]
                        if (tgt != -100).any():
                            loss = loss + (1 - distill_weight) * F.nll_loss(log_q, tgt, ignore_index=-100)
                    per_stage.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
                    total = total + loss
                total = total / max(1, sum(1 for x in per_stage if x == x))
            history["loss"].append(run.update(total))
            history["stage_loss"].append(per_stage)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", stages=" ".join(f"{v:.2f}" for v in per_stage))
            run.done(step)
    return history
