"""Training draft heads with the base model frozen: distillation from the base model (Hydra++).

Head d (0-based) at position p proposes token p+2+d. Its input is h_p (the base model's final-normed
hidden state at p, through the prefix layer for Hydra++) for Medusa, and
cat(h_p, E(x_{p+1}), ..., E(x_{p+1+d})) for Hydra -- exactly what drafting feeds it, since x_{p+1} is
the root the base model predicted from h_p. The teacher is the base model's distribution for that same
token, softmax(LM(H_{p+1+d})), recomputed from the cached hidden state H; with a draft vocabulary both
distributions live on its Vd tokens (the teacher's restricted softmax is exactly its renormalised
distribution there). loss = distill_weight * KL(teacher || head) + (1 - distill_weight) * CE(x_{p+2+d}).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .hidden_cache import HiddenStates, compute_hidden_states
from .loop import TrainingRun, run_fingerprint  # noqa: F401 (run_fingerprint: its old home)


def head_inputs(model, drafter, ids: torch.Tensor, h_rows: torch.Tensor, positions: torch.Tensor, head: int):
    """ids [N] token ids, positions [n] (each with at least head+1 tokens after it in its sequence),
    h_rows [n, H] drafter-side hidden states at those positions -> head `head`'s inputs [n, in_features]."""
    if not drafter.config.grounded:
        return h_rows
    return torch.cat([h_rows] + [model.tok_embeddings(ids[positions + 1 + j]) for j in range(head + 1)], dim=-1)


def _sequence_bounds(data: HiddenStates) -> tuple[torch.Tensor, torch.Tensor]:
    ends = (data.after == 0).nonzero().flatten() + 1
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends


