"""The pending chunk of a drafter with its own layers over the committed text (EAGLE's layer, Amphista's adaptation
layers), and the backlog its plain steps leave.

Such a drafter keeps the base model's committed positions it has not run yet (their hidden states, the token after
each, how many per sequence); at propose() the last one's next token, the root, is known and the chunk runs through
its layers, causal over itself after the prefix. On a plain step (skip_step) the chunk used to run at once, for one
position: a call of the layers costs about the same for one position as for a few (their Python and per-call work),
so a run that drafted little paid it every step (EPYC VM, 2026-11-28, budget="adaptive" on MT-Bench, where the policy
keeps 96-100% of the steps plain: Amphista 0.77-0.79x plain at batch 1 and 4), and the prompts' chunk at its first
step. A plain step's chunk now waits in a Backlog, joined with the next draft's into one chunk over the same positions
in the same order (so the same buffers and drafts), or run once BACKLOG_ROWS positions wait (which bounds the rows the
drafter's buffer reserves for it); the prompts' chunk waits too, and runs first, on its own. A run that never drafts
runs none of them.
"""
from __future__ import annotations

import torch

# most positions a sequence's plain steps leave waiting before they are run (a drafter's buffer reserves as many
# rows beyond the text, for a joined chunk's padding)
BACKLOG_ROWS = 64


def reserved_rows(depth: int) -> int:
    """Rows a drafter's buffer keeps beyond the text for a joined chunk's padding (a sequence with fewer positions
    than the longest writes padding rows past its own): the backlog holds at most BACKLOG_ROWS - 1 + (depth + 1)
    positions before it is run, and a draft's chunk adds its own, at most depth + 1."""
    return BACKLOG_ROWS + 2 * (depth + 1)


Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # h [B, P, H], tokens [B, P], n [B]: the first n[b] valid


def rooted(pend_h: torch.Tensor, pend_tok: torch.Tensor, pend_n: torch.Tensor, root: torch.Tensor) -> Chunk:
    """The pending chunk with each sequence's last valid position's next token set to its root [B]."""
    i = torch.arange(pend_tok.shape[1], device=pend_tok.device)
    return pend_h, torch.where(i[None, :] == (pend_n - 1)[:, None], root[:, None], pend_tok), pend_n


def joined(chunks: list[Chunk]) -> Chunk:
    """Chunks -> one chunk of each sequence's valid positions in order, padded to the longest (padding rows repeat
    position 0: the layers write them, nothing commits or reads them). One chunk is returned as it is."""
    if len(chunks) == 1:
        return chunks[0]
    h_all, t_all = torch.cat([c[0] for c in chunks], 1), torch.cat([c[1] for c in chunks], 1)  # [B, sum P_j, ...]
    counts = torch.stack([c[2] for c in chunks]).tolist()  # [chunk][b], one host read
    starts = [0]
    for c in chunks[:-1]:
        starts.append(starts[-1] + c[1].shape[1])
    # sequence b's valid positions: the first counts[j][b] of chunk j, chunk after chunk
    idx = [[s + i for s, c in zip(starts, counts) for i in range(c[b])] for b in range(len(counts[0]))]
    total = [len(x) for x in idx]
    P = max(max(total), 1)
    index = torch.tensor([x + [0] * (P - len(x)) for x in idx], device=t_all.device)  # [B, P]
    rows = torch.arange(len(idx), device=t_all.device)[:, None]
    return h_all[rows, index], t_all[rows, index], torch.tensor(total, dtype=torch.long, device=t_all.device)


class HeldRows(list):
    """Consecutive lean plain steps' rows [(hidden [B, H], next token [B])], kept as references until run."""

    def chunk(self) -> Chunk:
        """One chunk of the rows in order, every position valid: what joined() makes of their one-position chunks,
        in three tensor calls for the whole run of rows instead of ~7 a step."""
        tok = torch.stack([t for _, t in self], 1)
        n = torch.full((tok.shape[0],), len(self), dtype=torch.long, device=tok.device)
        return torch.stack([h for h, _ in self], 1), tok, n


