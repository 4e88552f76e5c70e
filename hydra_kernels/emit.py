"""Host-side bookkeeping of generate(): emitted tokens, EOS, the exact max_new_tokens budget, streaming."""
from __future__ import annotations

from typing import Callable


class Emitter:
    def __init__(self, batch_size: int, max_new_tokens: int, eos: set[int],
                 streamer: Callable[[int, list[int]], None] | None):
        self.sequences: list[list[int]] = [[] for _ in range(batch_size)]
        self.accept_lengths: list[list[int]] = [[] for _ in range(batch_size)]
        self.done = [False] * batch_size
        self.max_new, self.eos, self.streamer = max_new_tokens, eos, streamer

    def emit(self, b: int, tokens: list[int], in_step: bool) -> None:
        """Append sequence b's new tokens, cut after its first EOS or at max_new_tokens."""
        if self.done[b]:
            return
        seq = self.sequences[b]
        kept = []
        for t in tokens:
            kept.append(t)
            if t in self.eos or len(seq) + len(kept) == self.max_new:
                self.done[b] = True
                break
        seq.extend(kept)
        if in_step:
            self.accept_lengths[b].append(len(kept))
        if self.streamer is not None and kept:
            self.streamer(b, kept)

    @property
    def all_done(self) -> bool:
        return all(self.done)