class _Batcher:
    """Which teacher positions q one step trains on, and the drafter-side hidden states.

    Head d learns token q+1 from position p = q-1-d, so one teacher distribution (at q) serves every
    head: the teacher's LM-head matmul is done once per step, not once per head. Without a prefix
    layer, q is uniform over the whole data and h is the cached base state. With one (Hydra++), the
    prefix layer attends over each sequence's past, so positions come from `seqs_per_step` sequences,
    each drawn with probability proportional to its trainable positions, positions/seqs_per_step
    positions from each (q again nearly uniform over the data). Only the rows the heads read go through
    the layer's attention output and MLP (PrefixLayer.forward_at; keys and values cover the whole past),
    which makes many sequences per step affordable: measured at step 200 of 1600 (4096 self-generated
    answers, 512 positions), a frozen identity prefix layer -- Hydra's own model -- trained on 6 whole
    sequences per step reached a loss of 5.2 against 3.3 for positions drawn from the whole data: positions
    of a few sequences are too alike for a step."""

    def __init__(self, data: HiddenStates, drafter, positions: int, seqs_per_step: int, gen: torch.Generator):
        self.data, self.drafter, self.n, self.k, self.gen = data, drafter, positions, seqs_per_step, gen
        self.starts, self.ends = _sequence_bounds(data)
        lengths = self.ends - self.starts
        self.before = torch.arange(data.num_tokens) - torch.repeat_interleave(self.starts, lengths)
        ok = self.before >= 1  # q needs p = q-1 in its sequence at least
        if data.trainable is not None:
            ok &= data.trainable
        self.valid = ok.nonzero().flatten()
        self.ok = ok
        if self.valid.numel() == 0:
            raise ValueError("the training data has no trainable position (one needs a token before it in its sequence)")
        seq_of = torch.repeat_interleave(torch.arange(self.starts.numel()), lengths)
        self.seq_weight = torch.bincount(seq_of[self.valid], minlength=self.starts.numel()).double()

    def sample(self, device, dtype):
        """-> q [n] (cpu), hidden(p [m] cpu) -> [m, H] drafter-side states at positions p."""
        d = self.data
        if self.drafter.prefix is None:
            q = self.valid[torch.randint(0, self.valid.numel(), (self.n,), generator=self.gen)]
            return q, lambda p: d.hidden[p].to(device, dtype)
        seqs = torch.multinomial(self.seq_weight, self.k, replacement=True, generator=self.gen).tolist()
        per_seq = -(-self.n // self.k)
        qs, need = [], []
        for s in seqs:
            span = torch.arange(int(self.starts[s]), int(self.ends[s]))
            ok = span[self.ok[span]]  # not empty: a drawn sequence holds a trainable position
            q = ok[torch.randint(0, ok.numel(), (per_seq,), generator=self.gen)]
            p = (q[:, None] - 1 - torch.arange(self.drafter.num_heads)).flatten()  # rows head d reads
            qs.append(q)
            need.append(p[p >= int(self.starts[s])].unique())  # sorted
        m = max(r.numel() for r in need)
        L = max(int(r[-1] - self.starts[s]) + 1 for r, s in zip(need, seqs))  # the past the rows attend to
        x = torch.zeros(len(seqs), L, d.hidden.shape[1], dtype=dtype, device=device)
        local = torch.zeros(len(seqs), m, dtype=torch.long)  # row positions within their sequence (pad: 0)
        for i, (r, s) in enumerate(zip(need, seqs)):
            n = int(r[-1] - self.starts[s]) + 1
            x[i, :n] = d.hidden[int(self.starts[s]): int(self.starts[s]) + n].to(device, dtype)
            local[i, : r.numel()] = r - self.starts[s]
        out = self.drafter.prefix.forward_at(x, local.to(device)).flatten(0, 1)  # [k*m, H]
        # data position -> row of out, looked up by binary search (a sequence drawn twice gives a position two
        # rows; they hold equal values, either serves)
        positions, order = torch.cat(need).sort()
        rows = torch.cat([torch.arange(i * m, i * m + r.numel()) for i, r in enumerate(need)])[order]
        return torch.cat(qs), lambda p: out[rows[torch.searchsorted(positions, p)].to(device)]


def train_drafter(model, drafter, data, steps: int = 100, lr: float = 1e-3, *, positions_per_step: int = 256,
                  seqs_per_step: int = 32, warmup: int = 10, weight_decay: float = 0.0, grad_clip: float = 1.0,
                  distill_weight: float = 1.0, prefix_lr_scale: float = 1.0, seed: int = 0,
                  checkpoint: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                  checkpoint_every: int = 100, amp_dtype=None, progress: bool = True) -> dict:
    """AdamW, linear warmup then cosine decay, gradient clipping. data: HiddenStates
    (compute_hidden_states) or token sequences (their hidden states are computed here).
    checkpoint: a file; written every checkpoint_every steps and at the end, and resumed from if it
    exists -- only if the same run wrote it (run_fingerprint: same model, drafter shape, draft
    vocabulary, data and settings), else a ValueError before any step. checkpoint_dir instead: the file
    is <dir>/ckpt-<kind>-<fingerprint>.pt, so another run (new data, other settings) starts afresh
    beside it rather than colliding. amp_dtype: torch.bfloat16 to run the heads under autocast (GPU).
    prefix_lr_scale: the Hydra++ prefix layer's learning rate as a fraction of lr (it starts from the base
    model's last layer; measured, 0.1 trained no better than 1 on the self-generated answers).
    Returns {"loss": [per step], "head_loss": [per step, per head], "steps": steps}."""
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if prefix_lr_scale < 0:
        raise ValueError(f"prefix_lr_scale must be >= 0, got {prefix_lr_scale}")
    if checkpoint is not None and checkpoint_dir is not None:
        raise ValueError("pass checkpoint (a file) or checkpoint_dir (a folder), not both")
    if not isinstance(data, HiddenStates):
        data = compute_hidden_states(model, data, progress=progress)
    settings = dict(steps=steps, lr=lr, positions_per_step=positions_per_step, seqs_per_step=seqs_per_step,
                    warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip, distill_weight=distill_weight,
                    seed=seed, amp_dtype=amp_dtype)
    if drafter.prefix is not None:  # checkpoints from the older whole-sequence batches are not resumed
        settings.update(prefix_batches="rows of sequences drawn by trainable positions", prefix_lr_scale=prefix_lr_scale)
    dev, dtype = model.device, model.dtype
    params = [p for p in drafter.parameters() if p.requires_grad]
    in_prefix = {id(p) for p in drafter.prefix.parameters()} if drafter.prefix is not None else set()
    groups = [{"params": [p for p in params if id(p) not in in_prefix], "lr": lr},
              {"params": [p for p in params if id(p) in in_prefix], "lr": lr * prefix_lr_scale}]
    run = TrainingRun(model, drafter, data, settings, steps=steps, lr=lr, warmup=warmup, grad_clip=grad_clip, seed=seed,
                      weight_decay=weight_decay, param_groups=[g for g in groups if g["params"]],
                      history={"loss": [], "head_loss": [], "steps": steps}, checkpoint=checkpoint,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
    batcher = _Batcher(data, drafter, positions_per_step, seqs_per_step, run.gen)
    ids = data.ids.to(dev)
    V = model.config.vocab_size
    to_draft = torch.full((V,), -100, dtype=torch.long, device=dev)  # token id -> draft index (-100: none)
    dv = drafter.draft_vocab if drafter.draft_vocab is not None else torch.arange(V, device=dev)
    to_draft[dv] = torch.arange(dv.numel(), device=dev)
    history = run.history
    with run.steps_left(f"training {drafter.kind} heads", progress) as bar:
        for step in bar:
            with torch.enable_grad(), torch.autocast(dev.type, dtype=amp_dtype or torch.bfloat16,
                                                     enabled=amp_dtype is not None):
                q, hidden_at = batcher.sample(dev, dtype)
                if distill_weight > 0:  # teacher log-probs for token q+1, shared by all heads
                    with torch.no_grad():
                        teacher_h = data.hidden[q].to(dev, dtype)
                        log_p = F.log_softmax(F.linear(teacher_h, drafter.tied_lm_weight(model)).float(), dim=-1)
                if distill_weight < 1:
                    nxt = torch.where(data.after[q] >= 1, ids[(q + 1).clamp(max=data.num_tokens - 1)].cpu(), 0).to(dev)
                    tgt = torch.where((data.after[q] >= 1).to(dev), to_draft[nxt], -100)
                total, per_head = 0.0, []
                for d in range(drafter.num_heads):
                    keep = (batcher.before[q] >= d + 1).nonzero().flatten()  # p = q-1-d inside q's sequence
                    if keep.numel() == 0:
                        continue
                    p = q[keep] - 1 - d
                    x = head_inputs(model, drafter, ids, hidden_at(p), p.to(dev), d)
                    log_q = F.log_softmax(drafter.logits(model, d, x).float(), dim=-1)
                    loss = 0.0
                    if distill_weight > 0:
                        loss = distill_weight * F.kl_div(log_q, log_p[keep.to(dev)], log_target=True, reduction="batchmean")
                    if distill_weight < 1 and (tgt[keep.to(dev)] != -100).any():
                        loss = loss + (1 - distill_weight) * F.nll_loss(log_q, tgt[keep.to(dev)], ignore_index=-100)
                    per_head.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
                    total = total + loss
                total = total / max(1, len(per_head))
            history["loss"].append(run.update(total))
            history["head_loss"].append(per_head)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", heads=" ".join(f"{l:.2f}" for l in per_head))
            run.done(step)
    return history

