"""The base model's hidden states over training text, computed once and kept (Hydra++'s recipe).

Teacher targets are the base model's next-token distributions; storing those (49k floats a token)
is out of the question, so we keep its final-normed hidden states (H floats a token, bf16) and
recompute teacher logits through the LM head when a batch needs them. One causal forward per sequence
on the CPU, batches of similar length on a GPU; shards of sequences are written as they finish, so an
interrupted build resumes.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


@dataclass
class HiddenStates:
    """Concatenated sequences: ids [N] token ids, hidden [N, H] base hidden states (position p's state
    predicts token p+1), after [N] = how many tokens of p's own sequence follow p."""

    ids: torch.Tensor
    hidden: torch.Tensor
    after: torch.Tensor
    # bool [N] or None (all): teacher positions q whose next token (q+1) the heads are trained on,
    # e.g. only the answers of self-generated data (prompts are text the heads never draft)
    trainable: torch.Tensor | None = None
    # [N, n * H] or None: the residual streams entering the base layers `capture` (EAGLE-3's features)
    captured: torch.Tensor | None = None
    capture: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    @property
    def num_sequences(self) -> int:
        return int((self.after == 0).sum())

    def valid_positions(self, lookahead: int) -> torch.Tensor:
        """Positions p with at least `lookahead` tokens after them in their sequence."""
        return (self.after >= lookahead).nonzero().flatten()

    def to(self, device) -> "HiddenStates":
        t = None if self.trainable is None else self.trainable.to(device)
        c = None if self.captured is None else self.captured.to(device)
        return HiddenStates(self.ids.to(device), self.hidden.to(device), self.after.to(device), t, c, self.capture)

    def train_from(self, starts: list[int]) -> "HiddenStates":
        """Train only on positions q >= starts[i] of sequence i (q predicts token q+1): for a prompt of
        n tokens and its answer, starts[i] = n - 1 trains on the answer tokens alone."""
        ends = (self.after == 0).nonzero().flatten() + 1
        if len(starts) != ends.numel():
            raise ValueError(f"{len(starts)} starts for {ends.numel()} sequences")
        seq_start = torch.cat([ends.new_zeros(1), ends[:-1]])
        offset = torch.arange(self.num_tokens) - torch.repeat_interleave(seq_start, ends - seq_start)
        first = torch.repeat_interleave(torch.tensor(starts), ends - seq_start)
        return HiddenStates(self.ids, self.hidden, self.after, offset >= first, self.captured, self.capture)


def _after(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n - 1, -1, -1) for n in lengths])