class Backlog:
    """Plain steps' chunks not run yet, the prompts' chunk (the drafter's first) apart: it runs first, on its own
    (in prefill chunks).

    A plain step of the loop's lean path (Drafter.after_plain_step: every sequence active, one position each) leaves
    its row here (hold_row) instead of a pending chunk, and skip_step or propose pairs it with its next token (the root)
    as two references (HeldRows), stacked when run: the one-position chunk's views, ones, token concatenation and root
    insertion were ~7 tensor calls a plain step, each 10-40 us after the native step's weight stream (EPYC VM,
    2026-11-29: Amphista's after_plain_step and skip_step 0.17 ms of a ~6 ms batch-1 plain step). The caller's hidden
    and roots must not be written in place afterwards (the native step's outputs are fresh tensors each step)."""

    def __init__(self):
        self.prompt: Chunk | None = None
        self.chunks: list[Chunk | HeldRows] = []
        self.rows = 0  # a bound on the positions a sequence holds: the chunks' P summed (known without a device read)
        self.row: torch.Tensor | None = None  # hidden [B, H] of a lean plain step's position, its next token to come

    def hold_row(self, hidden: torch.Tensor) -> None:
        """after_plain_step: the step's one position per sequence is the drafter's pending chunk."""
        self.expect_no_row()
        self.row = hidden

    def expect_no_row(self) -> None:
        """after_step / after_prefill / hold_row: the last held row was paired with its root (skip_step or propose
        follow after_plain_step in the loop); else a position would be lost."""
        if self.row is not None:
            raise RuntimeError("a plain step's row was never run: after_plain_step must be followed by skip_step or "
                               "propose before the next step's hooks")

    def skip(self, pend_h, pend_tok, pend_n, root: torch.Tensor, first: bool) -> list[Chunk]:
        """A plain step (the drafter's skip_step): its pending positions wait here -> the chunks to run now (take()'s,
        once BACKLOG_ROWS positions may wait; else none). first: the drafter has run no chunk yet, so a pending chunk
        is the prompts'."""
        self._keep(pend_h, pend_tok, pend_n, root, first)
        return self.take() if self.rows >= BACKLOG_ROWS else []

    def take_with(self, pend_h, pend_tok, pend_n, root: torch.Tensor) -> list[Chunk]:
        """A draft (the drafter's propose): the chunks to run now, the pending positions last."""
        self._keep(pend_h, pend_tok, pend_n, root, first=False)
        return self.take()

    def _keep(self, pend_h, pend_tok, pend_n, root: torch.Tensor, first: bool) -> None:
        """The pending positions (the held row, else the drafter's pending chunk), root [B] the last one's next token,
        into the backlog: the prompts' chunk apart (first), a held row beside the rows before it."""
        if self.row is not None:
            self._keep_row(root)
        elif first and self.prompt is None and not self.chunks:
            self.prompt = rooted(pend_h, pend_tok, pend_n, root)
        else:
            chunk = rooted(pend_h, pend_tok, pend_n, root)
            self.chunks.append(chunk)
            self.rows += chunk[1].shape[1]

    def _keep_row(self, root: torch.Tensor) -> None:
        if not (self.chunks and isinstance(self.chunks[-1], HeldRows)):
            self.chunks.append(HeldRows())
        self.chunks[-1].append((self.row, root))
        self.row = None
        self.rows += 1

    def take(self, last: Chunk | None = None) -> list[Chunk]:
        """The chunks to run now, in order: the prompts' if it waits, then the others and `last` (this step's)
        joined into one; the backlog emptied. Held rows alone (plain steps since the last draft) are one stacked
        chunk, with no join (its host read)."""
        rest = [c.chunk() if isinstance(c, HeldRows) else c for c in self.chunks]
        rest += [last] if last is not None else []
        runs = ([self.prompt] if self.prompt is not None else []) + ([joined(rest)] if rest else [])
        self.prompt, self.chunks, self.rows = None, [], 0
        return runs
