"""The adaptive draft budget: each step's draft sized by its expected tokens per second (generate's
budget="adaptive"; budget.py keeps the pinned and table rules).

Per step, two decisions:
1. Before proposing, which of the drafter's parts run (Drafter.parts: the combined drafter's "ngram" and
   "heads", one "draft" part elsewhere). A part runs while what it earned (its share of the progress its step's
   kept nodes were expected to add, E(T) - 1 below, per step: an average over the recent steps it ran) beats what
   it costs (its measured drafting time and the rows its nodes took) at the current throughput; a part held
   back is tried again after a wait doubled by each step that does not pay and halved by each that does (2,
   4, 8 ... steps; a dear part's from the floor RAMP_SHARE sets), at most MAX_WAIT (MAX_WAIT_DEAR for a dear part),
   and no more rarely than lets its trials cost PROBE_SHARE of the time (PROBE_SHARE_BATCHED at batch >= 2); the
   wait carries over to the next run, whose new text brings a cheap part's next trial forward (to within
   NEW_TEXT_TRIAL steps; at batch >= 2 within max(NEW_TEXT_TRIAL, half its cap): NEW_TEXT_CAP_SHARE), where a dear
   part keeps its backoff (PartGate.new_text).
   No part running is a plain step (Drafter.skip_step), with no drafting cost. A running part whose work
   grows with its nodes (Drafter.size_part: a head per depth) drafts about as many as the cut kept last time
   (EXPLORE_EVERY).
2. After proposing, how many nodes each sequence verifies: every node j gets P(j) = the probability
   that the whole path root..j is right, the product of its ancestors' conditional rates (each: the chance
   a node is right given its parent was, learned below);
   each sequence keeps its T best nodes (P never grows down a path and ties keep the lower index, so the
   best T nodes always hold every kept node's parent: a valid subtree) and T maximises
       E(T) / cost(T),  E(T) = the expected progress of the batch's end with those nodes (bottleneck_expected):
   one sequence's expected tokens are 1 + the sum over its drafted nodes of P(node) (each accepted node is one token;
   siblings are disjoint events where their tokens differ: two siblings with one token, the n-gram's and a head's
   same guess, are one event counted twice, which the combined drafter does not merge yet), and a batch (generate()'s
   fixed batch ends with its last sequence) moves its end by 1 + sum over depths d of prod over the active sequences
   of the P at depth d - g_b of each one's kept nodes (g_b: how far the sequence is ahead of the one furthest behind;
   1 for d <= g_b): a draft only the sequences ahead accept moves nothing, but for the part of a step that attends
   to a sequence's own K/V, which the batch stops paying when that sequence finishes: each sequence's own expected
   tokens count at that share (attention_share.py; most of a step at long context, little at short). T = 1 is a plain
   step. The padded TreeBatch makes every sequence pay T rows, so each fills T (a node that is not worth its row costs
   nothing there).
   Where the drafter knows its draft's shape before drafting (Drafter.outline: the n-gram lookups, a static
   tree), the same choice is made first on the host from that shape (the drafting cost its parts' recent
   mean): a draft it would cut to the root alone is not drafted, and the step is plain at once. A node whose
   confidence only its drafting gives (a head's guess) is taken there at its best class's rate, and the cut
   after drafting ranks the classes the guesses got: a head's unconfident guess costs its drafting, not a row.

Conditional acceptance rates are learned during the run (`Calibration`), from each verified node whose parent
was right (under greedy acceptance every branch's: _correct_nodes; else the accepted path's), keyed by
(part, depth, signal), signal being the drafter's own confidence class of the node (Proposal.signal: the
n-gram match length, the class of a head's probability of its guess (protocol.confidence_class); the
sibling rank where a drafter reports none), counted per sequence and over
the run (decayed counts; the run's rates are the prior of each sequence's, the previous run's the prior
of the run's, and in a process's first run the rates the drafter ships (acceptance_prior.py); a key not verified yet
starts from what its part and signal earned at the other depths), so a prompt that copies earns long n-gram chains and
one that does not earns none.

Step costs are measured (`StepCosts`): each step's wall time (loop iteration to loop iteration, so
host work counts; the step ends with the loop's one host read, so the time is the device's too) less the parts'
drafting costs is fitted online as size * (a + c [T > 1] + b * (T - 1)) by decayed ridge regression, size being the
bytes a plain step reads over the weights' (attention_share.step_size: each attending sequence's K/V adds to it), the
previous run's fit (same model, batch size, device, threads) its prior.

Exactness: greedy acceptance emits the base model's tokens for any tree, so greedy output is plain
greedy decoding's whatever the policy does. For rejection sampling, the policy's choice of tree at a
step is a function of the drafts and of earlier steps (their outcomes and timings) only, never of this
step's acceptance draws, and rejection acceptance is exact for any tree fixed before its draws: so the
emitted tokens keep the base law (tests/test_sampling_exactness.py checks it with the statistical
harness). What the policy changes is which random numbers a step consumes: a seeded sampled run is exact
but, unlike a pinned budget, not token-for-token reproducible (the measured times steer it).

Host reads: the policy reads small device tensors (the expected tokens per width, the cut tree's depth and
leaf count, each part's expected tokens and kept counts, the verified tree's depth, at batch >= 2 the committed
lengths the attention shares come from): free on the CPU, where
it is measured; on a GPU each is a sync the one-host-read loop does not have (generate() runs the adaptive
budget in the eager loop there).
"""
from __future__ import annotations

import copy
import itertools
import math
import time

import torch

from .attention_share import attention_shares, step_size
from .drafters.protocol import CONFIDENCE_EDGES, PENDING_SIGNAL, Proposal
from .tree import Tree, TreeBatch, sibling_ranks

MAX_DEPTH_KEY = 8  # depths >= 8 share a calibration key
SIGNALS = 8  # signal classes per (part, depth)
assert len(CONFIDENCE_EDGES) + 1 == SIGNALS  # a head's confidence classes fill them
PRIOR_RATE = 0.4  # a never-seen key's conditional acceptance rate
RUN_PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior behind the run's rates
SEQ_PRIOR_WEIGHT = 4.0  # pseudo-observations of the run's rate behind a sequence's
# a key's prior is first moved by what its (part, signal) earned at the other depths (POOL_PRIOR_WEIGHT pseudo-
# observations of the key's own prior behind them): a node one deeper than any verified yet starts from its
# neighbours' rate, not from PRIOR_RATE. Without it a chain never grows: EPYC VM, 2026-11-28, editing prompts,
# batch 1: the n-gram's first node accepted 19 times in 24, its second never verified (0.9 x 0.4 does not pay
# a row), so the policy verified 1 node a step where the table verified 3 and emitted 2.9 tokens a step
POOL_PRIOR_WEIGHT = 2.0
DECAY = 0.97  # per step: counts and costs remember ~30 steps (the text and the context drift)
MAX_WAIT = 64  # most steps a held-back part waits before it is tried again,
# and a dear one (its ramp's floor above NEW_TEXT_TRIAL: drafting alone over 0.4 of a plain step), whose backoff a new
# run's text does not restart (PartGate.new_text): its trials then cost up to PROBE_SHARE of the decoding time, where
# MAX_WAIT held them at one a 64-step answer. EPYC VM, 2026-11-29, batch 1, 64-token MT-Bench answers, no draft of
# theirs paying: a trial of Amphista (its layers over the prompt and the backlog: 17-28 ms of drafting beside a 6.7-9 ms
# plain step) once per answer cost ~4%. In-process A/Bs (16 answers x 2 rounds, interleaved with plain), Amphista: the
# backoff restarted 0.928x plain (2.0 drafts an answer), kept whole 0.942-0.946x at MAX_WAIT, 0.962-0.975x at 256
# (0.34 drafts an answer)
MAX_WAIT_DEAR = 256
# a held-back part's wait is capped where its trials would cost this share of the decoding time, (what its
# trials took) / (PROBE_SHARE * a plain step) steps: a cheap part (the n-gram lookup, most trials a check refused
# before drafting) is tried every few steps and catches the text's copy bursts; a dearer one (the heads at batch 1) up
# to MAX_WAIT, a dear one (RAMP_SHARE's floor above NEW_TEXT_TRIAL) up to MAX_WAIT_DEAR
PROBE_SHARE = 0.01
# and at batch >= 2 this share: a draft's node there costs a row per sequence, so the copy bursts the trials catch pay
# less than at batch 1, and a trial (the heads' drafting for every sequence, then the cut) costs more. Xeon AMX VM,
# 2026-11-30, batch 2, MT-Bench, the default drafter: trials in 38% of the steps (each part tried at its 1%, a refused
# trial's real price ~0.6-0.9 ms beside a ~10 ms step), ~2% of the time, where the drafted steps only broke even
PROBE_SHARE_BATCHED = 0.005
# and after a step that does not pay (a trial, or an open part's first step after a burst) a part waits at least until
# its drafting's price is this share of the plain steps in between (the backoff's ramp starts there, then doubles; a new
# run's text restarts a cheap part's, not a dear one's: PartGate.new_text): a dear part (MLPSpeculator's three stages
# or Amphista's layers, about a plain step's price at batch 1) waits ~10 steps where the ramp's 2, 4, 8 ... spent ~5% of
# a fresh run's first 60 steps on trials; a cheap one (the n-gram lookup, the heads at batch 1: under a fifth of a plain
# step) keeps 2. Its drafting alone, not the trial's rows, which cheap parts pay as well
RAMP_SHARE = 0.1
# a draft is verified, and a part kept running, only where its predicted rate beats plain steps' by this
# factor: the predictions err (costs fitted online, acceptance from few counts) and a wrong draft costs
# rows at once, so marginal gains are left alone (EPYC VM, 2026-11-27: without it the policy ran 0.89-0.90x
# plain at batch 4 / 16 on the editing set, drafting where its predictions said 1.0-1.1x). At batch 1 the
# rows cost least and the fit errs least: EPYC VM, 2026-11-28, MT-Bench, 64-128 tokens, the shipped combined
# drafter: 1.08 at batch 1 ran 1.09x plain where 1.15 ran 1.03x (the heads' one-node drafts predicted at
# ~1.14x were refused) and 0.98x where 1.15 ran 0.98x; at batch 4, 1.08 ran 0.95x where 1.15 ran 0.98x. EPYC VM,
# 2026-11-29, batch 1: no margin (1.0) with the gates' rows fix (_pays) against ed70ef4 (1.08, the gates without the
# others' rows): the bench's 2k point 1.04-1.11x plain against 0.99-1.00x (the table 1.13-1.30x), MT-Bench 0.993x
# against 0.996x, editing 1.188x against 1.183x (in-process A/Bs); in modelled runs (benchmarks/replay_adaptive.py's
# first form) either change alone lost somewhere (margin 1.0 on editing, the rows fix on MT-Bench), both together
# nowhere (results README, "2026-11-29 (16:48 session)"). The margin had kept 2k prompts' second and third n-gram
# nodes out, each predicted a little above plain's rate and accepted more often than predicted
MARGIN = 1.15
MARGIN_BATCH_1 = 1.0
# a run starts on new text: a part the last run held back is tried within this many steps, whatever wait it had left
# (PartGate.new_text)
NEW_TEXT_TRIAL = 4
# and at batch >= 2 within this share of its probe cap (the wait PROBE_SHARE_BATCHED's price allows), if that is longer:
# restarted at NEW_TEXT_TRIAL, each run's ramp (4, 8, 16 ... up to the cap) spent more on trials than the probe share.
# Xeon AMX VM, 2026-11-30, batch 2, MT-Bench, the default drafter (12 answers of 64 tokens, every trial counted): the
# heads were tried 5.25 times an answer at ~1.3 ms each (drafted, then cut: 1.6% of the decoding time, their cap 40
# steps), the n-gram 10.75 times at ~0.23 ms (0.6%), where the table drafts nothing there and the policy ran 0.95-0.97x
# plain (its table 0.98-0.99x in the same runs)
NEW_TEXT_CAP_SHARE = 0.5
# a part whose work grows with the nodes it drafts (a head per depth: Drafter.size_part) drafts as many nodes
# as its last drafted step kept (at least one), and its whole draft every EXPLORE_EVERY-th run, where the
# deeper nodes' rates are learned (EPYC VM, 2026-11-28: the shipped chain's second head cost ~0.45 ms a step
# for a node the cut mostly dropped)
EXPLORE_EVERY = 4


