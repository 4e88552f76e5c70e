"""Training EAGLE's draft layer with the base model frozen (EAGLE-1's losses, EAGLE-3's training-time test).

Data: HiddenStates (the base model's final-normed features f and token ids x of whole sequences; for an
EAGLE-3 layer also the residual streams g entering its feature layers, HiddenStates.captured).
Unroll step 1 is EAGLE-1: at position t the layer reads fc(cat(E(x_{t+1}), f_t + noise)) causally over
the sequence and predicts f_{t+1}. Unroll step s >= 2 is what drafting at tree depth s-1 sees: the input
feature at t is step s-1's prediction at t-1 (the draft's own guess of f_t), and the query attends to
the true-feature keys of positions <= t-s+1 (the committed prefix) plus the keys of steps u = 2..s at
positions t-s+u (its ancestors in the tree, itself last): exactly the rows a depth-(s-1) node sees.
Every step's prediction at t is trained toward f_{t+1}:
    loss = feature_weight * SmoothL1(y, f_{t+1}) + token_weight * KL(softmax(LM f_{t+1}) || softmax(LM y))
the token term on the draft vocabulary through the base model's frozen LM head, at `loss_positions`
sampled positions per step (the LM head is most of the cost); the feature term at every position.
EAGLE-3 (drafter.feature_layers set): step 1 reads fc(g_t) instead of f_t, and its prediction is not a base
feature (no feature term): loss = token_weight * KL(softmax(LM f_{t+1}) || softmax(LM' norm(y))), LM' being the
layer's own LM head over the draft vocabulary (trained with it), the teacher still the base model's rows.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .heads import _sequence_bounds
from .loop import TrainingRun
from .hidden_cache import HiddenStates


class _Windows:
    """Per step, `seqs` windows of at most `window` tokens, drawn by trainable positions (a sequence
    with more trained tokens is drawn more often; a window starts uniformly inside it)."""

    def __init__(self, data: HiddenStates, seqs: int, window: int, gen: torch.Generator):
        self.data, self.seqs, self.window, self.gen = data, seqs, window, gen
        self.starts, self.ends = _sequence_bounds(data)
        trainable = data.trainable if data.trainable is not None else torch.ones(data.num_tokens, dtype=torch.bool)
        seq_of = torch.repeat_interleave(torch.arange(self.starts.numel()), self.ends - self.starts)
        self.weight = torch.bincount(seq_of[trainable], minlength=self.starts.numel()).double()
        if self.weight.sum() == 0:
            raise ValueError("the training data has no trainable position")
        self.trainable = trainable

    def sample(self):
        """-> ids [S, L], feats [S, L, H] (bf16/fp32 as stored), train [S, L] bool (position q's token
        q+1 is trained: q in a trained span, q+1 inside the window), lengths [S], captured [S, L, n*H]
        (the data's captured streams, EAGLE-3's features; None without)."""
        d = self.data
        seqs = torch.multinomial(self.weight, self.seqs, replacement=True, generator=self.gen).tolist()
        spans = []
        for s in seqs:
            a, b = int(self.starts[s]), int(self.ends[s])
            if b - a > self.window:
                a = a + int(torch.randint(0, b - a - self.window + 1, (1,), generator=self.gen))
                b = a + self.window
            spans.append((a, b))
        L = max(b - a for a, b in spans)
        ids = torch.zeros(len(spans), L, dtype=torch.long)
        feats = torch.zeros(len(spans), L, d.hidden.shape[1], dtype=d.hidden.dtype)
        train = torch.zeros(len(spans), L, dtype=torch.bool)
        cap = None if d.captured is None else torch.zeros(len(spans), L, d.captured.shape[1], dtype=d.captured.dtype)
        for i, (a, b) in enumerate(spans):
            ids[i, : b - a] = d.ids[a:b]
            feats[i, : b - a] = d.hidden[a:b]
            train[i, : b - a - 1] = self.trainable[a: b - 1]
            if cap is not None:
                cap[i, : b - a] = d.captured[a:b]
        return ids, feats, train, torch.tensor([b - a for a, b in spans]), cap


def unrolled_features(layer, x1: torch.Tensor, fuse_next, unroll: int) -> list[torch.Tensor]:
    """x1 [S, L, H] step-1 inputs (true features); fuse_next(y_prev [S, L, H]) -> the next step's inputs
    (the previous step's predictions shifted one position right, fused with the same next tokens).
    Returns the predictions [S, L, H] of steps 1..unroll (row t of step s is valid for t >= s-1)."""
    S, L, _ = x1.shape
    dev = x1.device
    pos = torch.arange(L, device=dev)
    q1, k1, v1 = layer.qkv(x1, pos.expand(S, L), L)
    causal = pos[None, :] <= pos[:, None]  # [L, L]
    ys = [layer.attend(x1, q1, k1, v1, causal.expand(S, L, L))]
    keys, values = [k1], [v1]
    for s in range(2, unroll + 1):
        x = fuse_next(ys[-1])
        q, k, v = layer.qkv(x, pos.expand(S, L), L)
        keys.append(k)
        values.append(v)
        blocks = [pos[None, :] <= pos[:, None] - s + 1]  # true-feature keys: the committed prefix
        blocks += [pos[None, :] == pos[:, None] - s + u for u in range(2, s + 1)]  # ancestors, then itself
        mask = torch.cat(blocks, dim=1)  # [L, s*L]; every row sees at least itself (u = s)
        ys.append(layer.attend(x, q, torch.cat(keys, 1), torch.cat(values, 1), mask.expand(S, L, s * L)))
    return ys


def fuse_next_inputs(layer, emb: torch.Tensor):
    """emb [S, L, H] = E(x_{t+1}) per row t -> fuse_next for unrolled_features: step s's input at t is step
    s-1's prediction at t-1 (row 0 repeats its own) fused with the same next token."""
    return lambda y: layer.fuse_node(emb, torch.cat((y[:, :1], y[:, :-1]), dim=1))


def train_eagle(model, drafter, data: HiddenStates, steps: int = 400, lr: float = 1e-3, *, seqs_per_step: int = 8,
                window: int = 256, loss_positions: int = 384, unroll: int = 3, noise: float = 0.1,
                feature_weight: float | None = None, token_weight: float = 1.0, warmup: int = 20,
                grad_clip: float = 0.5, seed: int = 0, checkpoint_dir: str | Path | None = None,
                checkpoint_every: int = 50, progress: bool = True) -> dict:
    """AdamW, linear warmup then cosine decay. noise: uniform noise on the step-1 input features, as a
    fraction of each feature vector's RMS (EAGLE's robustness to its own errors; per captured layer for
    EAGLE-3). feature_weight: None is 1.0 for EAGLE-1/2 and 0 (no feature term) for EAGLE-3. Resumable:
    the checkpoint <checkpoint_dir>/ckpt-eagle-<fingerprint>.pt is named by run_fingerprint.
    Returns {"loss": [...], "step_loss": [[per unroll step]...], "accuracy": [[top-1 vs base, per unroll step]...]}."""
    if unroll < 1 or seqs_per_step < 1 or window < 3 or loss_positions < 1:
        raise ValueError("unroll, seqs_per_step and loss_positions must be >= 1 and window >= 3")
    eagle3 = drafter.feature_layers is not None
    if eagle3:
        if feature_weight not in (None, 0):
            raise ValueError("an EAGLE-3 layer's prediction is not a base-model feature: it trains on the token "
                             "loss alone (leave feature_weight out)")
        if data.captured is None or tuple(data.capture or ()) != drafter.feature_layers:
            raise ValueError(f"an EAGLE-3 drafter reads the inputs of base layers {list(drafter.feature_layers)}: "
                             f"compute the data with compute_hidden_states(..., capture={list(drafter.feature_layers)}) "
                             f"(this data captured {None if data.capture is None else list(data.capture)})")
        feature_weight = 0.0
    elif feature_weight is None:
        feature_weight = 1.0
    settings = dict(steps=steps, lr=lr, seqs_per_step=seqs_per_step, window=window, loss_positions=loss_positions,
                    unroll=unroll, noise=noise, feature_weight=feature_weight, token_weight=token_weight,
                    warmup=warmup, grad_clip=grad_clip, seed=seed)
    dev, dtype = model.device, model.dtype
    run = TrainingRun(model, drafter, data, settings, steps=steps, lr=lr, warmup=warmup, grad_clip=grad_clip, seed=seed,
                      history={"loss": [], "step_loss": [], "accuracy": []}, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every)
    gen, history = run.gen, run.history
    windows = _Windows(data, seqs_per_step, window, gen)
    layer, H = drafter.layer, model.config.hidden_size
    with run.steps_left("training eagle", progress) as bar:
        for step in bar:
            ids, feats, train, lengths, captured = windows.sample()
            ids, feats, train = ids.to(dev), feats.to(dev, dtype), train.to(dev)
            with torch.enable_grad():
                emb = model.tok_embeddings(ids[:, 1:])  # E(x_{t+1}) [S, L-1, H]
                f_in = (captured.to(dev, dtype) if eagle3 else feats)[:, :-1]  # [S, L-1, n*H]
                blocks = f_in.unflatten(-1, (-1, H))  # [S, L-1, n, H]: one RMS per feature layer
                if noise:  # drawn on the CPU generator (the run's one stream, checkpointed with it)
                    rms = blocks.pow(2).mean(-1, keepdim=True).sqrt()
                    u = torch.rand(blocks.shape, generator=gen).to(dev, dtype)
                    blocks = blocks + (u - 0.5) * 2 * noise * rms
                x1 = layer.fuse(emb, blocks.flatten(-2))
                ys = unrolled_features(layer, x1, fuse_next_inputs(layer, emb), unroll)
                target = feats[:, 1:]  # f_{t+1}
                W = drafter.base_lm_rows(model)  # the teacher: the base model's rows of the draft vocabulary
                total, per_step, acc = 0.0, [], []
                t_idx = torch.arange(ids.shape[1] - 1, device=dev)
                for s, y in enumerate(ys, start=1):
                    # [S, L-1]: teacher position q = t+1 trained (so f_{t+1} and x_{t+2} lie in the window)
                    ok = train[:, 1:] & (t_idx >= s - 1)
                    pos = ok.nonzero()
                    if pos.shape[0] == 0:
                        continue
                    pick = pos[torch.randperm(pos.shape[0], generator=gen)[:loss_positions].to(dev)]
                    with torch.no_grad():
                        log_p = F.log_softmax(F.linear(target[pick[:, 0], pick[:, 1]], W).float(), dim=-1)
                    log_q = drafter.draft_log_probs(model, y[pick[:, 0], pick[:, 1]])
                    loss = token_weight * F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
                    if feature_weight:
                        y_ok, t_ok = y[pos[:, 0], pos[:, 1]], target[pos[:, 0], pos[:, 1]]
                        loss = loss + feature_weight * F.smooth_l1_loss(y_ok.float(), t_ok.float())
                    total = total + loss / len(ys)
                    per_step.append(float(loss.detach()))
                    acc.append(float((log_q.argmax(-1) == log_p.argmax(-1)).float().mean()))
            history["loss"].append(run.update(total))
            history["step_loss"].append(per_step)
            history["accuracy"].append(acc)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", acc=" ".join(f"{a:.2f}" for a in acc))
            run.done(step)
    return history


@torch.no_grad()
def agreement(model, drafter, sequences: list[list[int]], starts: list[int], unroll: int = 3) -> list[float]:
    """Teacher-forced top-1 agreement with the base model per draft depth 1..unroll, on whole sequences:
    the fraction of positions q >= starts[i] (q predicts token q+1; starts as self_data_sequences gives
    them) where a depth-d draft node's top token (its ancestors the true tokens, fed the draft's own
    predicted features, exactly as drafting does: unrolled_features) is the base model's greedy token
    over the whole vocabulary (a token outside the draft vocabulary counts as a miss). Run it on text the
    layer never trained on: the training log's agreement is over training windows, and on 2048 answers
    the two differed by ~2x (benchmarks/results/README.md, 2026-11-25)."""
    hits = torch.zeros(unroll, dtype=torch.float64)
    counts = torch.zeros(unroll, dtype=torch.float64)
    layer, dev, fl = drafter.layer, model.device, drafter.feature_layers
    for seq, start in zip(sequences, starts):
        if len(seq) < 3:
            continue
        ids = torch.tensor([seq], device=dev)
        if fl is None:
            feats = inputs = model.hidden_states(ids)  # [1, L, H]: f_q predicts token q+1
        else:  # EAGLE-3 reads the streams entering its feature layers
            feats, inputs = model.hidden_states(ids, capture=fl)
        emb = model.tok_embeddings(ids[:, 1:])
        ys = unrolled_features(layer, layer.fuse(emb, inputs[:, :-1]), fuse_next_inputs(layer, emb), unroll)
        greedy = model.output(feats[0, 1:]).argmax(-1)  # row t: the base's token after q = t+1
        t = torch.arange(len(seq) - 1, device=dev)
        for k, y in enumerate(ys):  # unroll step k+1 at row t drafts depth k+1 from committed rows < t-k
            ok = (t + 1 >= start) & (t >= k)
            pred = drafter.token_ids(drafter.draft_log_probs(model, y[0]).argmax(-1))
            hits[k] += (pred == greedy)[ok].sum().item()
            counts[k] += ok.sum().item()
    return (hits / counts.clamp(min=1)).tolist()