def _model_key(model, dtype, capture=None) -> str:
    """Which model, storage dtype and captured layers: the config and a cheap weight sample."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_hf_dict(include_extra=False), sort_keys=True, default=str).encode())
    h.update(model.lm_head_weight().detach().flatten()[:4096].float().cpu().numpy().tobytes())
    h.update(str(dtype).encode())
    if capture is not None:  # the folder of a run without capture keeps its old name
        h.update(f"capture={list(capture)}".encode())
    return h.hexdigest()[:16]


def _shard_key(chunk: list[list[int]]) -> str:
    """Which sequences, in order: a shard's file is named by its content, so a data set that grows
    (e.g. 2048 -> 4096 self-generated answers, the old ones first) reuses every full old shard."""
    h = hashlib.sha256()
    for s in chunk:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def compute_hidden_states(model, sequences: list[list[int]], cache_dir: str | Path | None = None,
                          shard_size: int = 32, dtype=torch.bfloat16, progress: bool = True,
                          batch_tokens: int | None = None, capture=None) -> HiddenStates:
    """Full causal forwards over the sequences -> HiddenStates (hidden stored as `dtype`).
    capture (base layer indices): also keep the residual streams entering those layers (HiddenStates.captured,
    [N, len(capture) * H], as Llama.hidden_states(capture=...) gives them; EAGLE-3's features).
    cache_dir: keep finished shards there (a folder per model and dtype; a file per shard, named by its
    sequences) and reuse them. batch_tokens: padded tokens per forward, sequences of similar length
    batched together. Default: one sequence per forward on the CPU (a ~260-token sequence already keeps
    its cores busy; batching 32 self-generated answers measured 25% slower here: padding and the
    [B, heads, L, L] scores), 8192 on a GPU (one sequence per forward leaves it mostly idle)."""
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("need at least one sequence, each of at least 2 tokens")
    capture = None if capture is None else model.check_capture(capture)
    root = None
    if cache_dir is not None:
        root = Path(cache_dir) / f"hidden-{_model_key(model, dtype, capture)}"
        root.mkdir(parents=True, exist_ok=True)
    if batch_tokens is None:
        batch_tokens = 1 if model.device.type == "cpu" else 8192
    parts = []
    bar = tqdm(total=sum(map(len, sequences)), desc="base hidden states", unit="tok", disable=not progress)
    for s0 in range(0, len(sequences), shard_size):
        chunk = sequences[s0:s0 + shard_size]
        shard = root / f"shard-{_shard_key(chunk)}.pt" if root is not None else None
        if shard is not None and shard.exists():
            parts.append(torch.load(shard, weights_only=True))
        else:
            parts.append(_forward_chunk(model, chunk, batch_tokens, dtype, capture))
            if shard is not None:
                torch.save(parts[-1], shard.with_suffix(".tmp"))
                shard.with_suffix(".tmp").rename(shard)
        bar.update(sum(map(len, chunk)))
    bar.close()
    captured = None
    if capture is not None:  # each shard holds (hidden [n, H], captured [n, len(capture) * H])
        parts, captured = [p[0] for p in parts], torch.cat([p[1] for p in parts])
    return HiddenStates(ids=torch.tensor([t for s in sequences for t in s], dtype=torch.long),
                        hidden=torch.cat(parts), after=_after([len(s) for s in sequences]), captured=captured,
                        capture=capture)


def _forward_chunk(model, chunk: list[list[int]], batch_tokens: int, dtype, capture=None):
    """Hidden states of the chunk's sequences, concatenated in order [sum(len), H] (with capture: the pair
    (them, the captured streams [sum(len), len(capture) * H])). Longest first, grouped while the
    right-padded batch stays within batch_tokens (a sequence longer than that goes alone). Right padding
    is exact under the causal mask: a real token never sees the padding after it."""
    order = sorted(range(len(chunk)), key=lambda i: -len(chunk[i]))
    out: list[torch.Tensor | None] = [None] * len(chunk)
    kept: list[torch.Tensor | None] = [None] * len(chunk)
    i = 0
    while i < len(order):
        longest = len(chunk[order[i]])
        group = order[i: i + max(1, batch_tokens // longest)]
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        for r, j in enumerate(group):
            ids[r, : len(chunk[j])] = torch.tensor(chunk[j])
        if capture is None:
            h = model.hidden_states(ids.to(model.device)).to("cpu", dtype)
        else:
            h, c = (t.to("cpu", dtype) for t in model.hidden_states(ids.to(model.device), capture=capture))
        for r, j in enumerate(group):
            out[j] = h[r, : len(chunk[j])]
            if capture is not None:
                kept[j] = c[r, : len(chunk[j])]
        i += len(group)
    return torch.cat(out) if capture is None else (torch.cat(out), torch.cat(kept))


def draft_vocabulary(sequences: list[list[int]], size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids of the sequences (ties by id), `always` included first
    (e.g. the end-of-turn tokens, which must be draftable for a reply to end inside a tree)."""
    counts = Counter(t for s in sequences for t in s)
    ranked = list(dict.fromkeys(list(always) + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))
    if len(ranked) < size:
        raise ValueError(f"only {len(ranked)} distinct tokens in the data; ask for a draft vocabulary of at most that")
    return torch.tensor(ranked[:size], dtype=torch.long)