def memory(owner, name: str) -> dict:
    """What earlier runs left on `owner` (a drafter: its rates and gates; a model: its step costs), so a run
    starts where the last one of its kind ended: learned acceptance as the prior, and a part that did not
    pay tried again after its wait, not at once. Kept on the object: gone with it."""
    return owner.__dict__.setdefault("_adaptive_" + name, {})


class Calibration:
    """Conditional acceptance P(node accepted | its parent accepted) per key = (part, depth, signal), as
    decayed counts of tested (parent accepted) and accepted nodes, per sequence [B, K] and over the run [K].

    Each level shrinks toward the one above it, pseudo-counts deciding how far (a Beta posterior mean):
        run(k)  = (A(k) + w_run * pooled(k, prior(k))) / (T(k) + w_run)
        seq(b, k) = (a(b, k) + w_seq * pooled_b(k, run(k))) / (t(b, k) + w_seq)
        pooled(k, q) = (A' + w_pool * q) / (T' + w_pool),  A', T' = the counts of k's (part, signal) at the
                       other depths (of the run, or of sequence b for pooled_b)
    prior(k) is the previous run's rate of k; in a process's first run of the drafter, the rate it ships
    (`shipped`: acceptance_prior.py), else PRIOR_RATE."""

    def __init__(self, batch: int, num_parts: int, memory: dict, device, shipped: torch.Tensor | None = None):
        self.P = num_parts
        self.K = num_parts * MAX_DEPTH_KEY * SIGNALS
        self.memory = memory
        prior = memory.get("rates", shipped)
        self.prior = prior.to(device) if prior is not None else torch.full((self.K,), PRIOR_RATE, device=device)
        self.tested = torch.zeros(self.K, device=device)
        self.accepted = torch.zeros(self.K, device=device)
        self.seq_tested = torch.zeros(batch, self.K, device=device)
        self.seq_accepted = torch.zeros(batch, self.K, device=device)
        self.pending = 0  # decay steps not applied yet (_settle): a plain step then costs no tensor op
        self.host = None  # host copies of the counts and the prior (host_rates), until they next change

    def keys(self, groups: torch.Tensor, depths: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
        d = (depths - 1).clamp(0, MAX_DEPTH_KEY - 1)
        return (groups * MAX_DEPTH_KEY + d) * SIGNALS + signal.clamp(0, SIGNALS - 1)

    def rates(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [B, T] -> conditional acceptance rates [B, T]."""
        self._settle()
        run = _shrink(self.accepted, self.tested, self.prior, RUN_PRIOR_WEIGHT, self.P)  # [K]
        seq = _shrink(self.seq_accepted, self.seq_tested, run, SEQ_PRIOR_WEIGHT, self.P)  # [B, K]
        return seq.gather(1, keys)

    def host_rates(self, keys: dict[int, list[int]], run: dict[int, float] | None = None) -> dict[int, list[float]]:
        """rates() of keys {b: [T] keys of sequence b} computed on the host, as floats: for the pre-check of a
        draft not drafted yet, where a few dozen keys are read and the tensor ops' dispatch would cost more
        than the arithmetic. The counts' pending decay f enters as (accepted * f + w * prior) / (tested * f + w).
        run: the run's rates read so far (host_run_rates' cache), shared by calls that rank one sequence each."""
        run = self.host_run_rates((k for ks in keys.values() for k in ks), run)  # the sequences share most keys
        _, _, _, seq_tested, seq_accepted, _, _, seq_t_sum, seq_a_sum = self._host_counts()
        f = DECAY ** self.pending
        return {b: [_shrunk(seq_accepted[b], seq_tested[b], seq_a_sum[b], seq_t_sum[b], k, run[k], SEQ_PRIOR_WEIGHT, f)
                    for k in ks] for b, ks in keys.items()}

    def host_run_rates(self, keys, run: dict[int, float] | None = None) -> dict[int, float]:
        """The run's rate of each key (host_rates' prior of every sequence's): {key: rate}, added to `run` where given
        (a cache of the rates already read: the counts do not change within a check)."""
        tested, accepted, prior, _, _, t_sum, a_sum, _, _ = self._host_counts()
        f = DECAY ** self.pending
        run = {} if run is None else run
        for k in keys:
            if k not in run:
                run[k] = _shrunk(accepted, tested, a_sum, t_sum, k, prior[k], RUN_PRIOR_WEIGHT, f)
        return run

    def _host_counts(self) -> list:
        """Host copies of the counts and the prior, and the counts' sums over depth per (part, signal) [..., P * S],
        kept until the counts next change."""
        if self.host is None:
            by_depth = lambda t: t.view(*t.shape[:-1], self.P, MAX_DEPTH_KEY, SIGNALS).sum(-2).flatten(-2)  # noqa: E731
            self.host = [t.tolist() for t in (self.tested, self.accepted, self.prior, self.seq_tested,
                                              self.seq_accepted, by_depth(self.tested), by_depth(self.accepted),
                                              by_depth(self.seq_tested), by_depth(self.seq_accepted))]
        return self.host

    def decay(self) -> None:
        """Every step, verified or not: counts fade, so a key that stops being verified drifts back to its
        prior and is tried again (a low rate learned once is not kept for good). Applied when the counts are next
        read or added to (_settle), as one DECAY ** steps: most steps of a run that does not draft read none."""
        self.pending += 1

    def _settle(self) -> None:
        if self.pending:
            f = DECAY ** self.pending
            for t in (self.tested, self.accepted, self.seq_tested, self.seq_accepted):
                t.mul_(f)
            self.pending, self.host = 0, None

    def update(self, keys: torch.Tensor, tested: torch.Tensor, accepted: torch.Tensor) -> None:
        """keys [B, T]; tested / accepted float [B, T] (0 / 1)."""
        self._settle()
        self.seq_tested.scatter_add_(1, keys, tested)
        self.seq_accepted.scatter_add_(1, keys, accepted)
        self.tested.index_add_(0, keys.flatten(), tested.flatten())
        self.accepted.index_add_(0, keys.flatten(), accepted.flatten())
        self.host = None

    def remember(self) -> None:
        """This run's rates become the next run's prior (same drafter)."""
        self._settle()
        self.memory["rates"] = _shrink(self.accepted, self.tested, self.prior, RUN_PRIOR_WEIGHT, self.P).cpu()


def _shrunk(acc, tst, acc_sum, tst_sum, k: int, q: float, w: float, f: float) -> float:
    """_shrink's rate of key k from host counts (q: its prior; f: the counts' pending decay)."""
    ps = (k // (MAX_DEPTH_KEY * SIGNALS)) * SIGNALS + k % SIGNALS  # k's (part, signal)
    if tst_sum[ps] == 0.0:  # no counts at any depth (most keys of most sequences): the prior itself
        return q
    pooled = ((acc_sum[ps] - acc[k]) * f + POOL_PRIOR_WEIGHT * q) / ((tst_sum[ps] - tst[k]) * f + POOL_PRIOR_WEIGHT)
    return (acc[k] * f + w * pooled) / (tst[k] * f + w)


def _shrink(accepted: torch.Tensor, tested: torch.Tensor, prior: torch.Tensor, weight: float, parts: int):
    """Calibration's rate per key: counts [..., K] shrunk toward their (part, signal)'s counts at the other
    depths, those toward prior [..., K] (see Calibration). -> rates [..., K]."""
    shape = (*accepted.shape[:-1], parts, MAX_DEPTH_KEY, SIGNALS)
    a, t = accepted.view(shape), tested.view(shape)
    a_other, t_other = a.sum(-2, keepdim=True) - a, t.sum(-2, keepdim=True) - t
    pooled = (a_other + POOL_PRIOR_WEIGHT * prior.view(prior.shape[:-1] + shape[-3:])) / (t_other + POOL_PRIOR_WEIGHT)
    return ((a + weight * pooled) / (t + weight)).reshape(accepted.shape)


class StepCosts:
    """A step's wall time without its drafting (ms) ~ a + c [T > 1] + b (T - 1), T the verified nodes per
    sequence; a: a plain step, c: what any drafted step pays beyond its rows (the tree step's kernels and the loop's
    work around a verified tree), b: a node's rows. Fitted by decayed ridge regression toward a prior (the previous
    run's fit, else a guess scaled by the first plain steps, c = 0). One observation counts at most twice its
    prediction plus 2 ms: a one-time cost (a first call's warm-up, a page fault) must not teach the policy that
    rows are dear for the rest of a run.

    Per unit of the step's size (attention_share.step_size: a plain step's bytes over the weights' bytes, set by the
    policy before each step): a, b, c are fitted on ms / size and predicted times size. Why: one fit per batch size
    mixed steps of different sizes. EPYC VM, 2026-12-01, batch 2 over 8000 keys: a plain step took ~45 ms with both
    sequences attending and ~26 with one finished, a node ~10 ms a sequence with both; fitted raw over an answer where
    one finished early, the fit priced a 2-node step at 1.49x a plain one and a 3-node step at 2.2x (measured 1.2-1.3x
    and 1.5-1.7x), so the policy refused the 2-node drafts the table's steps gained ~20% from, answer after answer.
    Per unit, a plain step is 5.5-5.7 ms at every size measured there (100-8000 keys, one or both attending) and a node
    ~1.2 ms at short context and at 8000 keys alike.

    Why c: a + b (T - 1) alone put the first node's surcharge into both a and b. EPYC VM, 2026-11-29, the shipped
    combined drafter at batch 1, medians of the loop's timed steps by width: MT-Bench 6.04 / 7.83 / 9.08 / 10.43 ms
    for T = 1-4 (the first node 1.8 ms, the next ones 1.3), fitted a = 6.91 (a plain step 14% dearer than measured),
    b = 1.37; 2k-token prompts 12.35 / 13.87 / 15.58 / 17.67, fitted a = 12.87, b = 2.07."""

    PLAIN_STEPS_TO_SCALE = 3  # the guess follows the fastest of the first plain steps (the first may catch up
    # a drafter's layer over the whole prompt: EAGLE's, Amphista's skip_step)
    # the prior's weight on a, b, c, times `weight`: b and c only a tenth, since the timed widths separate them
    # poorly (c [T > 1] and b (T - 1) move together), so a ridge of equal weights traded one for the other (a 1.5 ms
    # surcharge fitted at 1.15 from exact timings of widths 1, 2, 3, 5: tests/test_adaptive.py); where no drafted
    # step was timed the prior stands whatever its weight
    PRIOR_SCALE = (1.0, 0.1, 0.1)

    def __init__(self, memory: dict, key, device_type: str, batch: int = 1):
        self.memory, self.key = memory, key
        prior = memory.get(key)
        self.known = prior is not None
        # until a wide step is timed, a node per sequence costs this share of a plain step: on the CPU each node
        # is `batch` rows of exact fp32 FMAs (EPYC VM, 2026-11-28, the quantized SmolLM2: a row ~1.1 ms beside a
        # 7.2 ms batch-1 step, 0.15; at batch 4 a node ~4.4 ms beside 11.7, at 16 ~18 beside 35: so 0.15 * batch,
        # at most a whole step, errs high where it errs); ~0 on a GPU (a step is memory-bound well past 16 rows)
        self.row_share = min(1.0, 0.15 * batch) if device_type == "cpu" else 0.005
        self.weight = 3.0 if prior is not None else 1.0
        self.pull = [(1 - DECAY) * self.weight * s for s in self.PRIOR_SCALE]  # the prior's pull per coefficient a step
        self._reset(list(prior) + [0.0] * (3 - len(prior)) if prior is not None else [10.0, 10.0 * self.row_share, 0.0])
        self.plain_seen, self.wide_seen = 0, False
        self.size = 1.0  # the step's size (attention_share.step_size): what the fit's per-unit costs are scaled by

    def _reset(self, prior: list[float]) -> None:
        """The fit back to its prior [a, b, c] (the ridge's normal equations A theta = r over theta = (a, b, c))."""
        self.prior = prior
        self.A = [[self.weight * self.PRIOR_SCALE[i] if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.r = [self.weight * s * x for s, x in zip(self.PRIOR_SCALE, prior)]
        self.coef, self.spec = prior[:2], prior[2]  # coef: [a, b]; spec: c

    def plain(self) -> float:
        """A plain step (ms) at the current size, as predict(1) gives it."""
        return max(self.coef[0], 1e-3) * self.size

    def predict(self, width: int) -> float:
        """A step of `width` nodes at the current size: never cheaper than a plain step, nor than a narrower one (a fit
        from few widths may give c < 0 or b < 0)."""
        return self.plain() + (self.rows(width - 1) if width > 1 else 0.0)

    @staticmethod
    def bounded(ms: float, predicted: float) -> float:
        """A step's time as the fit takes it: at most twice its prediction plus 2 ms (the class docstring: a one-time
        cost must not teach the policy that rows are dear)."""
        return min(ms, 2.0 * predicted + 2.0)

    def rows(self, nodes: float) -> float:
        """What `nodes` verified nodes per sequence (a part's mean: a fraction where it keeps some steps none) add to a
        plain step: their rows, and the drafted step's surcharge c for up to one of them (at the current size)."""
        return max(0.0, max(self.coef[1], 0.0) * nodes + self.spec * min(1.0, nodes)) * self.size

    def observe(self, width: int, ms: float) -> None:
        """A step of `width` nodes at the current size took `ms` (its drafting excluded)."""
        ms /= self.size  # the fit's unit
        if not self.known and width == 1 and self.plain_seen < self.PLAIN_STEPS_TO_SCALE:
            self.plain_seen += 1
            if self.plain_seen == 1 or ms < self.prior[0]:  # the guess scaled to the fastest plain step yet
                self._reset([ms, ms * self.row_share, 0.0])
                return
        self.wide_seen = self.wide_seen or width > 1
        ms = self.bounded(ms, self.predict(width) / self.size)
        # the normal equations decayed toward the prior (not toward zero), plus x x^T and x ms, x = (1, T - 1, [T > 1]);
        # written out, as _solve3 is: observe runs after every step, right after the native step on caches it left
        # cold. Xeon AMX VM, 2026-11-30: 2.8 us warm where the loops and list comprehensions took 10.8 (the same fit to
        # 1e-14); AdaptiveBudget.observe's median in the batch-2 loop (MT-Bench) 29 us where it was 46
        x1, x2 = float(width - 1), 1.0 if width > 1 else 0.0
        A, r, d = self.A, self.r, DECAY
        p0, p1, p2 = self.pull
        A0, A1, A2 = A
        A0[0], A0[1], A0[2] = d * A0[0] + 1.0 + p0, d * A0[1] + x1, d * A0[2] + x2
        A1[0], A1[1], A1[2] = d * A1[0] + x1, d * A1[1] + x1 * x1 + p1, d * A1[2] + x1 * x2
        A2[0], A2[1], A2[2] = d * A2[0] + x2, d * A2[1] + x2 * x1, d * A2[2] + x2 * x2 + p2
        q = self.prior
        r[0], r[1], r[2] = d * r[0] + p0 * q[0] + ms, d * r[1] + p1 * q[1] + x1 * ms, d * r[2] + p2 * q[2] + x2 * ms
        a, b, c = _solve3(A, r)
        self.coef, self.spec = [a, b], c

    def remember(self) -> None:
        """The next run's prior: the fit, its row and drafted-step costs only where a wide step was timed (a cost
        never observed stays a guess, not a learned value)."""
        if self.known or self.wide_seen:
            self.memory[self.key] = (*self.coef, self.spec)
        elif self.plain_seen:
            self.memory[self.key] = (self.coef[0], self.coef[0] * self.row_share, 0.0)


def _solve3(A: list[list[float]], r: list[float]) -> list[float]:
    """x with A x = r, A 3 x 3 symmetric positive definite (the ridge's normal equations): Cramer's rule on the host,
    written out (a few dozen float ops; a tensor solve's dispatch would cost more), x = adj(A) r / det(A)."""
    (a, b, c), (d, e, f), (g, h, i) = A
    c00, c01, c02 = e * i - f * h, f * g - d * i, d * h - e * g  # cofactors of the first row
    c10, c11, c12 = c * h - b * i, a * i - c * g, b * g - a * h
    c20, c21, c22 = b * f - c * e, c * d - a * f, a * e - b * d
    det = a * c00 + b * c01 + c * c02
    r0, r1, r2 = r
    return [(c00 * r0 + c10 * r1 + c20 * r2) / det, (c01 * r0 + c11 * r1 + c21 * r2) / det,
            (c02 * r0 + c12 * r1 + c22 * r2) / det]


def dear(floor: int) -> bool:
    """Is a part whose ramp's floor (RAMP_SHARE's wait after a step that does not pay) is `floor` steps dear: its drafting
    alone over 0.4 of a plain step? Its wait is then capped at MAX_WAIT_DEAR and a new run's text keeps its backoff
    (PartGate.new_text)."""
    return floor > NEW_TEXT_TRIAL


class PartGate:
    """Whether a drafter part runs next step: while its recent gain pays for its cost, else after a wait
    that doubles each time a trial does not pay and halves each time a step pays (2, 4, 8, ... steps, from the
    judge's min_wait, at most its max_wait; see judge)."""

    def __init__(self):
        # the progress per step its kept nodes were expected to add (at batch 1 their expected tokens; batched: its
        # share of the batch's, _progress_shares), a decayed mean over the steps it ran
        self.gain = None
        self.nodes = 0.0  # rows per sequence its kept nodes took (decayed mean)
        self.cost = 0.0  # ms its drafting took (decayed mean)
        self.trial = None  # ms a trial took (decayed mean over the steps it ran while held back, its rows included)
        self.open, self.wait, self.left = True, 1, 0
        self.floor = 2  # the shortest wait after a step that does not pay (judge's last min_wait)
        self.cap = MAX_WAIT  # the longest (judge's last max_wait: at most what its trials' price allows, PROBE_SHARE)
        self.fresh = False  # the next record starts the gain afresh (new_text)

    def new_text(self, batched: bool = False) -> None:
        """A new run (its prompts' text): what the part earned on the last run's text (its kept nodes' expected tokens,
        priced by that text's rates) is not evidence about this one, so its first step here sets its gain (record), a
        held-back part is tried within NEW_TEXT_TRIAL steps, and its backoff goes back to at most NEW_TEXT_TRIAL; its
        cost (the machine's, not the text's) is kept. EPYC VM, 2026-11-29, editing prompts at batch 1: a prompt that
        copied its text (the table's 3 nodes a step: 2.6 tokens a step) ran 27 plain steps before drafting: its first
        trial's tokens averaged into the last prompt's 0.0 (0.3 weight), and one trial that earned nothing doubled the
        last prompt's 16-step wait. A backoff restarted at 1 cost MT-Bench's answers ~3% (0.957 against 0.986, 16
        answers of 256 tokens).

        A dear part (its ramp's floor, judge's last min_wait, above NEW_TEXT_TRIAL: drafting alone over 0.4 of a plain
        step) keeps its backoff whole instead, wait and steps left (at most MAX_WAIT_DEAR): whether a model's drafter
        pays is the model pair's and the machine's (a step's price) more than the text's, where the n-gram's copies
        are the text's. Why: restarted (at its floor, RAMP_SHARE), a dear part was tried 2-4 times a 64-token answer,
        each trial a whole drafting pass (MLPSpeculator's stages ~5-8 ms, Amphista's layers over the backlog ~17 ms,
        beside a ~6.7 ms plain step at batch 1). Kept whole for every part, the combined drafter lost where a part
        stopped paying on one text and paid on the next (EPYC VM, 2026-11-29, the bench's 2k point at batch 1:
        0.86-0.99x plain against 1.08x); its parts are cheap (the lookups, the heads), so the rule for dear parts alone
        leaves it as it was. In-process A/B, EPYC VM, 2026-11-29, batch 1, 64-token answers, 16 MT-Bench prompts x 2
        rounds: MLPSpeculator 0.963 -> 0.982x plain, Amphista 0.928 -> 0.962x; batch 4, 6 x 4 prompts x 3 rounds:
        MLPSpeculator 0.957 -> 0.980x (3.1 -> 0.6 drafts an answer). Whether a part is dear follows its drafting's
        running mean (PartGate.cost): a part that drafts every step, sized (size_part), may turn cheap; a run's first
        draft is whole (AdaptiveBudget.keep starts unknown).

        batched (batch >= 2): the restart goes no lower than NEW_TEXT_CAP_SHARE of the part's probe cap (judge's last
        max_wait), so a run's trials stay near the probe share: a draft there pays only where every sequence behind
        accepts, and restarted at NEW_TEXT_TRIAL the heads' ramp (4, 8, 16, 32 steps) tried them 5 times a 64-token
        answer where their cap allowed 1-2 (NEW_TEXT_CAP_SHARE). A cheap part (the n-gram lookup: a cap of a few
        steps) restarts as before."""
        self.fresh = True
        if dear(self.floor):  # its backoff kept whole (see above)
            return
        restart = max(NEW_TEXT_TRIAL, math.ceil(NEW_TEXT_CAP_SHARE * self.cap)) if batched else NEW_TEXT_TRIAL
        self.left = min(self.left, restart)
        self.wait = min(self.wait, restart)

    def due(self) -> bool:
        if self.open:
            return True
        self.left -= 1
        return self.left <= 0

    def record(self, gain: float, nodes: float, cost: float, cap: float = math.inf) -> None:
        first = self.gain is None
        new = first or self.fresh
        self.fresh = False
        self.gain = gain if new else 0.7 * self.gain + 0.3 * gain
        self.nodes = nodes if new else 0.7 * self.nodes + 0.3 * nodes
        # a one-time cost (the first call's warm-up) counts at most twice the mean plus 1 ms (the first
        # record: at most `cap`, a plain step's time)
        self.cost = min(cost, cap) if first else 0.7 * self.cost + 0.3 * min(cost, 2.0 * self.cost + 1.0)

    def record_trial(self, ms: float) -> None:
        self.trial = ms if self.trial is None else 0.7 * self.trial + 0.3 * min(ms, 2.0 * self.trial + 1.0)

    def judge(self, pays: bool, max_wait: int = MAX_WAIT, min_wait: int = 2) -> None:
        """`wait` is the part's backoff: doubled by each step that does not pay, halved by each that does.
        So a trial that pays once (a confident guess) opens the part for a step and leaves the backoff where it was
        (16 -> 8 -> 16), where a reset to 1 would restart the ramp 2, 4, 8, 16: four more trials, ~0.5 of a
        plain step each at batch 1 (EPYC VM, 2026-11-28: ~5% of a 64-token MT-Bench answer). A burst that
        pays for several steps brings it down to 1, and the part is tried again 2 steps after the burst (min_wait
        after it, for a dear part). min_wait: the shortest wait after a step that does not pay (RAMP_SHARE: what a dear
        part's trial price sets), capped by max_wait."""
        self.floor, self.cap = min_wait, max_wait
        if pays:
            self.open, self.wait = True, max(1, self.wait // 2)
        else:
            self.wait = min(max(min_wait, 2 * self.wait), max_wait)
            self.open, self.left = False, self.wait


class AdaptiveBudget:
    """One run's adaptive policy (see the module docstring). The loop calls, per step:
    parts = plan() -> propose(drafter, state, root, seqlens, active, parts, emitted): the proposal to verify, or None
    for a plain step (no part ran: the loop calls skip_step and plain_step) -> observe(accept_indices) after
    the step's host read. `cap`: most nodes a sequence verifies per step; a drafter whose proposals are not
    prunable (lookahead: its nodes have fixed roles) has a proposal verified whole or drafts nothing."""

    def __init__(self, drafter, batch: int, cap: int, model, device: torch.device, *, clock=time.perf_counter,
                 kv_per_weight: float = 0.0):
        self.parts = tuple(drafter.parts)
        # one sequence's K/V bytes per committed token over a step's weight bytes (attention_share.py): what its
        # attention's share of a step is at its context (bottleneck_expected's shares, at batch >= 2) and a step's size
        # (StepCosts' unit); 0: counted as none (every step size 1)
        self.kv_per_weight = kv_per_weight
        self.prunable = drafter.prunable_proposals
        self.cap, self.batch = cap, batch
        self.margin = MARGIN_BATCH_1 if batch == 1 else MARGIN
        self.probe_share = PROBE_SHARE if batch == 1 else PROBE_SHARE_BATCHED  # what a held-back part's trials may cost
        self.memory = memory(drafter, "memory")
        # the shipped prior only matters (and is only built, or warned about) before a run has learned rates
        shipped = None if "rates" in self.memory else shipped_rates(drafter, self.parts)
        self.calib = Calibration(batch, len(self.parts), self.memory, device, shipped)
        self.costs = StepCosts(memory(model, "costs"), (batch, device.type, torch.get_num_threads()), device.type,
                               batch)
        self.gate_key = ("gates", batch, device.type, torch.get_num_threads())  # a part's price is the threads' too
        self.gates = [copy.copy(g) for g in self.memory.get(self.gate_key, ())] or [PartGate() for _ in self.parts]
        for g in self.gates:
            g.new_text(batched=batch > 1)
        self.clock = clock
        self.first = not self.costs.known  # without an earlier run's costs the first step is plain: it times a
        self.host_s = 0.0  # the policy's own host time
        self.keep = [None] * len(self.parts)  # per part: its nodes the last cut kept, most of any sequence
        self.runs = [0] * len(self.parts)  # per part: the steps it drafted
        self.last_t = None
        # the step in flight: (parts ran, their drafting ms, verified width, the verified nodes' keys / depths /
        # valid / parents / groups or None, active [B] float or None, the drafting ms their gates record)
        self.step = None

    # ---- before proposing -------------------------------------------------------------------------
    def begin(self) -> None:
        """The loop starts: the first step's time counts from here."""
        self.last_t = self.clock()

    def plan(self, contexts: list[int] | None = None, done: list[bool] | None = None) -> tuple[bool, ...]:
        """Which parts draft this step (all False: a plain step). contexts / done: each sequence's committed length and
        whether it is done (host lists), which size the step (StepCosts: attention_share.step_size); None: the size
        stands (1 until lengths are given)."""
        t0 = self.clock()
        if contexts is not None and self.kv_per_weight:
            self.costs.size = step_size(contexts, done if done is not None else [False] * len(contexts),
                                        self.kv_per_weight)
        run = tuple(False for _ in self.parts) if self.first else tuple(g.due() for g in self.gates)
        self.host_s += self.clock() - t0
        return run

    def plain_step(self) -> None:
        """No part drafted this step."""
        self.step = (tuple(False for _ in self.parts), [0.0] * len(self.parts), 1, None, None, None, None, None)

    # ---- proposing ---------------------------------------------------------------------------------
    def propose(self, drafter, state, root: torch.Tensor, seqlens: torch.Tensor, active: torch.Tensor,
                parts: tuple[bool, ...], emitted: list[int] | None = None) -> Proposal | None:
        """The drafter's proposal with `parts`, cut to the width that maximises the batch's expected progress per
        ms (bottleneck_expected; a TreeBatch; the proposal itself when nothing is cut), or None: verify the root
        alone (a plain step). active [B] (0: finished); emitted: the tokens each sequence has emitted (None: taken as
        level)."""
        t0 = self.clock()  # from here, what the parts cost: their setup, the outline, the check, the drafting
        act_host = active.tolist()
        shares = self._shares(seqlens, act_host)  # bottleneck_expected's
        drafter.set_parts(state, parts)
        for p, run in enumerate(parts):
            if run:
                self.runs[p] += 1
                whole = self.keep[p] is None or self.runs[p] % EXPLORE_EVERY == 0
                drafter.size_part(state, p, None if whole else max(self.keep[p], 1) + 1)  # + the root
        ran = max(sum(parts), 1)
        # the draft's shape where the drafter knows it before drafting (Drafter.outline): a draft this step
        # would cut to the root alone is not drafted at all (the lookups and the heads' work saved)
        shape = drafter.outline(state, self.batch) if self.prunable else None
        t_shape = self.clock()
        outline_ms, check_ms = (t_shape - t0) * 1e3 / ran, 0.0
        host = None  # the outline's judgment (expected tokens per width, each sequence's nodes ranked), for the cut
        if shape is not None:
            drafting = sum(g.cost for g, r in zip(self.gates, parts) if r)  # what drafting it would cost
            lags = bottleneck_lags(emitted, act_host)  # the check reads host values only: it runs every few steps
            host = self._host_expected(shape, act_host, lags, drafting, shares)
            if host is None or self._best_width(host[0], host[1], drafting) == 1:
                self.keep = [0 if r else k for k, r in zip(self.keep, parts)]  # as a draft cut to the root
                # the gates judge it as the trial it replaces, at their parts' drafting cost (EPYC VM, 2026-11-28:
                # charged at the check's ~0.2 ms, the parts looked cheap and drafted more, at batch 2 on the editing
                # set 0.91x plain against 1.04-1.09x); the check's own cost sets the trials' cadence (PartGate.trial)
                gate_ms = [g.cost if r and g.gain is not None else 0.0 for g, r in zip(self.gates, parts)]
                self._charge(parts, [outline_ms if r else 0.0 for r in parts], 1, None, None, t_shape, gate_ms,
                             n_seq=float(sum(a != 0 for a in act_host)))  # the check: the policy's own work (from t_shape)
                drafter.skip_step(state, root, seqlens)  # as on a plain step (EAGLE / Amphista catch up)
                return None
            check_ms = (self.clock() - t_shape) * 1e3
            self.host_s += check_ms / 1e3
        t_prop = self.clock()
        prop = drafter.propose(state, root, seqlens)
        t1 = self.clock()
        part_ms = drafter.part_times(state)  # seconds per part where the drafter times them, else the whole call
        if part_ms is None:
            part_ms = [(t1 - t_prop) * 1e3 / ran if r else 0.0 for r in parts]
        else:
            part_ms = [x * 1e3 for x in part_ms]
        # + the outline and the check, which drafting cost too
        part_ms = [m + outline_ms + check_ms / ran if r else m for m, r in zip(part_ms, parts)]
        tokens, tree = prop.tokens, prop.tree
        B, T0 = tokens.shape
        if T0 == 1:  # the parts found nothing to draft (no n-gram match, say): a plain step, nothing to cut
            self._charge(parts, part_ms, 1, None, active.to(torch.float32), t1)
            return None
        if host is not None and host[1] == T0:  # the outline's tree (Drafter.outline's contract): cut on the host
            if host[3]:  # the drafted nodes' classes, where the outline had them pending (none: sibling ranks)
                sigs = prop.signal.tolist() if prop.signal is not None else [sibling_ranks(par) for par, _, _ in shape]
                shape = [(par, grp, sig[:len(par)]) for (par, grp, _), sig in zip(shape, sigs)]
                host = self._host_expected(shape, act_host, lags, shares=shares)
            return self._host_cut(prop, shape, host, parts, part_ms, active, t1, lags, shares)
        dev = tokens.device
        parents, depths, valid, mask = _per_sequence(tree, B, dev)
        groups = prop.groups if prop.groups is not None else torch.zeros(B, T0, dtype=torch.long, device=dev)
        signal = prop.signal if prop.signal is not None else sibling_rank(parents)
        keys = self.calib.keys(groups, depths, signal)
        rate = self.calib.rates(keys).clamp(1e-6, 1.0)
        # log P(j) = sum of log rates over j's ancestors-or-self, the root excluded (its rate is 1)
        logr = torch.where(depths > 0, rate.log(), torch.zeros_like(rate))
        P = torch.where(valid, torch.exp(torch.bmm(mask.float(), logr[:, :, None]))[:, :, 0], torch.zeros_like(rate))
        order = torch.sort(P, dim=1, descending=True, stable=True).indices  # root first, parents before children
        act = active.to(P.dtype)
        batched = int((act > 0).sum()) > 1
        lags = bottleneck_lags(emitted, act_host) if batched else None
        if batched:  # [T0]: the batch's expected progress with each sequence's best w nodes
            expected = bottleneck_expected_tensor(P, order, depths, act, lags, shares)
        else:  # one sequence: its expected tokens
            expected = (P.gather(1, order).cumsum(1) * act[:, None]).sum(0).tolist()
        best = self._best_width(expected, T0, sum(part_ms))  # the drafting, paid already, by every width alike
        if best == T0:
            out, vp = prop, (keys, depths, valid, parents, groups)
            kept_P = P
        elif best > 1:
            sel = order[:, :best].sort(dim=1).values  # kept node ids, in tree order
            out = _cut(prop, parents, depths, mask, valid, sel)
            vp = (keys.gather(1, sel), depths.gather(1, sel), out.tree.valid, out.tree.parents, groups.gather(1, sel))
            kept_P = P.gather(1, sel)
        else:
            out, vp = None, None
        expect = None
        if vp is None:
            self.keep = [0 if r else k for k, r in zip(self.keep, parts)]
        else:
            _, depths_kept, valid_kept, _, groups_kept = vp
            drafted = valid_kept & (depths_kept > 0)
            drafted_P = kept_P * drafted * act[:, None]
            expect = [0.0] * len(parts)  # each part's expected tokens: its kept nodes' P, over the active sequences
            for p, run in enumerate(parts):
                if run:  # and what it kept, most of any active sequence (size_part's next bound)
                    mine = groups_kept == p
                    self.keep[p] = int(((mine & drafted).sum(1) * (act > 0)).max())
                    expect[p] = float((drafted_P * mine).sum())
            if batched:  # each part's marginal progress: E[D] without its nodes and those under them
                mask = _per_sequence(out.tree, B, dev)[3].float()  # [B, w, w]: ancestor-or-self
                flat = torch.arange(best, device=dev).expand(B, best)
                without = [bottleneck_expected_tensor(
                    kept_P * (torch.bmm(mask, ((groups_kept == p) & drafted).float()[:, :, None])[:, :, 0] == 0),
                    flat, depths_kept, act, lags, shares)[-1] if run else None for p, run in enumerate(parts)]
                expect = _progress_shares(expect, expected[best - 1], without)
        self._charge(parts, part_ms, best, vp, act, t1, expect=expect)
        return out

    def _shares(self, seqlens: torch.Tensor, active: list[int]) -> list[float] | None:
        """bottleneck_expected's shares at this step: each active sequence's attention's share of a plain step, from
        its committed length (None where counted as none, and at batch 1, whose value is its one sequence's tokens)."""
        if not self.kv_per_weight or self.batch == 1:
            return None
        return attention_shares(seqlens.tolist(), active, self.kv_per_weight)

    def _best_width(self, expected: list[float], T0: int, drafted: float) -> int:
        """The verified width w (nodes per sequence) maximising expected[w - 1] tokens per (drafted + a step
        of w rows) ms; 1 unless it beats a plain step's rate by the margin. A proposal that cannot be cut is
        verified whole once drafted (its drafter expects that step)."""
        widths = range(1, min(self.cap, T0) + 1) if self.prunable else (T0,)
        per_ms = {w: expected[w - 1] / (drafted + self.costs.predict(w)) for w in widths}
        best = max(widths, key=per_ms.get)
        if self.prunable and best > 1 and per_ms[best] < self.margin * per_ms[1]:
            best = 1
        return best

    def _host_expected(self, shape, active: list[int], lags: list[int] | None = None, drafting: float | None = None,
                       shares: list[float] | None = None) -> tuple[list[float], int, dict, bool] | None:
        """propose()'s expected tokens per width, from Drafter.outline's host lists (parents, groups, signal
        per sequence) instead of the drafted proposal's tensors: the same keys and rates, P (a product down the
        path) equal up to rounding, each sequence's P sorted; active: the host's [B] (0: finished). A node whose
        class drafting decides (PENDING_SIGNAL: a head's guess) is taken at its (part, depth)'s best class (by the run's
        rates, so one choice serves every sequence: at batch 16 a choice per sequence and node read 8x the keys):
        the check then skips a draft only where not even its best class would pay (whether the part pays on the whole
        is its gate's judgment), and the cut after drafting ranks the drafted classes (EPYC VM, 2026-11-29, 2k-token
        prompts, batch 1: taken at the most confident class, whose rate stayed the prior 0.4 where guesses that
        confident were rare, the check refused heads whose p in [0.45, 0.6) were accepted 0.83 of the time).
        lags: bottleneck_lags' (None: none; one active sequence needs none); shares: bottleneck_expected's (None:
        none). drafting: the check's drafting price (ms),
        given where a batched draft may be refused before every sequence is ranked (_ProgressBound): None is returned
        then, exactly where _best_width of the whole result would be 1.
        -> (expected [T0], T0, ranked: {active b: (its node ids by P, descending, ties to the lower id, so every
        prefix is a subtree; its keys, a pending node's its best class's; P per node)}, whether a node was pending)."""
        T0 = max(len(parents) for parents, _, _ in shape)
        live = [b for b, a in enumerate(active) if a]
        if len(live) > 1 and not (shares and any(shares)) and any(
                len(shape[b][0]) == 1 and not (lags and lags[b]) for b in live):
            # a sequence furthest behind drafts nothing: no width moves the batch's end (bottleneck_expected is 1 at
            # every width), so the rates are not read (at batch 16 most checks: ~0.2 ms each); with attention shares the
            # others' own tokens still count: _ProgressBound refuses there once they are bounded below what pays
            return [1.0] * T0, T0, {}, False
        best, run = {}, {}  # pending nodes' (part, depth) base key -> its best class's key; the run's rates read
        bound = None
        if drafting is not None and len(live) > 1:
            bound = _ProgressBound(shape, live, lags, self._least_paying(T0, drafting), shares)
            live = bound.order  # the sequences furthest behind first: they bound the progress most
        ranked, depths = {}, {}
        for b in live:
            ranked[b], depths[b] = self._host_rank(b, shape[b], best, run)
            if bound is not None and bound.refuses(ranked[b][2], depths[b], b):
                return None
        ranked = {b: ranked[b] for b in sorted(ranked)}  # sequence order (the cut's and the credit's)
        expected = [0.0] * T0
        for order, _, P in ranked.values():
            for w, total in enumerate(itertools.accumulate([P[j] for j in order] + [0.0] * (T0 - len(P)))):
                expected[w] += total
        if len(ranked) > 1:  # the batch's progress: the sequence furthest behind's (bottleneck_expected)
            expected = bottleneck_expected([([P[j] for j in order], [depths[b][j] for j in order],
                                             lags[b] if lags else 0) for b, (order, _, P) in ranked.items()], T0,
                                           [shares[b] for b in ranked] if shares else None)
        return expected, T0, ranked, bool(best)

    def _host_rank(self, b: int, seq_shape, best: dict, run: dict) -> tuple[tuple[list[int], list[int], list[float]],
                                                                             list[int]]:
        """One active sequence's outline (parents, groups, signal) -> ((its node ids by P, its keys, P per node), depth
        per node): _host_expected's per sequence. best: the pending classes chosen so far; run: the run's rates read so
        far (Calibration.host_run_rates' cache); both shared by the sequences of one check."""
        parents, groups, signal = seq_shape
        depth = node_depths(parents)
        ks = []
        for g, d, x in zip(groups, depth, signal):
            base = (g * MAX_DEPTH_KEY + min(max(d - 1, 0), MAX_DEPTH_KEY - 1)) * SIGNALS
            if x == PENDING_SIGNAL:  # its (part, depth)'s best class by the run's rates, shared by the sequences
                if base not in best:
                    classes = range(base, base + SIGNALS)
                    self.calib.host_run_rates(classes, run)
                    best[base] = max(classes, key=run.__getitem__)
                ks.append(best[base])
            else:
                ks.append(base + min(max(x, 0), SIGNALS - 1))
        r = self.calib.host_rates({b: ks}, run)[b]
        P = path_products(parents, r)
        order = sorted(range(len(P)), key=lambda j: -P[j])  # stable: a tie keeps the lower id (the parent) first
        return (order, ks, P), depth

    def _least_paying(self, T0: int, drafting: float) -> float:
        """The least expected progress at which _best_width could choose a width above 1 for a draft of T0 nodes a
        sequence drafted at `drafting` ms: the least over w = 2 .. min(cap, T0) of margin * (drafting + cost(w)) /
        (drafting + cost(1)) (a plain step's progress is 1). Below it at every width, the draft is refused; -inf where
        a predicted time is not positive (no bound then)."""
        plain = drafting + self.costs.predict(1)
        times = [drafting + self.costs.predict(w) for w in range(2, min(self.cap, T0) + 1)]
        if plain <= 0 or any(t <= 0 for t in times):
            return -math.inf
        return min((self.margin * t / plain for t in times), default=math.inf)

    def _host_cut(self, prop: Proposal, shape, host, parts, part_ms: list[float], active: torch.Tensor,
                  t1: float, lags: list[int] | None = None, shares: list[float] | None = None) -> Proposal | None:
        """propose()'s cut where the drafted tree is the outline's: the width from the check's expected tokens (the
        same keys and rates as the proposal's tensors would give, P equal up to rounding: the host multiplies in float64
        where the tensors sum float32 logs, so nodes whose P tie may rank either way: tests/test_adaptive.py), each active sequence's
        best nodes from its ranking, the cut tree built from host lists (TreeBatch.from_parent_lists). The tensor
        path's rates, path products, sort and TreeBatch.kept took ~0.5 ms of a drafted step at batch 1 (EPYC VM,
        2026-11-29: beside a ~4 ms plain step, as much as the heads' drafting), ~0.1 ms here. A finished
        sequence (it accepts nothing) keeps its first nodes."""
        expected, T0, ranked, _ = host
        best = self._best_width(expected, T0, sum(part_ms))
        act = active.to(torch.float32)
        dev = prop.tokens.device
        if best == 1:
            self.keep = [0 if r else k for k, r in zip(self.keep, parts)]
            self._charge(parts, part_ms, 1, None, act, t1)
            return None
        kept = [sorted(ranked[b][0][:best]) if b in ranked else list(range(min(best, len(par))))
                for b, (par, _, _) in enumerate(shape)]
        par_lists, keys, groups = [], [], []
        for b, ((par, grp, _), ids) in enumerate(zip(shape, kept)):
            new = {j: i for i, j in enumerate(ids)}
            par_lists.append([-1] + [new[par[j]] for j in ids[1:]])
            key_b = ranked[b][1] if b in ranked else None
            keys.append([key_b[j] if key_b else 0 for j in ids] + [0] * (best - len(ids)))
            groups.append([grp[j] for j in ids] + [0] * (best - len(ids)))
        for p, run in enumerate(parts):  # what each part kept, most of any active sequence (size_part's next bound)
            if run:
                self.keep[p] = max((sum(1 for j in ids[1:] if shape[b][1][j] == p) for b, ids in enumerate(kept)
                                    if b in ranked), default=0)
        B = len(kept)
        if all(len(ids) == len(par) for ids, (par, _, _) in zip(kept, shape)):  # nothing cut: the proposal itself
            out = prop
        else:
            sel = torch.tensor([ids + [0] * (best - len(ids)) for ids in kept], dtype=torch.long, device=dev)
            out = Proposal(prop.tokens.gather(1, sel), TreeBatch.from_parent_lists(par_lists, device=dev),
                           None if prop.positions is None else prop.positions.gather(1, sel),
                           None if prop.draft_probs is None else prop.draft_probs.gather(
                               1, sel[:, :, None].expand(B, best, prop.draft_probs.shape[-1])))
        parents, depths, valid, _ = _per_sequence(out.tree, B, dev)
        keys_t = torch.tensor(keys, dtype=torch.long, device=dev)
        groups_t = torch.tensor(groups, dtype=torch.long, device=dev)
        expect = [0.0] * len(parts)  # each part's expected tokens: the P of its kept nodes, over the active sequences
        for b, ids in enumerate(kept):
            if b in ranked:
                for j in ids[1:]:
                    expect[shape[b][1][j]] += ranked[b][2][j]
        if len(ranked) > 1:  # each part's marginal progress: E[D] without its nodes and those under them
            without = [self._host_progress_without(p, shape, kept, ranked, lags, shares) if run else None
                       for p, run in enumerate(parts)]
            expect = _progress_shares(expect, expected[best - 1], without)
        self._charge(parts, part_ms, best, (keys_t, depths, valid, parents, groups_t), act, t1, expect=expect)
        return out

    @staticmethod
    def _host_progress_without(p: int, shape, kept: list[list[int]], ranked: dict, lags: list[int] | None,
                               shares: list[float] | None = None) -> float:
        """E[D] of the host cut's kept nodes (kept[b]: node ids, root first, in tree order) with part p's nodes and
        every node under one of them left out (their P is conditional on those), over the active sequences."""
        seqs = []
        for b, (order, _, P) in ranked.items():
            parents, groups = shape[b][0], shape[b][1]
            depth, out = {0: 0}, {0: False}  # per kept node: its depth, whether it or an ancestor is p's
            masses, depths = [1.0], [0]
            for j in kept[b][1:]:  # tree order: a parent before its children
                depth[j] = depth[parents[j]] + 1
                out[j] = out[parents[j]] or groups[j] == p
                if not out[j]:
                    masses.append(P[j])
                    depths.append(depth[j])
            seqs.append((masses, depths, lags[b] if lags else 0))
        return bottleneck_expected(seqs, max(len(m) for m, _, _ in seqs), [shares[b] for b in ranked] if shares else None
                                   )[-1]

    def _charge(self, parts, part_ms: list[float], width: int, vp, act, t1: float, gate_ms=None,
                n_seq: float | None = None, expect: list[float] | None = None) -> None:
        """Set the step in flight. The policy's own work on the proposal since t1 is part of what drafting cost
        (a trial that drafts nothing still pays it): charged to the parts that ran, so their gates weigh a
        trial's whole price (gate_ms: what the gates record instead, where it differs; see propose). act: the
        active sequences [B] float, or None where n_seq (their count, a host float) is given. expect: per part, the
        sum of P over its kept nodes and the active sequences (None: nothing verified), what its gate records as
        earned instead of the step's one draw of them, whose spread (0, 1 or 2 tokens where P says 0.9) closed gates on
        parts that paid. What the draws teach reaches the gates through the rates."""
        own_ms = (self.clock() - t1) * 1e3
        ran = max(sum(parts), 1)
        part_ms = [m + own_ms / ran if r else m for m, r in zip(part_ms, parts)]
        self.step = (parts, part_ms, width, vp, act, gate_ms, n_seq, expect)
        self.host_s += own_ms / 1e3

    # ---- after the step ---------------------------------------------------------------------------
    def observe(self, accept_indices: torch.Tensor | None, tokens: torch.Tensor | None = None,
                target: torch.Tensor | None = None) -> None:
        """accept_indices [B, D+1]: the verified tree's node ids along the accepted path (-1 past it; None
        for a plain step), after the step's host read. Times the step, learns the rates, judges the parts.
        tokens [B, T], target [B, T]: the verified tree's tokens and, under greedy acceptance, the base argmax after
        each node: the rates then learn from every verified node whose parent was right (_correct_nodes), not
        only from the accepted path."""
        t0 = self.clock()
        parts, part_ms, width, vp, act, gate_ms, n_seq, expect = self.step
        wall_ms = None  # the step's wall time, loop iteration to this call, and a plain step's before it
        plain_before = self.costs.plain()
        if self.last_t is not None:
            wall_ms = (t0 - self.last_t) * 1e3
            self.costs.observe(width, wall_ms - sum(part_ms))
        self.first = False
        self.calib.decay()
        if not any(parts):  # a plain step no part ran in: nothing to learn or judge (most steps of most runs)
            self.last_t = self.clock()
            self.host_s += self.last_t - t0
            return
        earned, rows = [0.0] * len(parts), [0.0] * len(parts)
        if n_seq is None:
            n_seq = float(act.sum()) if act is not None else float(self.batch)
        if vp is not None and accept_indices is not None:
            keys, depths, valid, parents, groups = vp
            # what the rates learn: each node whose parent was right, and whether it was (greedy: every branch; else
            # the accepted path, the only nodes a sampled acceptance judges)
            if target is None:
                B, T = keys.shape
                right = torch.zeros(B, T + 1, device=keys.device)
                right.scatter_(1, torch.where(accept_indices >= 0, accept_indices, T), 1.0)
                right = right[:, :T]
            else:
                right = _correct_nodes(tokens, target, parents, depths, valid)
            right = right * act[:, None]  # a sequence finished before the step accepts nothing
            drafted = valid & (depths > 0)
            self.calib.update(keys, right.gather(1, parents.clamp(min=0)) * drafted, right * drafted)
            n_active = max(n_seq, 1.0)
            if expect is not None:  # what each part earned: its kept nodes' expected tokens (see _charge)
                earned = list(expect)
            for p, ran in enumerate(parts):  # and the rows per sequence its nodes took
                if ran:
                    mine = (groups == p) & drafted & (act[:, None] > 0)  # a finished sequence's nodes count for nothing
                    rows[p] = float(mine.sum()) / n_active
        # whether a part pays: _pays. A part's measured cost includes the policy's learning from its step so far
        # (observe is not in the step's wall time): the probe cap (PROBE_SHARE) then bounds what trials really cost
        # (EPYC VM, 2026-11-29, batch 4, MT-Bench: a refused n-gram trial took ~0.33 ms of host work, ~0.2 of it
        # charged, so it was tried every 2 steps, ~1.5% of the decoding time). A cost propose fixed (gate_ms) is
        # recorded as it is
        own = (self.clock() - t0) * 1e3 / max(sum(parts), 1)
        # a trial verified as a plain step (refused by the check, or cut to the root): its price is what the step took
        # beyond a plain step where that is more than the host time it was charged. Xeon AMX VM, 2026-11-30, MT-Bench:
        # a refused n-gram trial was charged 0.14-0.17 ms (the lookups, the check, this call) where its step took
        # 0.2-0.3 ms more than a plain one at batch 2-4 (the call around the policy, the drafter's skip_step, and at
        # batch 4 the next native step 0.12 ms slower, the lookups' memory in its caches), so its trials, capped at
        # PROBE_SHARE_BATCHED of the time by that price, were ~1/4 of the steps and cost ~1% (batch 4, editing: 1.3%).
        # Shared among the parts that ran in proportion to what each was charged
        charged = sum(m for m, r in zip(part_ms, parts) if r)
        for p, ran in enumerate(parts):
            if ran:
                g = self.gates[p]
                plain = self.costs.predict(1)
                if not g.open:  # a trial: what it took, its rows included (a refused check: the check alone)
                    price = part_ms[p] + own + self.costs.rows(rows[p])
                    if width == 1 and wall_ms is not None:  # what the step took beyond a plain step, its share
                        share = part_ms[p] / charged if charged > 0 else 1.0 / sum(parts)
                        # the wall time bounded as the fit bounds a step: one stall (a page fault, the collector)
                        # must not set a part's trial price, and its cadence, for many trials
                        wall = StepCosts.bounded(wall_ms, plain_before)
                        price = max(price, (wall + own * sum(parts) - plain_before) * share)
                    g.record_trial(price)
                cost = gate_ms[p] if gate_ms is not None and gate_ms[p] else part_ms[p] + own
                g.record(earned[p], rows[p], cost, plain)
        for p, ran in enumerate(parts):
            if ran:
                g = self.gates[p]
                # a trial's price is what its trials took (most are checks refused before drafting: ~0.2-0.3 ms where
                # the n-gram's drafted steps cost ~1.2 ms at batch 1); before any, its drafting
                trial, plain = (g.trial if g.trial is not None else g.cost), self.costs.predict(1)
                # the ramp's floor from its drafting price alone (a trial's rows are paid by cheap parts too)
                floor = max(2, math.ceil(g.cost / (RAMP_SHARE * plain)))
                cap = MAX_WAIT_DEAR if dear(floor) else MAX_WAIT
                max_wait = min(cap, max(2, math.ceil(trial / (self.probe_share * plain))))
                min_wait = min(max_wait, floor)
                g.judge(self._pays(p, parts), max_wait, min_wait)
        self.last_t = self.clock()
        self.host_s += self.last_t - t0

    def _pays(self, p: int, parts: tuple[bool, ...]) -> bool:
        """Whether part p, beside the other parts that ran, pays (its gate's judgment, from the gates' recent means):
        its own rate beats the step's rate without it by the margin,
            gain / its_time > margin * tokens_without / time_without
        (at margin 1: the step's rate with it, (tokens_without + gain) / (time_without + its_time), beats the rate
        without it),
        tokens_without = 1 (a plain step's progress) + the others' gains (the gains in the batch's progress:
        _progress_shares; at batch 1 a sequence's tokens); time_without = a plain step + the others' drafting + their
        nodes' rows; its_time = its drafting + the rows its nodes add to the others' (the drafted step's surcharge c
        paid once). EPYC VM, 2026-11-29: priced without the others' rows, the rate without a part looked higher than it
        was whenever two parts ran, and the n-gram, weighed against the heads' tokens but not their rows, was held
        back on 2k-token prompts where it paid."""
        g = self.gates[p]
        others = [q for q, r in enumerate(parts) if r and q != p]
        other_nodes = sum(self.gates[q].nodes for q in others)
        tokens_without = 1.0 + sum(self.gates[q].gain for q in others)
        time_without = self.costs.predict(1) + sum(self.gates[q].cost for q in others) + self.costs.rows(other_nodes)
        its_time = g.cost + self.costs.rows(other_nodes + g.nodes) - self.costs.rows(other_nodes)
        return g.gain * time_without > self.margin * its_time * tokens_without

    def finish(self) -> None:
        self.calib.remember()
        self.costs.remember()
        self.memory[self.gate_key] = [copy.copy(g) for g in self.gates]


def shipped_rates(drafter, parts: tuple[str, ...]) -> torch.Tensor | None:
    """The drafter's acceptance prior (acceptance_prior.py) as Calibration's rates [K], or None where it has none. One
    keyed for other parts or another layout (MAX_DEPTH_KEY, SIGNALS) is not taken, with a warning: its rates would
    land on other keys."""
    prior = getattr(drafter, "acceptance_prior", None)  # a stand-in drafter (tests) may not define it
    if prior is None:
        return None
    if not prior.fits(parts, MAX_DEPTH_KEY, SIGNALS):
        import warnings

        warnings.warn(f"the {drafter.kind} drafter's acceptance prior keys parts {prior.parts} x {prior.max_depth_key} "
                      f"depths x {prior.signals} signals, the adaptive budget {list(parts)} x {MAX_DEPTH_KEY} x "
                      f"{SIGNALS}: not used (measure it again: python python/calibrate_acceptance.py)", RuntimeWarning,
                      stacklevel=3)
        return None
    return torch.tensor(prior.rates, dtype=torch.float32)


def _per_sequence(tree: Tree | TreeBatch, B: int, dev) -> tuple[torch.Tensor, ...]:
    """A proposal's tree as per-sequence buffers: parents, depths, valid [B, T], mask [B, T, T] (a static Tree's
    expanded, every node valid)."""
    if isinstance(tree, TreeBatch):
        return tree.parents, tree.depths, tree.valid, tree.mask
    T = tree.num_nodes
    return (tree.parents.to(dev).expand(B, T), tree.depths.to(dev).expand(B, T),
            torch.ones(B, T, dtype=torch.bool, device=dev), tree.mask.to(dev).expand(B, T, T))


def _correct_nodes(tokens: torch.Tensor, target: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """Under greedy acceptance, the verified nodes on the base model's own continuation: node j is right when its
    token is the base argmax after its parent (target [B, T]) and its parent is right (the root is). tokens, parents,
    depths, valid [B, T] -> float [B, T] (1: right).

    Why not the accepted path alone: where two siblings carry the same token (the n-gram's and a head's guess), the path
    takes one and the other looked rejected, and the nodes under a right branch the path did not take looked untried
    (EPYC VM, 2026-11-29, 2k-token prompts, gates open: the n-gram's 1-token matches were learned at 0.18 where 0.31 of
    them were right at depth 1 and 0.4-0.8 of their deeper nodes given a right parent)."""
    par = parents.clamp(min=0)
    match = ((tokens == target.gather(1, par)) | (depths == 0)) & valid  # a padding node is not right
    right = match
    for _ in range(int(depths.max())):  # one level of ancestors a pass
        right = match & right.gather(1, par)
    return right.to(torch.float32)


def sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, T] -> each node's rank among its siblings (0: its parent's first child) [B, T]."""
    T = parents.shape[1]
    same = parents[:, :, None] == parents[:, None, :]  # [B, i, j]
    earlier = torch.ones(T, T, dtype=torch.bool, device=parents.device).tril(-1)
    return (same & earlier).sum(2)


def path_products(parents: list[int], rates: list[float]) -> list[float]:
    """P per node of one sequence's tree (host lists, a parent before its children): the product of the conditional
    rates down its path, each clamped to [1e-6, 1], the root's 1. A padding node (parent -1) hangs off the root."""
    P = [1.0]
    for j in range(1, len(parents)):
        P.append(P[max(parents[j], 0)] * min(max(rates[j], 1e-6), 1.0))
    return P


def _cut(prop: Proposal, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
         sel: torch.Tensor) -> Proposal:
    """The proposal restricted to nodes sel [B, T] (increasing ids, each node's parent among them) as a
    TreeBatch of T nodes (TreeBatch.kept)."""
    B, T = sel.shape
    positions = None if prop.positions is None else prop.positions.gather(1, sel)
    probs = None if prop.draft_probs is None else \
        prop.draft_probs.gather(1, sel[:, :, None].expand(B, T, prop.draft_probs.shape[-1]))
    return Proposal(prop.tokens.gather(1, sel), TreeBatch.kept(parents, depths, mask, valid, sel), positions, probs)


def _progress_shares(expect: list[float], progress: float, without: list[float | None]) -> list[float]:
    """The parts' shares of a batched step's expected progress beyond a plain step's (progress - 1:
    bottleneck_expected's E[D] - 1 with the kept nodes), what their gates record as earned, in the units a plain
    step's 1 is in (_pays): in proportion to each part's marginal progress, progress - without[p] (E[D] with part
    p's kept nodes and the nodes under them left out; None: p did not run). Marginal, not by the P of its nodes: a
    part whose nodes only the sequences ahead would accept moves nothing and earns nothing (its P there would have
    kept its gate open while the other part moved the end). Where no part alone makes a difference (each one's nodes
    suffice), by their P (expect: their kept nodes' P summed over the active sequences). Batched steps only: at one
    active sequence the progress is the sum of P."""
    marginal = [max(progress - w, 0.0) if w is not None else 0.0 for w in without]
    weights = marginal if sum(marginal) > 0 else expect
    total = sum(weights)
    return [x * (progress - 1.0) / total for x in weights] if total > 0 else [0.0] * len(expect)


def bottleneck_lags(emitted: list[int] | None, active: list[int]) -> list[int] | None:
    """Each active sequence's lead over the active sequence that has emitted the fewest tokens, g_b >= 0 (a finished
    sequence's: 0, unused); None where emitted is unknown (every sequence taken as level)."""
    if emitted is None:
        return None
    live = [e for e, a in zip(emitted, active) if a]
    low = min(live, default=0)
    return [e - low if a else 0 for e, a in zip(emitted, active)]


def bottleneck_expected(seqs: list[tuple[list[float], list[int], int]], T0: int, shares: list[float] | None = None
                        ) -> list[float]:
    """The batch's expected progress per verified width w = 1 .. T0, E[D](w), where each active sequence keeps its w
    best nodes. seqs: per active sequence (its nodes' P in rank order, root first; their depths in the same order;
    its lead g over the sequence furthest behind, bottleneck_lags).

    Why not the sum of the sequences' expected tokens: generate() decodes a fixed batch, which ends when its last
    sequence does (a finished sequence's rows still go through the weights; only its attention is skipped: `shares`
    below), so its tokens per second are B * N / (the last one's finishing time). A draft that only the sequences ahead
    accept finishes nobody sooner: Xeon AMX VM, 2026-11-30, batch 2, editing prompts, 64 tokens: one sequence copied its text through 6-node steps at 3.2x a
    plain step's time while the other accepted nothing: 62 steps for plain decoding's 64, 930 ms against 647.
    So a step is worth how far it moves the end: with r_b the tokens sequence b has left (the same cap for all, so
    r_max - r_b = g_b) and a_b >= 1 the tokens it emits this step,
        D = r_max - max_b (r_b - a_b) >= 1,   E[D] = sum_{k>=1} P(D >= k) = 1 + sum_{d>=1} prod_b S_b(d - g_b),
    S_b(d) = P(a_b >= d + 1) = the sum of P over b's kept nodes at depth d (siblings are disjoint events), 1 for
    d <= 0 (a sequence g ahead does not hold the end back for its first g tokens), capped at 1 (siblings' P can sum
    past it: each node's rate is learned on its own, and the combined drafter's n-gram and head may guess the same
    token); the sequences' acceptances are taken as independent. At one active sequence E[D] = 1 + the sum of its kept
    P (where no depth's sum passes 1): the single sequence's expected tokens, which a batch of one (propose) uses
    uncapped, as before. Under EOS a sequence's length is not its cap; a finished one leaves the product, and the
    cap is the only length known beforehand.

    shares (None: none): per sequence, a_b, the share of a plain step that attends to its K/V (attention_share.py), which
    the batch stops paying once b has finished: its attention is skipped (speculative.py's `attend`), and at long context
    it is most of the step (0.88 at batch 2, 8000 keys). With the step's time split as W + sum_b A_b over the active
    sequences, the batch's remaining time is W * (its last sequence's finishing step) + sum_b A_b * (b's finishing step),
    so a token b gains saves W's share only where it moves the end, and b's own A_b always. In a plain step's units:
        E(w) = 1 + (1 - sum_b a_b) * (E[D](w) - 1) + sum_b a_b * (E_b(w) - 1),
    E_b(w) - 1 = sum_d min(S_b(d), 1), b's own expected tokens (its lead does not matter: its attention ends when it
    does). EPYC VM, 2026-12-01, batch 2, 8000-token prompts (question 20), 64 tokens, once a finished sequence's
    attention was spread over both threads (csrc/tree_attention_cpu.cpp: a step with one finished 27 ms, both
    attending 47): the budget table's fixed 2-node steps, 1.55 tokens a step, ran 1.12-1.26x plain; this policy without
    shares 1.00-1.08x, with them 1.03-1.16x (+1.4 to +8.2 points in each of three paired runs at 8000 keys)."""
    out = _bottleneck_only(seqs, T0)
    if shares is None or not any(shares):
        return out
    least = 1.0 - sum(shares)
    own = [0.0] * T0  # sum_b a_b * (E_b(w) - 1)
    for (P, dep, _), a in zip(seqs, shares):
        if not a:
            continue
        S = [0.0] * (max(dep) + 1)
        total = 0.0
        for w in range(T0):
            if w < len(P) and dep[w] > 0:
                d = dep[w]
                total += min(S[d] + P[w], 1.0) - min(S[d], 1.0)
                S[d] += P[w]
            own[w] += a * total
    return [1.0 + least * (e - 1.0) + o for e, o in zip(out, own)]


def _bottleneck_only(seqs: list[tuple[list[float], list[int], int]], T0: int) -> list[float]:
    """bottleneck_expected's E[D](w) alone (no shares)."""
    # past depth g_b + (b's deepest node) sequence b's factor is 0, so every depth beyond the least of those adds
    # nothing: a sequence furthest behind with no draft makes every width's progress 1 at once (most checks at batch 16)
    top = min((g + max(dep) for _, dep, g in seqs), default=0)
    if top == 0:
        return [1.0] * T0
    seqs = [s for s in seqs if s[2] < top]  # a lead past every depth in play: factor 1 throughout
    S = [[0.0] * (top + 1) for _ in seqs]
    expected = []
    for w in range(T0):
        for (P, dep, _), s in zip(seqs, S):
            if w < len(P) and 0 < dep[w] <= top:  # the root (depth 0) is every sequence's first node
                s[dep[w]] += P[w]
        total = 1.0
        for d in range(1, top + 1):
            prod = 1.0
            for (_, _, g), s in zip(seqs, S):
                if d > g:
                    prod *= min(s[d - g], 1.0)
            total += prod
        expected.append(total)
    return expected


class _ProgressBound:
    """An upper bound on bottleneck_expected at every width, tightened one sequence at a time, so that a batched check
    refuses a draft as soon as the sequences ranked so far show that no width pays (_least_paying), without ranking the
    rest: at batch 16 a check ranked 16 sequences (~0.27 ms, Xeon AMX VM, 2026-11-30) where the first few sequences'
    nodes already bound the batch's progress below what pays. Exact: it refuses only where the whole check would.

    Why it bounds: E[D](w) = 1 + sum_d prod_b S_b(d - g_b) grows with w (more nodes, more P at their depths), so its
    value with every node kept bounds every width's; each factor S_b(d) is capped at 1 (bottleneck_expected: it is a
    probability), so a sequence not ranked yet multiplies by at most 1; and past g_b + (b's drafted nodes) b's factor
    is 0, so depths beyond the least of those add nothing. With shares (bottleneck_expected's a_b), each sequence's own
    term a_b * sum_d min(S_b(d), 1) is at most a_b times its outline's depth before it is ranked, and exact after."""

    def __init__(self, shape, live: list[int], lags: list[int] | None, least: float, shares: list[float] | None = None):
        lag = {b: lags[b] if lags else 0 for b in live}
        self.order = sorted(live, key=lambda b: (lag[b], len(shape[b][0])))  # behind first, then the smaller drafts
        self.lag, self.least = lag, least
        self.top = min(lag[b] + len(shape[b][0]) - 1 for b in live)
        self.prod = [1.0] * (self.top + 1)  # [d]: the product over the sequences ranked so far (d = 1 .. top)
        self.shares = shares if shares is not None and any(shares) else None
        self.own = 0.0  # sum_b a_b * (b's own gain: exact once ranked, its outline's depth before)
        if self.shares is not None:
            self.bn = 1.0 - sum(self.shares[b] for b in live)
            self.own = sum(self.shares[b] * max(node_depths(shape[b][0])) for b in live)

    def refuses(self, P: list[float], depth: list[int], b: int) -> bool:
        """Sequence b ranked (P and depth per node): is the bound now below the least progress that pays?"""
        S = [0.0] * (self.top + 1)
        for p, d in zip(P, depth):
            if 0 < d <= self.top:
                S[d] += p
        g = self.lag[b]
        for d in range(g + 1, self.top + 1):
            self.prod[d] *= min(S[d - g], 1.0)
        if self.shares is not None:  # b's own term, exact now: its outline's depth was counted before
            own = [0.0] * (max(depth) + 1)
            for p, d in zip(P, depth):
                own[d] += p if d > 0 else 0.0
            self.own += self.shares[b] * (sum(min(x, 1.0) for x in own[1:]) - max(depth))
        return self.value() < self.least

    def value(self) -> float:
        """The bound on the batch's expected progress at every width, from the sequences ranked so far."""
        if self.shares is None:
            return 1.0 + sum(self.prod[1:])
        return 1.0 + self.bn * sum(self.prod[1:]) + self.own


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree given by its parent list (root -1 at 0, parents before children)."""
    depth = [0] * len(parents)
    for j in range(1, len(parents)):
        depth[j] = depth[parents[j]] + 1
    return depth


def bottleneck_expected_tensor(P: torch.Tensor, order: torch.Tensor, depths: torch.Tensor, act: torch.Tensor,
                               lags: list[int] | None, shares: list[float] | None = None) -> list[float]:
    """bottleneck_expected from propose()'s tensors: P [B, T0] (0 off the tree), order [B, T0] (each sequence's nodes
    by P, root first), depths [B, T0], act [B] (0: finished, its factor 1), shares [B] (0 where finished) or None."""
    B, T0 = P.shape
    top = max(int(depths.max()), 1)
    d = torch.arange(1, top + 1, device=P.device)
    ds = depths.gather(1, order)
    S = (P.gather(1, order)[:, :, None] * (ds[:, :, None] == d)).cumsum(1)  # [B, T0, top]: b's best w nodes' P at d
    g = torch.tensor(lags if lags is not None else [0] * B, device=P.device)
    src = d[None, :] - g[:, None]  # [B, top]: the depth of b's own that depth d of the batch's progress needs
    Sg = S.gather(2, (src.clamp(min=1) - 1)[:, None, :].expand(B, T0, top))
    Sg = torch.where((src[:, None, :] >= 1) & (act[:, None, None] > 0), Sg.clamp(max=1.0), torch.ones_like(Sg))
    gain = Sg.prod(0).sum(-1)  # [T0]: E[D] - 1
    if shares is not None and any(shares):
        a = torch.tensor(shares, dtype=P.dtype, device=P.device)
        own = S.clamp(max=1.0).sum(-1)  # [B, T0]: each sequence's own expected tokens beyond its first
        gain = (1.0 - a.sum()) * gain + (a[:, None] * own).sum(0)
    return (1.0 + gain).tolist()
