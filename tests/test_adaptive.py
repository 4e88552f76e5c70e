"""The adaptive draft budget (hydra_kernels/adaptive.py): greedy output stays plain greedy's for every
family whatever the policy chooses (random costs and part gates force every width, part subset, a plain
step after proposing, and no drafting at all); a cut proposal is the induced subtree of the kept nodes;
the policy drafts where the learned acceptance pays for the measured rows and not where it does not; the
run's figures (per-sequence nodes, acceptance by depth, the policy's host time) add up; budget='adaptive'
and the default are wired as documented. Sampling exactness with the policy on: test_sampling_exactness.py
(its "adaptive-..." settings)."""
from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import adaptive
from hydra_kernels.adaptive import AdaptiveBudget, _cut, sibling_rank
from hydra_kernels.budget import choose
from hydra_kernels.drafters.protocol import PENDING_SIGNAL, Proposal
from hydra_kernels.generate import generate
from hydra_kernels.tree import TreeBatch
from test_budget import FAMILIES, PROMPTS, make, model, randomised  # noqa: F401 (model: the fixture)


def randomise_policy(monkeypatch, seed: int) -> None:
    """Costs and gates from a seeded RNG: every step's width and parts are arbitrary (never the draws')."""
    rng = random.Random(seed)
    monkeypatch.setattr(adaptive, "memory", lambda owner, name: {})  # no earlier run's learning: any test order
    monkeypatch.setattr(adaptive.StepCosts, "predict", lambda self, w: rng.uniform(1.0, 4.0) * (1 + rng.random() * (w - 1)))
    monkeypatch.setattr(adaptive.PartGate, "due", lambda self: rng.random() < 0.8)


def check_outlines(drafter) -> list[int]:
    """Wraps drafter.propose: each proposal must be the tree Drafter.outline gave just before it (parents,
    parts, signal or sibling ranks, per sequence; a pending signal stands for any class). Returns [proposals checked]."""
    propose, checked = drafter.propose, [0]

    def wrapped(state, root, seqlens):
        shape = drafter.outline(state, root.shape[0])
        prop = propose(state, root, seqlens)
        if shape is not None:
            B, T = prop.tokens.shape
            tr = prop.tree
            parents = tr.parents.expand(B, T) if isinstance(tr, hk.tree.Tree) else tr.parents
            valid = torch.ones(B, T, dtype=torch.bool) if isinstance(tr, hk.tree.Tree) else tr.valid
            groups = prop.groups if prop.groups is not None else torch.zeros(B, T, dtype=torch.long)
            signal = prop.signal if prop.signal is not None else sibling_rank(parents)
            assert len(shape) == B
            for b, (par, grp, sig) in enumerate(shape):
                n = len(par)
                assert int(valid[b].sum()) == n and parents[b, :n].tolist() == par, (b, par, parents[b])
                got = signal[b, :n].tolist()  # a pending class (a head's guess): any class its drafting gives
                assert groups[b, :n].tolist() == grp and all(x == y or y == PENDING_SIGNAL for x, y in zip(got, sig)), b
                assert all(0 <= x < adaptive.SIGNALS for x in got), got
            checked[0] += 1
        return prop

    drafter.propose = wrapped
    return checked


OUTLINED = ("medusa", "hydra", "hydra++", "eagle-static", "amphista", "ngram", "combined")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_any_choice_of_the_policy_is_lossless(model, name, monkeypatch):  # noqa: F811
    """budget='adaptive' with random costs and gates: plain greedy's tokens, batched, ragged prompts; the
    steps verified plain steps and cut trees of several widths; every proposal is the tree its outline (the
    host pre-check's input) said it would be. EAGLE's and Amphista's plain steps' backlog is run every few
    positions (drafters/backlog.py), so its flushes happen mid-run too."""
    from hydra_kernels.drafters import backlog

    monkeypatch.setattr(backlog, "BACKLOG_ROWS", 3)
    randomise_policy(monkeypatch, seed=len(name))
    d, tree = make(model, name)
    checked = check_outlines(d)
    plain = generate(model, PROMPTS, max_new_tokens=24, eos_token_id=[])
    out = generate(model, PROMPTS, drafter=d, tree=tree, budget="adaptive", max_new_tokens=24, eos_token_id=[],
                   backend="reference")
    assert out.sequences == plain.sequences
    assert 1 in out.step_nodes and len(set(out.step_nodes)) >= 2, out.step_nodes
    assert [len(s) for s in out.seq_step_nodes] == [len(a) for a in out.accept_lengths]
    assert all(a >= 0 for a in out.depth_accepted)
    assert all(x <= y for x, y in zip(out.depth_accepted[1:], out.depth_drafted[1:]))
    assert (checked[0] > 0) == (name in OUTLINED), checked


def test_the_real_policy_is_lossless_on_the_real_model(monkeypatch):
    """The embedded SmolLM2 (quantized CPU base) and the shipped default drafter, timed costs (no
    randomisation): identical to plain greedy, batch 1 and batch 3, and the policy's host time is reported. The
    loop tells the policy what each sequence has emitted before each step (at batch 1: nothing, none needed)."""
    m, tok = hk.load_model()
    d = hk.load_drafter(model=m)
    from hydra_kernels.chat import chat_prompt_ids

    told, steps = [], [0]  # (emitted, the steps observed before it) per proposal
    propose, observe = AdaptiveBudget.propose, AdaptiveBudget.observe
    monkeypatch.setattr(AdaptiveBudget, "propose", lambda self, *a: told.append((a[6], steps[0])) or propose(self, *a))
    monkeypatch.setattr(AdaptiveBudget, "observe",
                        lambda self, *a, **k: steps.__setitem__(0, steps[0] + 1) or observe(self, *a, **k))
    prompts = [chat_prompt_ids(tok, p) for p in ("Repeat after me: the quick brown fox jumps over the lazy dog. "
                                                 "The quick brown fox jumps over the lazy dog.",
                                                 "Name three colours.", "Write a haiku about rain.")]
    for batch in (prompts[:1], prompts):
        told.clear()
        steps[0] = 0
        plain = generate(m, batch, max_new_tokens=40)
        out = generate(m, batch, drafter=d, max_new_tokens=40, budget="adaptive")
        assert out.sequences == plain.sequences
        assert out.policy_s > 0 and len(out.step_nodes) == out.num_steps
        assert told, "the policy proposed no step"
        for emitted, s in told:  # the prefill's token and each earlier step's (s steps before this one)
            assert emitted == (None if len(batch) == 1 else [1 + sum(a[:s]) for a in out.accept_lengths])


def test_a_cut_is_the_induced_subtree():
    """_cut keeps the chosen nodes' tokens, positions and draft rows, and each kept node's ancestors are
    exactly its original ancestors among the kept nodes."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 9
    parents = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        for j in range(1, T):
            parents[b, j] = int(torch.randint(0, j, (1,), generator=g))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[2, 6:] = False  # a shorter tree in the batch
    parents[2, 6:] = -1
    tree = TreeBatch(parents, valid)
    tokens = torch.randint(0, 50, (B, T), generator=g)
    positions = torch.randint(0, 50, (B, T), generator=g)
    probs = torch.rand(B, T, 7, generator=g)
    # keep a parent-closed set per sequence: the root and the first 4 nodes' closure
    sel = []
    for b in range(B):
        keep = {0}
        for j in range(1, T):
            if len(keep) < 5 and bool(valid[b, j]) and int(parents[b, j]) in keep:
                keep.add(j)
        keep = sorted(keep) + [j for j in range(T) if j not in keep][: 5 - len(keep)]
        sel.append(sorted(keep[:5]))
    sel = torch.tensor(sel)
    cut = _cut(Proposal(tokens, tree, positions, probs), tree.parents, tree.depths, tree.mask, tree.valid, sel)
    again = TreeBatch(cut.tree.parents, cut.tree.valid)  # the constructor's own build of the same trees
    for name in ("parents", "depths", "mask", "valid", "paths"):
        assert torch.equal(getattr(cut.tree, name), getattr(again, name)), name
    assert torch.equal(cut.tokens, tokens.gather(1, sel)) and torch.equal(cut.positions, positions.gather(1, sel))
    assert torch.equal(cut.draft_probs, probs[torch.arange(B)[:, None], sel])
    for b in range(B):
        for i in range(5):
            if not bool(cut.tree.valid[b, i]):
                continue
            old = int(sel[b, i])
            want = {k for k in range(5) if bool(tree.mask[b, old, int(sel[b, k])])}
            got = {k for k in range(5) if bool(cut.tree.mask[b, i, k])}
            assert got == want, (b, i)


def test_sibling_rank():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 0, 3]])
    assert sibling_rank(parents).tolist() == [[0, 0, 1, 0, 1, 2, 0]]


class OneChainDrafter:
    """A stand-in drafter for the policy alone: a chain of 4 nodes per sequence."""

    parts = ("draft",)
    prunable_proposals = True

    def __init__(self):
        self.sizes = []  # size_part's bounds, in order

    def set_parts(self, state, parts):
        pass

    def size_part(self, state, part, nodes):
        self.sizes.append(nodes)

    def part_times(self, state):
        return [0.0]

    def outline(self, state, batch):
        return None  # the policy judges the drafted proposal

    def skip_step(self, state, root, seqlens):
        self.skipped = getattr(self, "skipped", 0) + 1

    def propose(self, state, root, seqlens):
        self.proposed = getattr(self, "proposed", 0) + 1
        B = root.shape[0]
        return Proposal(torch.arange(5).expand(B, 5).clone(), hk.tree.chain(4))


class OutlinedChainDrafter(OneChainDrafter):
    """The same chain, its shape known before drafting (Drafter.outline, as a static tree's)."""

    def outline(self, state, batch):
        return hk.drafters.protocol.Drafter.outline(self, state, batch)

    def static_tree(self, state):
        return hk.tree.chain(4)


def learned_policy(rate: float, row_ms: float, batch: int = 2, drafter=None) -> AdaptiveBudget:
    p = AdaptiveBudget(drafter or OneChainDrafter(), batch, 5, OneChainDrafter(), torch.device("cpu"),
                       clock=lambda: 0.0)
    p.calib.tested.fill_(1000.0)
    p.calib.accepted.fill_(1000.0 * rate)
    p.costs.coef = [10.0, row_ms]
    return p


@pytest.mark.parametrize("rate, row_ms, batch, width", [(0.9, 0.5, 2, 5), (0.9, 100.0, 2, 1), (0.05, 2.0, 2, 1),
                                                        (0.5, 1.0, 1, 3), (0.5, 1.0, 2, 1), (0.7, 0.5, 2, 4),
                                                        (0.9, 0.5, 3, 5), (0.2, 1.0, 1, 2), (0.2, 1.0, 2, 1)])
def test_the_policy_drafts_only_what_pays(rate, row_ms, batch, width):
    """Chain nodes accepted at `rate` each, a row costing row_ms beside a 10 ms step, `batch` sequences level (none has
    emitted more than another): the width chosen maximises the batch's expected progress per ms,
    (1 + rate^B + rate^2B + ...) / (10 + row_ms (w - 1)) (depth d moves the end only where every sequence accepts
    it: adaptive.bottleneck_expected; at batch 1 a sequence's expected tokens: 0.5 / 1 ms: 1.75 / 12 beats 1.5 / 11
    and 1.875 / 13), where it beats a plain step by the margin (adaptive.MARGIN at batch >= 2: 0.5 / 1 ms at batch 2,
    1.25 / 11 is 1.14x 1 / 10: plain; MARGIN_BATCH_1 at batch 1: 0.2 / 1 ms, 1.2 / 11 is 1.09x: drafted)."""
    for d in (OneChainDrafter(), OutlinedChainDrafter()):
        p = learned_policy(rate, row_ms, batch=batch, drafter=d)
        out = p.propose(d, None, torch.zeros(batch, dtype=torch.long), None, torch.ones(batch, dtype=torch.long),
                        (True,), [7] * batch)
        got = 1 if out is None else out.tree.num_nodes
        assert got == width
        r = {w: sum(rate**(batch * k) for k in range(w)) / (10 + row_ms * (w - 1)) for w in range(1, 6)}
        expect = max(r, key=r.get)
        assert got == (expect if r[expect] >= p.margin * r[1] else 1)
        assert p.margin == (adaptive.MARGIN if batch > 1 else adaptive.MARGIN_BATCH_1)
        # a drafter whose outline shows the draft would be cut to the root is not asked to draft: it skips
        outlined = isinstance(d, OutlinedChainDrafter)
        assert getattr(d, "proposed", 0) == (0 if outlined and width == 1 else 1)
        assert getattr(d, "skipped", 0) == (1 if outlined and width == 1 else 0)


def _enumerated_progress(trees, lags, w, shares=None):
    """E[D] of a batch by enumeration: each sequence keeps its w best nodes (P, ties to the lower id); it emits a >= 1
    tokens with P(a >= d + 1) = the kept P at depth d; D = r_max - max_b (r_b - a_b), r_b = r_max - its lead. With
    shares a_b (each sequence's attention's share of a step): E[(1 - sum_b a_b) D + sum_b a_b a_b-tokens], the step's
    saving in plain steps when the weights' share W moves with the end and each A_b with its own sequence."""
    shares = shares or [0.0] * len(trees)
    outcomes = []
    for parents, P in trees:
        depth = [0] * len(parents)
        for j in range(1, len(parents)):
            depth[j] = depth[parents[j]] + 1
        S = {}
        for j in sorted(range(len(P)), key=lambda j: -P[j])[:w]:
            if depth[j]:
                S[depth[j]] = S.get(depth[j], 0.0) + P[j]
        s = lambda d: 1.0 if d <= 0 else S.get(d, 0.0)  # noqa: E731
        outcomes.append([(a, s(a - 1) - s(a)) for a in range(1, max(S, default=0) + 2)])
    E = 0.0
    for combo in itertools.product(*outcomes):
        D = -max(-g - a for (a, _), g in zip(combo, lags))
        E += math.prod(p for _, p in combo) * ((1.0 - sum(shares)) * D + sum(x * a for (a, _), x in zip(combo, shares)))
    return E


def _random_trees(rng, B):
    """B random trees (parents, P), siblings' rates summing to at most 1 (disjoint events), often one with no draft."""
    trees = []
    for b in range(B):
        n = 1 if b == B - 1 and rng.random() < 0.3 else rng.randint(1, 6)
        parents = [-1] + [rng.randrange(j) for j in range(1, n)]
        rate = [1.0] * n
        for q in set(parents[1:]):
            kids = [j for j in range(1, n) if parents[j] == q]
            w = [rng.random() for _ in kids]
            for j, x in zip(kids, w):
                rate[j] = x / sum(w) * rng.uniform(0.3, 1.0)
        P = [1.0]
        for j in range(1, n):
            P.append(P[parents[j]] * rate[j])
        trees.append((parents, P))
    return trees


def _ranked(trees):
    """bottleneck_expected's per-sequence lists (P and depth in rank order) and the tensor form's P / depths [B, T0]."""
    B, T0 = len(trees), max(len(p) for p, _ in trees)
    seqs, Pt, dt = [], torch.zeros(B, T0, dtype=torch.float64), torch.zeros(B, T0, dtype=torch.long)
    for b, (parents, P) in enumerate(trees):
        depth = [0] * len(parents)
        for j in range(1, len(parents)):
            depth[j] = depth[parents[j]] + 1
        order = sorted(range(len(P)), key=lambda j: -P[j])
        seqs.append(([P[j] for j in order], [depth[j] for j in order]))
        Pt[b, :len(P)], dt[b, :len(P)] = torch.tensor(P, dtype=torch.float64), torch.tensor(depth)
    return seqs, Pt, dt


@pytest.mark.parametrize("seed", range(4))
def test_the_batchs_progress_is_what_moves_its_last_sequence(seed):
    """bottleneck_expected (the host's) and bottleneck_expected_tensor give the expected progress of the batch's end
    that enumerating every sequence's accepted length gives: random trees of 1-6 nodes per sequence (siblings' rates
    summing to at most 1: disjoint events), 2-4 sequences, leads of 0-3 tokens, one with no draft, every width."""
    rng = random.Random(seed)
    for _ in range(25):
        B = rng.randint(2, 4)
        trees = _random_trees(rng, B)
        lead = [rng.choice([0, 0, 1, 3]) for _ in range(B)]
        lags = adaptive.bottleneck_lags(lead, [1] * B)
        T0 = max(len(p) for p, _ in trees)
        seqs, Pt, dt = _ranked(trees)
        seqs = [(P, dep, g) for (P, dep), g in zip(seqs, lags)]
        host = adaptive.bottleneck_expected(seqs, T0)
        order = torch.sort(Pt, dim=1, descending=True, stable=True).indices
        tensor = adaptive.bottleneck_expected_tensor(Pt, order, dt, torch.ones(B), lags)
        for w in range(1, T0 + 1):
            want = _enumerated_progress(trees, lags, w)
            assert host[w - 1] == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert tensor[w - 1] == pytest.approx(want, rel=1e-12, abs=1e-12)
    # a finished sequence (act 0) holds nothing back; a lead beyond every depth in play neither
    P = torch.tensor([[1.0, 0.8, 0.6], [1.0, 0.0, 0.0]])
    d, order = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([[0, 1, 2], [0, 1, 2]])
    assert adaptive.bottleneck_expected_tensor(P, order, d, torch.tensor([1.0, 0.0]), [0, 0]) == pytest.approx(
        [1.0, 1.8, 2.4])
    assert adaptive.bottleneck_expected_tensor(P, order, d, torch.ones(2), [0, 5]) == pytest.approx([1.0, 1.8, 2.4])
    assert adaptive.bottleneck_expected([([1.0, 0.8, 0.6], [0, 1, 2], 0), ([1.0], [0], 5)], 3) == pytest.approx(
        [1.0, 1.8, 2.4])


@pytest.mark.parametrize("seed", range(4))
def test_each_sequences_own_tokens_count_at_its_attention_share(seed):
    """With shares a_b (attention_share.py: the part of a step that attends to sequence b, which the batch stops paying
    when b finishes), bottleneck_expected (host and tensor forms) is E[(1 - sum a) D + sum_b a_b (b's tokens)] by
    enumeration: random trees, 2-4 sequences, leads, random shares summing to at most 1, a finished sequence (share 0,
    act 0), every width. A sequence ahead of the others, or the others with no draft, still moves its own share."""
    rng = random.Random(100 + seed)
    for _ in range(25):
        B = rng.randint(2, 4)
        trees = _random_trees(rng, B)
        act = [1] * B
        if B > 2 and rng.random() < 0.5:
            act[rng.randrange(B)] = 0
            trees = [t if a else ([-1], [1.0]) for t, a in zip(trees, act)]  # a finished sequence drafts nothing
        lags = adaptive.bottleneck_lags([rng.choice([0, 0, 1, 3]) for _ in range(B)], act)
        raw = [rng.random() * a for a in act]
        shares = [x / (sum(raw) + rng.uniform(0.0, 1.0)) for x in raw]
        T0 = max(len(p) for p, _ in trees)
        seqs, Pt, dt = _ranked(trees)
        live = [b for b in range(B) if act[b]]
        host = adaptive.bottleneck_expected([(*seqs[b], lags[b]) for b in live], T0, [shares[b] for b in live])
        order = torch.sort(Pt, dim=1, descending=True, stable=True).indices
        tensor = adaptive.bottleneck_expected_tensor(Pt, order, dt, torch.tensor(act, dtype=torch.float64), lags,
                                                     shares)
        for w in range(1, T0 + 1):
            want = _enumerated_progress([trees[b] for b in live], [lags[b] for b in live], w,
                                        [shares[b] for b in live])
            assert host[w - 1] == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert tensor[w - 1] == pytest.approx(want, rel=1e-12, abs=1e-12)
    # level sequences, one with no draft: E[D] is 1, but the other's own tokens count at its share
    seqs = [([1.0, 0.8, 0.6], [0, 1, 2], 0), ([1.0], [0], 0)]
    assert adaptive.bottleneck_expected(seqs, 3) == [1.0, 1.0, 1.0]
    assert adaptive.bottleneck_expected(seqs, 3, [0.4, 0.4]) == pytest.approx([1.0, 1.32, 1.56])


def test_at_long_context_a_draft_the_end_alone_refuses_is_verified():
    """Batch 2 level at 8000 tokens, a 4-node chain each accepted at 0.55 a node, a row 2.6 ms beside a 10 ms step
    (a 2-node step 1.26x a plain one): by the end alone a width-2 step is worth 1 + 0.55^2 = 1.30 tokens for 12.6 ms,
    1.03x a plain step's rate, under the margin, so the step is plain. With the K/V bytes of SmolLM2 (46080 a token
    beside 96.6 MB of weights: each sequence's attention 0.442 of a step) it is worth
    1 + 0.116 * 0.3025 + 0.884 * 0.55 = 1.52, 1.21x: width 2 (width 3: 1.80 for 15.2 ms, 1.18x). Host check and tensor
    cut alike; at short context (150 tokens: shares 0.06) still plain."""
    for d in (OneChainDrafter(), OutlinedChainDrafter()):
        for ctx, want in ((8000, 2), (150, 1), (None, 1)):
            p = learned_policy(0.55, 2.6, batch=2, drafter=d)
            p.kv_per_weight = 46080 / 96.576768e6 if ctx else 0.0
            out = p.propose(d, None, torch.zeros(2, dtype=torch.long), torch.tensor([ctx or 0] * 2),
                            torch.ones(2, dtype=torch.long), (True,), [7, 7])
            assert (1 if out is None else out.tree.num_nodes) == want, (type(d).__name__, ctx)


def test_attention_shares_split_a_step_by_its_bytes(model):  # noqa: F811
    """attention_share: a step's weight bytes are its linears' streamed bytes and the norms; a token's K/V bytes are
    2 x layers x KV heads x head_dim x the dtype's size; each active sequence's share is its K/V over the weights plus
    every active sequence's K/V (a finished one: 0), so the shares and the weights' share add up to 1."""
    from hydra_kernels.attention_share import attention_shares, kv_bytes_per_token, kv_per_weight_byte, \
        weight_bytes_per_step
    c = model.config
    assert kv_bytes_per_token(model) == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # fp32
    W = weight_bytes_per_step(model)
    assert W >= sum(p.numel() for n, p in model.named_parameters() if "layers" in n and "weight" in n) // 8
    k = kv_per_weight_byte(model)
    assert k == pytest.approx(kv_bytes_per_token(model) / W)
    shares = attention_shares([100, 3000, 50], [1, 1, 0], k)
    x = [100 * k, 3000 * k]
    assert shares == pytest.approx([x[0] / (1 + sum(x)), x[1] / (1 + sum(x)), 0.0])
    assert 1.0 - sum(shares) == pytest.approx(1.0 / (1.0 + sum(x)))


@pytest.mark.parametrize("outlined", [False, True])
def test_a_draft_only_the_sequences_ahead_accept_is_not_verified(outlined):
    """Batch 2, a 4-node chain each, sequence 0's nodes accepted at 0.95, sequence 1's at 0.05 (its own counts), rows
    cheap: drafted while sequence 0 is the one behind (sequence 1 ahead by more than the chain is deep: its nodes do not
    hold the end back), not drafted while the two are level or sequence 0 is ahead (sequence 1's nodes would move the
    end: E[D] = 1 + 0.95 * 0.05 + ... = 1.05 for 1.2x a plain step's time). The sum of the sequences' expected tokens
    (the objective before 2026-11-30) drafted the whole chain in all three: 2 + 3.52 + 0.05 tokens against 2."""
    widths = {}
    for emitted in ([5, 10], [7, 7], [10, 5]):
        d = OutlinedChainDrafter() if outlined else OneChainDrafter()
        p = learned_policy(0.5, 0.5, batch=2, drafter=d)
        keys = p.calib.keys(torch.zeros(4, dtype=torch.long), torch.arange(1, 5), torch.zeros(4, dtype=torch.long))
        for b, rate in ((0, 0.95), (1, 0.05)):
            p.calib.seq_tested[b, keys] = 1000.0
            p.calib.seq_accepted[b, keys] = 1000.0 * rate
        out = p.propose(d, None, torch.zeros(2, dtype=torch.long), None, torch.ones(2, dtype=torch.long), (True,),
                        emitted)
        widths[tuple(emitted)] = 1 if out is None else out.tree.num_nodes
    assert widths == {(5, 10): 5, (7, 7): 1, (10, 5): 1}


def test_a_draft_stopped_by_its_outline_is_judged_at_its_parts_drafting_cost():
    """A draft the outline shows would be cut is not drafted; its part's gate records a trial that earned
    nothing at the part's known drafting cost (not the check's): its trial schedule stays the one a drafted
    trial would set, its first wait the floor that price sets (RAMP_SHARE)."""
    d = OutlinedChainDrafter()
    p = learned_policy(0.05, 2.0, drafter=d)  # the draft would be cut to the root
    g = p.gates[0]
    g.record(0.5, 1.0, 3.0)  # an earlier drafted trial: half a plain step's progress earned, 3 ms of drafting
    assert p.propose(d, None, torch.zeros(2, dtype=torch.long), None, torch.ones(2, dtype=torch.long), (True,)) is None
    assert getattr(d, "proposed", 0) == 0 and d.skipped == 1
    p.observe(None)
    assert g.cost == pytest.approx(3.0) and g.gain == pytest.approx(0.35)  # the mean gain: 0.7 * 0.5 + 0.3 * 0
    assert not g.open
    # its wait starts at the ramp's floor for a 3 ms trial beside a 10 ms plain step: ceil(3 / (RAMP_SHARE * 10)) = 3,
    # not the ramp's 2
    assert g.wait == g.left == math.ceil(3.0 / (adaptive.RAMP_SHARE * p.costs.predict(1))) == 3


def test_a_held_back_parts_trials_set_how_often_it_is_tried():
    """The wait after a trial is capped by what the part's trials took (PartGate.trial), not by its drafting
    cost: a check refused before drafting costs the check alone (here 0 ms: the clock stands still), so the part
    is tried again within 2 steps, where its 3 ms drafting cost would allow 30 (3 / (PROBE_SHARE * a 10 ms step)).
    Steps a part runs while open are not trials."""
    d = OutlinedChainDrafter()
    p = learned_policy(0.05, 2.0, drafter=d)  # the draft would be cut to the root
    g = p.gates[0]
    g.record(0.5, 1.0, 3.0)  # an earlier drafted step: 3 ms of drafting
    g.open, g.wait = False, 16  # held back, its backoff at 16 steps
    assert p.propose(d, None, torch.zeros(2, dtype=torch.long), None, torch.ones(2, dtype=torch.long), (True,)) is None
    p.observe(None)
    assert g.trial == pytest.approx(0.0) and g.cost == pytest.approx(3.0)
    assert not g.open and g.wait == g.left == 2
    assert math.ceil(g.cost / (adaptive.PROBE_SHARE * p.costs.predict(1))) == 30
    opened = learned_policy(0.05, 2.0, drafter=d)
    assert opened.gates[0].open
    opened.propose(d, None, torch.zeros(2, dtype=torch.long), None, torch.ones(2, dtype=torch.long), (True,))
    opened.observe(None)
    assert opened.gates[0].trial is None


def test_a_refused_trial_is_priced_at_what_its_step_took_beyond_a_plain_one():
    """A trial verified as a plain step records as its price what the step took beyond a plain step (its wall time, loop
    iteration to observe, minus the fit's plain step) where that exceeds the host time charged to it: the call around
    the policy, the drafter's skip_step and a slower next step (the lookups' memory in the caches) are the trial's too.
    Where the step took no more than its charge, the charge stands; a step with no trial (the part open) records none."""
    now = [0.0]
    d = OutlinedChainDrafter()
    p = AdaptiveBudget(d, 2, 5, OneChainDrafter(), torch.device("cpu"), clock=lambda: now[0])
    p.calib.tested.fill_(1000.0)
    p.calib.accepted.fill_(50.0)  # a 0.05 rate: every draft cut to the root by the check
    p.costs.coef = [10.0, 2.0]
    g = p.gates[0]
    g.record(0.5, 1.0, 3.0)
    g.open, g.wait = False, 16
    zeros, ones = torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    plain = p.costs.predict(1)
    # ms: the step's wall time, the trial's price (a stall counts at most to twice a plain step + 2 ms, as in the fit)
    for wall, price in ((plain + 0.6, 0.6), (plain - 0.4, 0.0), (10 * plain, None)):
        p.begin()
        assert p.propose(d, None, zeros, None, ones, (True,)) is None  # refused: the clock stands, 0 ms charged
        now[0] += wall / 1e3
        g.trial, g.open = None, False
        before = p.costs.plain()  # the fit's plain step before the step is observed
        p.observe(None)
        assert g.trial == pytest.approx(price if price is not None else before + 2.0, abs=1e-6)
    g.open, g.trial = True, None
    p.begin()
    assert p.propose(d, None, zeros, None, ones, (True,)) is None
    now[0] += (plain + 5.0) / 1e3
    p.observe(None)
    assert g.trial is None  # an open part's step is not a trial

class RandomTreeDrafter:
    """Per sequence a random tree of parts and signals (a Proposal with groups and signal, or without a
    signal: sibling ranks), its outline the same lists."""

    parts = ("a", "b")
    prunable_proposals = True

    def __init__(self, seed: int, B: int, with_signal: bool):
        rng = random.Random(seed)
        self.lists = []
        for _ in range(B):
            T = rng.randint(1, 9)
            parents = [-1] + [rng.randrange(j) for j in range(1, T)]
            self.lists.append((parents, [rng.randrange(2) for _ in range(T)],
                               [rng.randrange(10) for _ in range(T)] if with_signal else None))

    def set_parts(self, state, parts):
        pass

    def size_part(self, state, part, nodes):
        pass

    def part_times(self, state):
        return [0.0, 0.0]

    def outline(self, state, batch):
        return [(p, g, x if x is not None else hk.tree.sibling_ranks(p)) for p, g, x in self.lists]

    def skip_step(self, state, root, seqlens):
        pass

    def propose(self, state, root, seqlens):
        B, T = len(self.lists), max(len(p) for p, _, _ in self.lists)
        pad = lambda v: v + [0] * (T - len(v))  # noqa: E731
        tree = TreeBatch.from_parent_lists([p for p, _, _ in self.lists])
        groups = torch.tensor([pad(g) for _, g, _ in self.lists])
        signal = None if self.lists[0][2] is None else torch.tensor([pad(x) for _, _, x in self.lists])
        tokens = torch.arange(1, B * T + 1).view(B, T)  # a distinct token per node: a cut's gather shows
        return Proposal(tokens, tree, groups=groups, signal=signal)


class FixedTreeDrafter(RandomTreeDrafter):
    """RandomTreeDrafter with the trees given: per sequence (parents, parts, signals)."""

    def __init__(self, lists):
        self.lists = lists


@pytest.mark.parametrize("outlined", [False, True])
def test_a_part_earns_the_batchs_progress_its_nodes_make(outlined):
    """Batch 2, sequence 1 four tokens ahead: part "a" drafts a 2-node chain for sequence 1 only, part "b" one for
    sequence 0 (behind) only, every node's rate 0.9, rows free. The step moves the end by E[D] - 1 = 0.9 + 0.81, all of
    it sequence 0's: part b's gate is credited all of it, part a's nothing (its nodes move nothing; by P it would have
    been credited half). Host cut and tensor cut alike."""
    d = FixedTreeDrafter([([-1, 0, 1], [0, 1, 1], [0, 0, 0]), ([-1, 0, 1], [0, 0, 0], [0, 0, 0])])
    if not outlined:
        d.outline = lambda state, batch: None
    p = AdaptiveBudget(d, 2, 16, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0)
    p.calib.tested.fill_(1000.0)
    p.calib.accepted.fill_(900.0)
    p.calib.seq_tested.fill_(1000.0)
    p.calib.seq_accepted.fill_(900.0)
    p.costs.coef, p.margin = [10.0, 0.0], 1.0
    out = p.propose(d, None, torch.zeros(2, dtype=torch.long), None, torch.ones(2, dtype=torch.long), (True, True),
                    [5, 9])
    assert out is not None and out.tree.num_nodes == 3
    assert p.step[7] == pytest.approx([0.0, 0.9 + 0.81], rel=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_the_outline_judges_as_the_drafted_proposal(seed, monkeypatch):
    """The host pre-check (Drafter.outline -> _host_expected) computes the expected tokens per width that the
    drafted proposal's tensors give: random trees per sequence, two parts, signals and sibling ranks, random
    learned rates per sequence, pending decay, a finished sequence, with and without attention shares."""
    B = 4
    p = AdaptiveBudget(RandomTreeDrafter(0, B, True), B, 16, OneChainDrafter(), torch.device("cpu"),
                       clock=lambda: 0.0)
    g = torch.Generator().manual_seed(seed)
    p.calib.seq_tested.copy_(torch.rand(p.calib.seq_tested.shape, generator=g) * 20)
    p.calib.seq_accepted.copy_(p.calib.seq_tested * torch.rand(p.calib.seq_tested.shape, generator=g))
    p.calib.tested.copy_(torch.rand(p.calib.tested.shape, generator=g) * 40)  # the run's counts (the pooled prior)
    p.calib.accepted.copy_(p.calib.tested * torch.rand(p.calib.tested.shape, generator=g))
    p.calib.prior.copy_(torch.rand(p.calib.prior.shape, generator=g))
    p.costs.coef, p.margin = [10.0, 0.0], 1.0  # rows free, no margin: the pre-check passes, the proposal is judged
    for _ in range(seed):  # decay not applied yet: the host read applies it as the tensors' _settle does
        p.calib.decay()
    seen = []
    best = AdaptiveBudget._best_width
    monkeypatch.setattr(AdaptiveBudget, "_best_width",
                        lambda self, e, T0, d: seen.append(list(e)) or best(self, e, T0, d))
    active = torch.tensor([1, 1, 0, 1])
    seqlens = torch.tensor([300, 2000, 50, 900])
    stops = 0
    for with_signal, emitted, kv in itertools.product((True, False), (None, [9, 7, 0, 11], [5, 9, 2, 5]), (0.0, 1e-3)):
        seen.clear()
        p.kv_per_weight = kv  # with attention shares: each sequence's own tokens count at its share (bottleneck_expected)
        d = RandomTreeDrafter(seed * 2 + with_signal, B, with_signal)
        copy.deepcopy(p).propose(d, None, torch.zeros(B, dtype=torch.long), seqlens, active, (True, True), emitted)
        T0 = max(len(x) for x, _, _ in d.lists)
        if T0 == 1:  # nothing drafted anywhere: a plain step from the outline alone
            assert len(seen) == 1
            continue
        # rows free: the pre-check passes wherever the batch's end can move (every sequence furthest behind drafted
        # something); then the host cut judges its values
        n_host = len(seen)
        assert n_host == (2 if max(seen[0]) > 1.0 else 1), "the pre-check must pass where rows are free"
        d.outline = lambda state, batch: None  # no outline: the drafted proposal's tensors are judged
        copy.deepcopy(p).propose(d, None, torch.zeros(B, dtype=torch.long), seqlens, active, (True, True), emitted)
        assert len(seen) == n_host + 1  # the tensor path judged once
        assert seen[0] == pytest.approx(seen[-1], rel=1e-5, abs=1e-5)
        lags = adaptive.bottleneck_lags(emitted, active.tolist())
        if not kv and any(len(d.lists[b][0]) == 1 and not (lags and lags[b]) for b in range(B) if active[b]):
            # a sequence furthest behind drafts nothing: the check answers 1 at every width without reading rates
            expected, _, ranked, _ = p._host_expected(d.lists, active.tolist(), lags)
            assert expected == [1.0] * T0 and ranked == {}
            stops += 1
    assert stops or seed % 2 == 0, "no batch here had a laggard with no draft"  # the odd seeds have (4 each)


@pytest.mark.parametrize("seed", range(6))
def test_a_batched_check_stops_early_only_where_the_whole_check_refuses(seed, monkeypatch):
    """_host_expected given the drafting price ranks the sequences furthest behind first and refuses (None) as soon as
    their nodes bound the batch's progress below what pays at any width (_ProgressBound, _least_paying): it refuses
    exactly where _best_width of the whole check gives 1, and otherwise returns the whole check's values. Random trees,
    two parts, signals with pending nodes, random learned rates per sequence, leads, a finished sequence, margins and
    row prices from cheap to dear, batch 2 to 12, with and without attention shares; and at batch 8-12 with low rates
    some checks do stop before the last sequence (the point: at batch 16 a check ranked all 16, ~0.27 ms)."""
    rng = random.Random(seed)
    ranked_counts = []
    real_rank = AdaptiveBudget._host_rank
    monkeypatch.setattr(AdaptiveBudget, "_host_rank",
                        lambda self, *a: ranked_counts.append(1) or real_rank(self, *a))
    refused = agreed = early = 0
    for case in range(40):
        B = rng.choice([2, 3, 5, 8, 12])
        g = torch.Generator().manual_seed(1000 * seed + case)
        p = AdaptiveBudget(RandomTreeDrafter(0, B, True), B, rng.choice([3, 8, 16]), OneChainDrafter(),
                           torch.device("cpu"), clock=lambda: 0.0)
        low = rng.random() < 0.5  # rates mostly low: the early stop's case
        p.calib.seq_tested.copy_(torch.rand(p.calib.seq_tested.shape, generator=g) * 20)
        p.calib.seq_accepted.copy_(p.calib.seq_tested * torch.rand(p.calib.seq_tested.shape, generator=g)
                                   * (0.5 if low else 1.0))
        p.calib.prior.copy_(torch.rand(p.calib.prior.shape, generator=g))
        p.costs.coef = [10.0, rng.choice([0.0, 0.3, 1.0, 3.0])]
        p.margin = rng.choice([1.0, adaptive.MARGIN])
        d = RandomTreeDrafter(rng.randrange(10**6), B, True)
        for parents, _, signal in d.lists:  # some heads' guesses pending (their class known only once drafted)
            for j in range(1, len(parents)):
                if rng.random() < 0.3:
                    signal[j] = PENDING_SIGNAL
        shape = d.outline(None, B)
        active = [1] * B
        if B > 2:
            active[rng.randrange(B)] = 0
        lags = adaptive.bottleneck_lags([rng.choice([0, 0, 1, 2, 4]) for _ in range(B)], active)
        drafting = rng.choice([0.0, 0.5, 2.0])
        shares = None
        if case % 2:  # each sequence's own tokens counted at its attention's share (bottleneck_expected's shares)
            raw = [rng.random() * a for a in active]
            shares = [x / (sum(raw) + rng.uniform(0.05, 1.0)) for x in raw]
        whole = p._host_expected(shape, active, lags, shares=shares)
        ranked_counts.clear()
        got = p._host_expected(shape, active, lags, drafting, shares)
        if got is None:
            refused += 1
            assert p._best_width(whole[0], whole[1], drafting) == 1
            early += len(ranked_counts) < sum(active)
        else:
            agreed += 1
            assert got == whole  # the same expected tokens per width, the same rankings and keys
    assert refused and agreed and early, (refused, agreed, early)


def test_the_progress_bound_bounds_every_width():
    """_ProgressBound after all sequences is at least bottleneck_expected's largest width, which caps each depth's
    summed P at 1: siblings whose P sum past 1 (two guesses of 0.9 at depth 1) count 1 (a probability); with attention
    shares too; and it only falls as sequences are ranked."""
    rng = random.Random(5)
    for _ in range(200):
        B = rng.randint(2, 5)
        seqs, shape, Ps, deps = [], [], [], []
        for _ in range(B):
            n = rng.randint(1, 7)
            parents = [-1] + [rng.randrange(j) for j in range(1, n)]
            depth, P = [0] * n, [1.0] * n
            for j in range(1, n):
                depth[j], P[j] = depth[parents[j]] + 1, P[parents[j]] * rng.uniform(0.2, 1.0)
            order = sorted(range(n), key=lambda j: -P[j])
            seqs.append(([P[j] for j in order], [depth[j] for j in order]))
            shape.append((parents, [0] * n, [0] * n))
            Ps.append(P), deps.append(depth)
        lags = adaptive.bottleneck_lags([rng.choice([0, 1, 3]) for _ in range(B)], [1] * B)
        T0 = max(len(s) for s, _ in seqs)
        raw = [rng.random() for _ in range(B)]
        for shares in (None, [x / (sum(raw) + rng.uniform(0.05, 1.0)) for x in raw]):
            exact = adaptive.bottleneck_expected([(P, dep, g) for (P, dep), g in zip(seqs, lags)], T0, shares)
            bound = adaptive._ProgressBound(shape, list(range(B)), lags, math.inf, shares)
            values = [bound.value()]
            for b in bound.order:
                assert bound.refuses(Ps[b], deps[b], b)  # least = inf: always below
                values.append(bound.value())
            assert values == sorted(values, reverse=True)  # each ranked sequence tightens it
            assert values[-1] >= max(exact) - 1e-12
    # the cap: two sure-looking siblings (0.9 each) beside a sequence at 0.5
    seqs = [([1.0, 0.9, 0.9], [0, 1, 1], 0), ([1.0, 0.5], [0, 1], 0)]
    assert adaptive.bottleneck_expected(seqs, 3) == pytest.approx([1.0, 1.45, 1.5])
    P = torch.tensor([[1.0, 0.9, 0.9], [1.0, 0.5, 0.0]])
    d = torch.tensor([[0, 1, 1], [0, 1, 0]])
    order = torch.tensor([[0, 1, 2], [0, 1, 2]])
    assert adaptive.bottleneck_expected_tensor(P, order, d, torch.ones(2), [0, 0]) == pytest.approx([1.0, 1.45, 1.5])


@pytest.mark.parametrize("seed", range(8))
def test_the_host_cut_keeps_what_the_tensor_cut_keeps(seed, monkeypatch):
    """Where the drafted tree is the outline's, propose() cuts on the host (_host_cut); without an outline it cuts
    the proposal's tensors. Both keep the same nodes (tokens), the same trees, and hand observe() the same kept
    keys, depths, parents and parts, and size_part the same bounds: random trees per sequence, two parts,
    learned rates, a finished sequence, rows cheap enough that most widths are cut somewhere."""
    B = 4
    g = torch.Generator().manual_seed(100 + seed)
    base = AdaptiveBudget(RandomTreeDrafter(0, B, True), B, 16, OneChainDrafter(), torch.device("cpu"),
                          clock=lambda: 0.0)
    base.calib.seq_tested.copy_(torch.rand(base.calib.seq_tested.shape, generator=g) * 20)
    base.calib.seq_accepted.copy_(base.calib.seq_tested * torch.rand(base.calib.seq_tested.shape, generator=g))
    base.calib.prior.copy_(torch.rand(base.calib.prior.shape, generator=g))
    base.costs.coef, base.margin = [10.0, (0.0, 0.5, 1.5, 3.0)[seed % 4]], 1.0
    active = torch.tensor([1, 1, 0, 1])
    for with_signal in (True, False):
        d = RandomTreeDrafter(seed * 2 + with_signal, B, with_signal)
        got = {}
        for path in ("host", "tensors"):
            p = copy.deepcopy(base)
            if path == "tensors":
                monkeypatch.setattr(d, "outline", lambda state, batch: None)
            out = p.propose(d, None, torch.zeros(B, dtype=torch.long), None, active, (True, True))
            got[path] = (out, p.step, list(p.keep))
            monkeypatch.undo()
        (h_out, h_step, h_keep), (t_out, t_step, t_keep) = got["host"], got["tensors"]
        assert h_keep == t_keep and h_step[2] == t_step[2]  # the parts' kept counts, the width
        if t_out is None:
            assert h_out is None and h_step[3] is None
            continue
        # each active sequence keeps nodes of the same total P (node j of sequence b carries token b * T + j + 1):
        # where two nodes' P tie in exact arithmetic (the same rates down different branches), the host's products
        # and the tensors' exp(sum of logs) round apart and may keep either one
        T = max(len(x) for x, _, _ in d.lists)
        _, _, ranked, _ = base._host_expected(d.outline(None, B), active.tolist())
        rates = base.calib.host_rates({b: keys for b, (_, keys, _) in ranked.items()})
        for b in ranked:
            parents = d.lists[b][0]
            P = [1.0]
            for j in range(1, len(parents)):
                P.append(P[parents[j]] * rates[b][j])
            kept = {}
            for path, out in (("host", h_out), ("tensors", t_out)):
                valid = out.tree.valid[b] if isinstance(out.tree, TreeBatch) else torch.ones(T, dtype=torch.bool)
                kept[path] = [int(t) - b * T - 1 for t in out.tokens[b][valid[: out.tokens.shape[1]]]]
            assert len(kept["host"]) == len(kept["tensors"])
            assert sum(P[j] for j in kept["host"]) == pytest.approx(sum(P[j] for j in kept["tensors"]), rel=1e-5)
            if kept["host"] == kept["tensors"]:  # the same nodes: the same tree, keys and parts for observe()
                tree_h, tree_t = h_out.tree, t_out.tree
                for name in ("parents", "depths", "valid", "mask"):
                    a, c = getattr(tree_h, name)[b], getattr(tree_t, name)
                    c = c[b] if isinstance(tree_t, TreeBatch) else c
                    assert torch.equal(a, c), name
                kh, _, vh, _, gh = (x[b] if x.dim() > 1 else x for x in h_step[3])
                kt, _, vt, _, gt = (x[b] if x.dim() > 1 else x for x in t_step[3])
                assert torch.equal(kh[vt], kt[vt]) and torch.equal(gh[vt], gt[vt])


class PendingChainDrafter(OneChainDrafter):
    """A 3-node chain whose outline leaves every class to drafting (PENDING_SIGNAL, as the heads'), its proposal
    carrying `classes` (the drafted guesses' confidence classes)."""

    def __init__(self, classes):
        super().__init__()
        self.classes, self.proposed = classes, 0

    def outline(self, state, batch):
        return [([-1, 0, 1], [0, 0, 0], [PENDING_SIGNAL] * 3)] * batch

    def propose(self, state, root, seqlens):
        self.proposed += 1
        B = root.shape[0]
        return Proposal(torch.arange(1, 3 * B + 1).view(B, 3), hk.tree.chain(2),
                        signal=torch.tensor(self.classes).expand(B, 3))


def test_confidence_classes_bucket_probabilities_by_their_edges():
    edges = hk.drafters.protocol.CONFIDENCE_EDGES
    p = torch.tensor([0.0, 0.05, *edges, 0.95, 1.0])
    assert hk.drafters.protocol.confidence_class(p).tolist() == [0, 0, *range(1, len(edges) + 1), len(edges),
                                                                 len(edges)]
    assert len(edges) + 1 == adaptive.SIGNALS  # every class a key of its own


@pytest.mark.parametrize("name", ["medusa", "hydra"])
def test_head_drafters_report_their_guesses_confidence_classes(model, name):  # noqa: F811
    """Proposal.signal of Medusa's and Hydra's top-k proposals once the adaptive budget asks (set_parts): each node's
    class is that of its guess's probability under the head that drafted it at its parent (softmax of the head's
    logits, HeadDrafter.logits, over the draft vocabulary), the root's that of p = 1, and the outline leaves every
    class pending. Not asked (a pinned budget): no signal. Sampled drafts: never a signal (a class of the drawn token
    would let the policy's cut depend on the draw, and rejection acceptance needs the kept token to follow q), sibling
    ranks in the outline. Fresh random h, batch 2, the 10-node tree."""
    from hydra_kernels.drafters.protocol import confidence_class

    d, tree = make(model, name)
    assert d.draft_vocab is None  # columns are token ids
    backends = model.backend_plan("reference")
    tree = tree.to(model.device)
    # scaled: the random heads' guesses then fall in several classes, not all below 0.1
    h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 4
    root, seqlens = torch.tensor([3, 7]), torch.tensor([5, 9], dtype=torch.int32)

    def started(temperature):
        d.draft_temperature = temperature
        state = d.start(model, 2, 64, tree, backends)
        d.use_generator(state, torch.Generator().manual_seed(3))
        state.h = h
        return state

    with torch.no_grad():
        assert d.propose(started(0.0), root, seqlens).signal is None  # nobody asked: not paid for
        sampled = started(0.8)
        d.set_parts(sampled, (True,))
        assert d.propose(sampled, root, seqlens).signal is None
        assert d.outline(sampled, 2)[0][2] == tree.host_sibling_ranks()
        state = started(0.0)
        d.set_parts(state, (True,))
        assert d.outline(state, 2)[0][2] == [hk.drafters.protocol.PENDING_SIGNAL] * tree.num_nodes
        prop = d.propose(state, root, seqlens)
        want = torch.ones(2, tree.num_nodes)
        for j in range(1, tree.num_nodes):
            head = int(tree.depths[j]) - 1
            path = prop.tokens[:, tree.ancestors[int(tree.parents[j]), :head + 1]]  # the parent's path, root first
            x = h if name == "medusa" else torch.cat([h, model.tok_embeddings(path).flatten(1)], dim=-1)
            q = d.logits(model, head, x).float().softmax(-1)  # [2, V]
            want[:, j] = q.gather(1, prop.tokens[:, j:j + 1])[:, 0]
    assert prop.signal is not None and prop.signal.shape == (2, tree.num_nodes)
    edges = torch.tensor(hk.drafters.protocol.CONFIDENCE_EDGES)
    clear = (want[..., None] - edges).abs().min(-1).values > 1e-4  # not within rounding of a class edge
    assert clear.float().mean() > 0.8
    assert torch.equal(prop.signal[clear], confidence_class(want)[clear])
    assert len(set(prop.signal[:, 1:].flatten().tolist())) >= 3, prop.signal  # guesses of several classes


@pytest.mark.parametrize("name", ["eagle-static", "eagle-dynamic"])
def test_eagle_reports_its_guesses_confidence_classes(model, name, monkeypatch):  # noqa: F811
    """EAGLE's Proposal.signal: a node's class is that of its probability under the layer at its parent; checked at
    the root's children against the layer's first log-probabilities (draft_log_probs at the root's feature), the
    root's class that of p = 1; a static tree's outline leaves every class pending."""
    from hydra_kernels.drafters.protocol import confidence_class

    d, tree = make(model, name)
    assert d.draft_vocab is None  # columns are token ids
    first = []
    real = d.draft_log_probs
    # the layer's features scaled: its guesses then fall in several classes, not all below 0.1
    monkeypatch.setattr(d, "draft_log_probs", lambda m, y: first.append(real(m, y * 4)) or first[-1])
    props = []
    propose = d.propose

    def recorded(state, root, seqlens):  # each proposal with the layer's log-probabilities it ranked
        first.clear()
        props.append((propose(state, root, seqlens), list(first)))
        return props[-1][0]

    monkeypatch.setattr(d, "propose", recorded)
    generate(model, PROMPTS[:2], drafter=d, tree=tree, max_new_tokens=2, eos_token_id=[], backend="reference")
    prop, calls = props[0]
    lp_root = calls[0].reshape(2, -1)  # [B, V]: the layer at the root
    parents = prop.tree.parents if isinstance(prop.tree, hk.tree.TreeBatch) else prop.tree.parents.expand(2, -1)
    assert (prop.signal[:, 0] == len(hk.drafters.protocol.CONFIDENCE_EDGES)).all()
    checked = 0
    for b in range(2):
        for j in range(1, prop.tokens.shape[1]):
            if int(parents[b, j]) == 0:
                want = confidence_class(lp_root[b, prop.tokens[b, j]].exp())
                assert int(prop.signal[b, j]) == int(want), (b, j)
                checked += 1
    assert checked >= 2
    assert len(set(prop.signal[:, 1:].flatten().tolist())) >= 2
    state = d.start(model, 2, 64, d.resolve_tree(tree, "cpu"),
                    model.backend_plan("reference"))
    outline = d.outline(state, 2)
    if name == "eagle-static":  # every class pending: the layer's probability decides it
        assert outline[0][2] == [hk.drafters.protocol.PENDING_SIGNAL] * tree.num_nodes
    else:
        assert outline is None  # a dynamic tree: its drafting chooses the shape


def test_mlp_speculator_reports_its_tokens_confidence_classes(model):  # noqa: F811
    """MLPSpeculator's Proposal.signal: each trie node's class is that of its token's probability at its prefix (the
    stage's log-softmax; the per-token log-probabilities sum to the suffix's score), the root's that of p = 1; a
    node shared by several candidates gets the one value they share. Fresh random h, batch 2."""
    from hydra_kernels.drafters.protocol import confidence_class

    d, _ = make(model, "mlp_speculator")
    state = d.start(model, 2, 64, d.resolve_tree(None, "cpu"), None)
    state.h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 4
    root = torch.tensor([3, 7])
    with torch.no_grad():
        cand, scores, lps = d.scored_candidates(state.h, root, state.n_candidates, model)
        prop = d.propose(state, root, torch.tensor([5, 9], dtype=torch.int32))
    assert torch.allclose(lps.sum(-1), scores, atol=1e-5)
    assert torch.equal(cand, d.candidates(state.h, root, state.n_candidates, model)[0])
    paths = hk.drafters.mlp_speculator.candidate_trie(root, cand)[1]
    assert (prop.signal[:, 0] == len(hk.drafters.protocol.CONFIDENCE_EDGES)).all()
    for b in range(2):
        for c in range(cand.shape[1]):
            for i in range(cand.shape[2]):
                node = int(paths[b, c, i + 1])
                if node < prop.signal.shape[1]:
                    assert int(prop.signal[b, node]) == int(confidence_class(lps[b, c, i].exp())), (b, c, i)
    assert len(set(prop.signal[:, 1:].flatten().tolist())) >= 2


def test_amphista_reports_its_guesses_confidence_classes(model, monkeypatch):  # noqa: F811
    """Amphista's Proposal.signal once the adaptive budget asks (set_parts): each node's class is that of its guess's
    probability under its depth's head (softmax of AmphistaDrafter.logits over the draft vocabulary at the head state
    it ranked), the root's that of p = 1; the outline leaves every class pending. Not asked (a pinned budget): no signal
    and sibling ranks in the outline. A real run (generate: the adaptation layers over the prompts), batch 2."""
    from hydra_kernels.drafters.protocol import confidence_class

    d, tree = make(model, "amphista")
    assert d.draft_vocab is None and d.lm_down is None  # columns are token ids; the tied head's packed or fused path
    ask, states, ys, props = [False], [], [], []
    start, head_states, propose = d.start, d.head_states, d.propose

    def started(*a, **k):
        states.append(start(*a, **k))
        if ask[0]:
            d.set_parts(states[-1], (True,))
        return states[-1]

    monkeypatch.setattr(d, "start", started)
    monkeypatch.setattr(d, "head_states", lambda stages: ys.append(head_states(stages)) or ys[-1])
    monkeypatch.setattr(d, "propose", lambda s, r, n: props.append(propose(s, r, n)) or props[-1])
    run = lambda: generate(model, PROMPTS[:2], drafter=d, tree=tree, max_new_tokens=3, eos_token_id=[])  # noqa: E731
    run()
    assert props and all(p.signal is None for p in props)  # nobody asked: not paid for
    assert d.outline(states[-1], 2)[0][2] == tree.host_sibling_ranks()
    ask[0] = True
    states.clear(), ys.clear(), props.clear()
    with torch.no_grad():
        run()
        assert d.outline(states[-1], 2)[0][2] == [PENDING_SIGNAL] * tree.num_nodes
        prop, y = props[0], ys[0]
        q = d.logits(model, y[:, :tree.depth]).float().softmax(-1)  # [B, depth, V]
    want = torch.ones(2, tree.num_nodes)
    for j in range(1, tree.num_nodes):
        want[:, j] = q[:, int(tree.depths[j]) - 1].gather(1, prop.tokens[:, j:j + 1])[:, 0]
    assert prop.signal is not None and prop.signal.shape == (2, tree.num_nodes)
    edges = torch.tensor(hk.drafters.protocol.CONFIDENCE_EDGES)
    # not within rounding of a class edge: on the packed CPU path the guesses' logits come from bf16 panels of the
    # tied head (fit.DRAFT_PACK_DTYPE), ~2^-8 relative in a logit, where AmphistaDrafter.logits is fp32
    clear = ((want[..., None] - edges).abs() > 0.05 * edges).all(-1)
    assert clear.float().mean() > 0.6
    assert torch.equal(prop.signal[clear], confidence_class(want)[clear])
    assert len(set(prop.signal[:, 1:].flatten().tolist())) >= 3, prop.signal  # guesses of several classes


def test_mlp_speculator_drafts_sized_chains(model):  # noqa: F811
    """MLPSpeculator.size_part: a bound of n nodes (root included) drafts c chains of depth d = min(n_predict, n - 1)
    under the root (c the most that fit, at most stage 0's top k), stage 0's top c tokens each continued by the next
    stages' argmax (computed here stage by stage from the drafter's own stages); a bound the whole draft fits and None
    draft the whole draft. Fresh random h, batch 2, 3 stages."""
    d = hk.new_drafter(model, kind="mlp_speculator", n_predict=3)
    randomised(d, seed=11)
    state = d.start(model, 2, 64, d.resolve_tree(None, "cpu"), None)
    state.h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(6)) * 4
    root, seqlens = torch.tensor([3, 7]), torch.tensor([5, 9], dtype=torch.int32)
    with torch.no_grad():
        whole = d.propose(state, root, seqlens)
        cfg = d.config
        for nodes in [*range(2, 12), 17, 24, 25, 40]:  # from 25: the whole draft (8 candidates x 3 stages)
            d.size_part(state, 0, nodes)
            prop = d.propose(state, root, seqlens)
            sized = d.sized_draft(nodes)
            # (stage 0's top c, then 1 each; c): top_k [4, 3, 2], 8 candidates of 3 tokens
            assert sized == {2: ([1], 1), 3: ([1, 1], 1), 4: ([1, 1, 1], 1), 7: ([2, 1, 1], 2), 10: ([3, 1, 1], 3),
                             17: ([4, 1, 1], 4), 24: ([4, 1, 1], 4), 25: None, 40: None}.get(nodes, sized), nodes
            if sized is None:
                assert nodes - 1 >= cfg.n_candidates * cfg.n_predict and torch.equal(prop.tokens, whole.tokens)
                continue
            (c, *_), depth = sized[0], len(sized[0])
            assert prop.tokens.shape[1] == c * depth + 1 <= nodes
            # expected chains: stage 0's top c from the root, then each stage's argmax
            s0 = d.stage(0, d.input_state(state.h), root, model)
            first = d.stage_logits(0, s0, model).float().topk(c, dim=-1).indices  # [B, c], best first
            tr = prop.tree
            for b in range(2):
                expect = set()
                for j in range(c):
                    chain, st, tok = [], s0[b], d.token_ids(first[b, j])
                    chain.append(int(tok))
                    for i in range(1, depth):
                        st = d.stage(i, st, tok, model)
                        tok = d.token_ids(d.stage_logits(i, st, model).float().argmax(-1))
                        chain.append(int(tok))
                    expect.add(tuple(chain))
                got = set()  # the proposal's root-to-leaf token paths
                for leaf in range(prop.tokens.shape[1]):
                    if int(tr.depths[b, leaf]) == depth:
                        path, n = [], leaf
                        while n > 0:
                            path.append(int(prop.tokens[b, n]))
                            n = int(tr.parents[b, n])
                        got.add(tuple(reversed(path)))
                assert got == expect and int(prop.tokens[b, 0]) == int(root[b]), (nodes, b)
        d.size_part(state, 0, None)
        assert torch.equal(d.propose(state, root, seqlens).tokens, whole.tokens)
        d.set_budget(state, 7)  # 2 candidates of 3 tokens: a bound of 7 is that whole draft, 5 one chain
        assert d.sized_draft(7, state.n_candidates) is None and d.sized_draft(5, state.n_candidates) == ([1, 1, 1], 1)
        budgeted = d.propose(state, root, seqlens)
        d.size_part(state, 0, 7)
        assert torch.equal(d.propose(state, root, seqlens).tokens, budgeted.tokens)
        d.size_part(state, 0, 5)
        assert d.propose(state, root, seqlens).tokens.shape[1] == 4


@pytest.mark.parametrize("classes, rates, prior, drafted, width", [
    ([7, 6, 1], {6: 0.9, 1: 0.05}, 0.3, True, 2),  # checked at its best class (6), the confident guess kept, the next cut
    ([7, 6, 6], {6: 0.9, 1: 0.05}, 0.3, True, 3),
    ([7, 1, 6], {6: 0.9, 1: 0.05}, 0.3, True, 1),  # drafted unconfident: cut to the root (a plain step) after drafting
    ([7, 6, 6], {6: 0.1, 1: 0.05}, 0.02, False, 1),  # not even the best class pays: not drafted at all
])
def test_a_pending_draft_is_checked_at_its_best_class_and_cut_by_its_drafted_classes(classes, rates, prior, drafted,
                                                                                     width):
    """Drafter.outline's PENDING_SIGNAL (a head's guess before drafting): the pre-check takes the best learned rate
    of the node's classes, so a part whose confident guesses pay is drafted; the cut after drafting ranks the classes
    the guesses got. Learned rates per class (depths 1 and 2 alike), the other classes never seen (at the prior);
    a row 2 ms beside a 10 ms step."""
    d = PendingChainDrafter(classes)
    p = AdaptiveBudget(d, 1, 5, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0)
    for c, r in rates.items():
        for depth in (1, 2):
            k = int(p.calib.keys(torch.tensor(0), torch.tensor(depth), torch.tensor(c)))
            p.calib.tested[k], p.calib.accepted[k] = 1000.0, 1000.0 * r
    p.calib.prior.fill_(prior)  # below the best class: the check must read the classes' rates, not the prior
    p.costs.coef, p.margin = [10.0, 2.0], 1.0
    out = p.propose(d, None, torch.zeros(1, dtype=torch.long), None, torch.ones(1, dtype=torch.long), (True,))
    assert d.proposed == int(drafted) and getattr(d, "skipped", 0) == int(not drafted)
    assert p.step[2] == width
    if width == 1:
        assert out is None
    else:
        assert out.tokens.shape == (1, width) and out.tokens[0].tolist() == list(range(1, width + 1))
        keys = p.step[3][0][0]
        assert (keys % adaptive.SIGNALS).tolist() == classes[:width]  # observe() learns the drafted classes


class OutlinedStaticDrafter(OutlinedChainDrafter):
    """The outlined 5-node chain (a static Tree) whose proposals carry positions and sampled drafts' q, a distinct
    token per node."""

    def propose(self, state, root, seqlens):
        B, V = root.shape[0], 11
        g = torch.Generator().manual_seed(B)
        return Proposal(torch.arange(1, 5 * B + 1).view(B, 5), hk.tree.chain(4),
                        positions=torch.arange(5 * B).view(B, 5) + 40, draft_probs=torch.rand(B, 5, V, generator=g))


@pytest.mark.parametrize("seed", range(6))
def test_the_host_cut_of_a_static_tree_keeps_its_positions_and_draft_probs(seed):
    """A static tree (the head drafters' proposals): the host cut gives the tensor cut's proposal, positions and
    draft_probs gathered alike, the same tree for the verify step and the same keys for observe(), a finished
    sequence included; widths from whole to plain."""
    B = 3
    g = torch.Generator().manual_seed(seed)
    base = AdaptiveBudget(OutlinedStaticDrafter(), B, 8, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0)
    base.calib.seq_tested.fill_(50.0)
    base.calib.seq_accepted.copy_(base.calib.seq_tested * (0.3 + 0.65 * torch.rand(base.calib.seq_tested.shape,
                                                                                   generator=g)))
    base.costs.coef, base.margin = [10.0, (0.0, 0.3, 1.0, 2.0, 4.0, 9.0)[seed]], 1.0
    active = torch.tensor([1, 0, 1])
    got = {}
    for path in ("host", "tensors"):
        d = OutlinedStaticDrafter()
        if path == "tensors":
            d.outline = lambda state, batch: None
        p = copy.deepcopy(base)
        got[path] = (p.propose(d, None, torch.zeros(B, dtype=torch.long), None, active, (True,)), p.step, p.keep)
    (h, h_step, h_keep), (t, t_step, t_keep) = got["host"], got["tensors"]
    assert h_keep == t_keep and h_step[2] == t_step[2]
    if t is None:
        assert h is None
        return
    live = torch.tensor([[a > 0] for a in active.tolist()]) & (t.tree.valid if isinstance(t.tree, TreeBatch)
                                                               else torch.ones(1, t.tokens.shape[1], dtype=torch.bool))
    for name in ("tokens", "positions"):
        assert torch.equal(getattr(h, name)[live], getattr(t, name)[live]), name
    assert torch.equal(h.draft_probs[live], t.draft_probs[live])
    def per_sequence(tree, name):  # a tree's buffer [B, ...] (a static Tree's expanded)
        x = getattr(tree, name)
        return x if isinstance(tree, TreeBatch) else x.expand(B, *x.shape)

    for name in ("parents", "depths", "mask"):
        assert torch.equal(per_sequence(h.tree, name)[active > 0], per_sequence(t.tree, name)[active > 0]), name
    kh, kt = h_step[3][0], t_step[3][0]
    assert torch.equal(kh[live], kt.expand_as(kh)[live])


def test_a_sized_part_drafts_what_the_last_cut_kept_and_its_whole_draft_every_few_runs():
    """Drafter.size_part: the first run drafts whole (nothing learned yet), then as many nodes as the last cut
    kept (root included), the whole draft again every EXPLORE_EVERY-th run; a run that kept nothing still
    drafts one node (a running part drafts something)."""
    p = learned_policy(0.5, 1.0, batch=1)  # the cut keeps 3 nodes (test_the_policy_drafts_only_what_pays)
    d = OneChainDrafter()
    for _ in range(2 * adaptive.EXPLORE_EVERY):
        p.propose(d, None, torch.zeros(1, dtype=torch.long), None, torch.ones(1, dtype=torch.long), (True,))
    E = adaptive.EXPLORE_EVERY
    assert d.sizes == [None] + [None if (i + 1) % E == 0 else 3 for i in range(1, 2 * E)]
    p.costs.coef = [10.0, 100.0]  # rows too dear: the cut keeps nothing
    p.propose(d, None, torch.zeros(1, dtype=torch.long), None, torch.ones(1, dtype=torch.long), (True,))
    p.propose(d, None, torch.zeros(1, dtype=torch.long), None, torch.ones(1, dtype=torch.long), (True,))
    assert p.keep == [0] and d.sizes[-1] == 2


def test_batch_1_drafts_at_its_own_margin_and_decay_is_applied_when_read():
    """Batch 1 judges at MARGIN_BATCH_1, larger batches at MARGIN; k decays applied lazily (one DECAY ** k when
    the counts are next read) give the rates decaying every step gives, and differ from no decay."""
    assert learned_policy(0.5, 1.0, batch=1).margin == adaptive.MARGIN_BATCH_1 < adaptive.MARGIN
    keys = torch.zeros(2, 1, dtype=torch.long)
    policies = [learned_policy(0.3, 1.0) for _ in range(3)]  # lazy, eager, never decayed
    for p in policies:
        p.calib.tested.fill_(10.0), p.calib.accepted.fill_(3.0)
    for _ in range(7):
        for p in policies[:2]:
            p.calib.decay()
        policies[1].calib.rates(keys)  # read every step: applied one step at a time
    for p in policies:
        p.calib.update(keys, torch.full((2, 1), 5.0), torch.zeros(2, 1))
    lazy, eager, never = (p.calib.rates(keys) for p in policies)
    assert torch.allclose(lazy, eager, rtol=1e-5) and not torch.allclose(lazy, never, rtol=1e-2)


def test_learning_and_the_gate():
    """Accepted chains raise the learned rate; a part that earns nothing while it costs is held back and
    tried again after a growing wait."""
    p = learned_policy(0.4, 0.5, batch=1)
    p.calib.tested.zero_(), p.calib.accepted.zero_()
    d = OneChainDrafter()
    before = float(p.calib.rates(torch.zeros(1, 1, dtype=torch.long)))
    for _ in range(20):  # every verified chain accepted whole
        out = p.propose(d, None, torch.zeros(1, dtype=torch.long), None, torch.ones(1, dtype=torch.long), (True,))
        n = out.tree.num_nodes if out is not None else 1
        p.observe(torch.arange(n)[None] if out is not None else None)
    after = float(p.calib.rates(torch.zeros(1, 1, dtype=torch.long)))
    assert after > 0.9 > before
    gate = adaptive.PartGate()
    gate.record(0.0, 1.0, 5.0)
    gate.judge(False)
    waits = []
    for _ in range(3):
        n = 1
        while not gate.due():
            n += 1
        waits.append(n)
        gate.judge(False)
    assert waits == [2, 4, 8]
    # a trial that pays once (a lucky token) opens the part for a step; the next step's loss puts the wait back
    # where it was (16), not at the start of the ramp
    gate.judge(True)
    assert gate.open and gate.due()
    gate.judge(False)
    assert gate.wait == 16
    # a burst that pays for several steps brings the wait down to 1: the part is tried again 2 steps after it
    for _ in range(5):
        gate.judge(True)
    gate.judge(False)
    assert gate.wait == 2 and not gate.due() and gate.due()
    gate.judge(False, max_wait=3)
    assert gate.wait == 3  # the cap
    gate.judge(True)
    gate.judge(True)
    gate.judge(False, max_wait=64, min_wait=10)
    assert gate.wait == 10  # a dear trial's ramp starts at its floor (RAMP_SHARE), then doubles
    gate.judge(False, max_wait=64, min_wait=10)
    assert gate.wait == 20


def test_a_new_runs_text_gets_fresh_gates():
    """A gate remembered from the last run (its part held back on that text, a long wait left, a long backoff, a low
    gain) is tried within NEW_TEXT_TRIAL steps of a new run, and its first record there sets the gain instead of
    averaging into the last text's; its cost (the machine's) is averaged as before. Its backoff restarts at
    NEW_TEXT_TRIAL, or at its ramp's floor where its drafting is dear (RAMP_SHARE: judge's last min_wait), so a dear
    part's failed new-text trial is not followed by trials after 8, 16 and 32 steps."""
    gate = adaptive.PartGate()
    gate.record(0.0, 1.0, 2.0)
    for _ in range(5):
        gate.judge(False)
    assert gate.wait == 32 and gate.left == 32
    d = OneChainDrafter()
    adaptive.memory(d, "memory")[("gates", 1, "cpu", torch.get_num_threads())] = [gate]
    p = AdaptiveBudget(d, 1, 5, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0)
    g = p.gates[0]
    assert g is not gate and gate.wait == 32  # a copy: the memory keeps the last run's gate
    waited = 1
    while not g.due():
        waited += 1
    assert waited <= adaptive.NEW_TEXT_TRIAL and g.wait == adaptive.NEW_TEXT_TRIAL
    g.record(1.5, 1.0, 4.0)
    assert g.gain == 1.5 and g.cost == pytest.approx(0.7 * 2.0 + 0.3 * 4.0)
    g.record(0.5, 1.0, 2.0)
    assert g.gain == pytest.approx(0.7 * 1.5 + 0.3 * 0.5)  # then the running mean, as before
    g.judge(False)
    assert g.wait == 2 * adaptive.NEW_TEXT_TRIAL  # the ramp from there, not from the last run's 32
    dear = adaptive.PartGate()  # a part whose drafting is dear: its ramp's floor 10 steps (> NEW_TEXT_TRIAL)
    for _ in range(4):
        dear.judge(False, max_wait=64, min_wait=10)
    assert dear.wait == dear.left == 64 and dear.floor == 10 > adaptive.NEW_TEXT_TRIAL
    dear.due()
    dear.new_text()
    assert dear.left == 63 and dear.wait == 64 and dear.fresh  # its backoff kept whole; its gain set afresh
    dear.judge(False, max_wait=256, min_wait=10)
    assert dear.wait == 128



def test_a_batched_runs_new_text_restarts_no_lower_than_half_the_probe_cap():
    """At batch >= 2 a new run restarts a held-back part's backoff at NEW_TEXT_CAP_SHARE of its probe cap (judge's last
    max_wait: what its trials' price allows) where that is above NEW_TEXT_TRIAL, so a part whose trials are dear
    beside a step (the heads at batch 2: ~1.3 ms a trial, a 40-step cap) is tried about once per cap, not on a fresh
    ramp (4, 8, 16, 32) every run; a part with a short cap (the n-gram lookup) restarts at NEW_TEXT_TRIAL as at batch
    1, and batch 1 restarts every cheap part there."""
    def held_back(cap):
        g = adaptive.PartGate()
        for _ in range(6):
            g.judge(False, max_wait=cap)
        assert g.wait == g.left == cap and g.cap == cap
        return g

    heads = held_back(40)
    heads.new_text(batched=True)
    assert heads.wait == heads.left == 20 and heads.fresh  # half its cap, its gain set afresh as before
    heads.judge(False, max_wait=40)
    assert heads.wait == 40  # the ramp from there: the next trial one cap later
    lookup = held_back(6)
    lookup.new_text(batched=True)
    assert lookup.wait == lookup.left == adaptive.NEW_TEXT_TRIAL
    single = held_back(40)
    single.new_text()
    assert single.wait == single.left == adaptive.NEW_TEXT_TRIAL  # batch 1 as before
    short = held_back(40)
    for _ in range(37):
        short.due()
    short.new_text(batched=True)
    assert short.left == 3 and short.wait == 20  # a trial already nearer than the restart keeps its turn
    # through AdaptiveBudget: a batch of 2 restarts the remembered gate at half its cap, a batch of 1 at NEW_TEXT_TRIAL
    for batch, expected in ((2, 20), (1, adaptive.NEW_TEXT_TRIAL)):
        d = OneChainDrafter()
        adaptive.memory(d, "memory")[("gates", batch, "cpu", torch.get_num_threads())] = [held_back(40)]
        p = AdaptiveBudget(d, batch, 5, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0)
        assert p.gates[0].wait == p.gates[0].left == expected


class TimedChainDrafter(OneChainDrafter):
    """The chain, each draft timed at `ms` of drafting (Drafter.part_times)."""

    def __init__(self, ms: float):
        super().__init__()
        self.ms = ms

    def part_times(self, state):
        return [self.ms / 1e3]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ms, dear", [(8.0, True), (1.0, False)])
def test_a_dear_part_waits_up_to_max_wait_dear_and_keeps_its_backoff_into_the_next_run(ms, dear, batch):
    """A part whose drafting is dear (8 ms beside a 10 ms plain step: its ramp's floor ceil(8 / (RAMP_SHARE * 10)) = 8
    steps, over NEW_TEXT_TRIAL) whose trial did not pay waits up to what the probe share allows, ceil(8 / (0.01 * 10))
    = 80 steps at batch 1 (PROBE_SHARE), 160 at batch 2 (PROBE_SHARE_BATCHED, 0.005; here 128, twice its last wait),
    past MAX_WAIT (capped by MAX_WAIT_DEAR), and the next run keeps that backoff; a cheap part (1 ms: 10 / 20 steps) is
    capped by MAX_WAIT and restarts within NEW_TEXT_TRIAL steps of the next run's text at batch 1, within half its cap (10
    steps) at batch 2 (NEW_TEXT_CAP_SHARE)."""
    d = TimedChainDrafter(ms)
    p = learned_policy(0.05, 2.0, batch=batch, drafter=d)  # every draft cut to the root: no trial pays
    g = p.gates[0]
    g.open, g.wait = False, 64
    zeros, ones = torch.zeros(batch, dtype=torch.long), torch.ones(batch, dtype=torch.long)
    assert p.propose(d, None, zeros, None, ones, (True,)) is None
    p.observe(None)
    plain = p.costs.predict(1)
    floor = max(2, math.ceil(ms / (adaptive.RAMP_SHARE * plain)))
    assert (floor > adaptive.NEW_TEXT_TRIAL) == dear and g.trial == pytest.approx(ms)
    cap = adaptive.MAX_WAIT_DEAR if dear else adaptive.MAX_WAIT
    share = adaptive.PROBE_SHARE if batch == 1 else adaptive.PROBE_SHARE_BATCHED
    assert share == (0.01 if batch == 1 else 0.005)
    assert g.wait == g.left == min(cap, math.ceil(ms / (share * plain)), 2 * 64)
    assert (g.wait > adaptive.MAX_WAIT) == dear
    p.finish()
    nxt = AdaptiveBudget(d, batch, 5, OneChainDrafter(), torch.device("cpu"), clock=lambda: 0.0).gates[0]
    if dear:
        assert (nxt.wait, nxt.left) == (g.wait, g.left)
    else:
        restart = adaptive.NEW_TEXT_TRIAL if batch == 1 else math.ceil(adaptive.NEW_TEXT_CAP_SHARE * g.cap)
        assert restart == (4 if batch == 1 else 10)
        assert nxt.left <= restart and nxt.wait == max(restart, floor)


def test_budget_argument():
    """'adaptive' is accepted with or without a tree; None is the adaptive budget where the table would be the default
    (a table for this device and tree, the drafter's own tree) on the CPU under greedy acceptance, else the table / full
    tree; 'auto' is the table; a bad string names the choices."""
    from hydra_kernels.budget import BudgetTable, tree_key

    d = hk.new_drafter(hk.Llama.from_hf(__import__("test_llama_vs_transformers").make_hf("gqa3-tied", seed=5)),
                       kind="ngram")
    tree = d.resolve_tree(None, "cpu")
    assert choose("adaptive", d, tree, None, "cpu").adaptive
    assert choose("adaptive", d, tree, "chain-3", "cpu").adaptive
    assert not choose(None, d, tree, None, "cpu").adaptive  # no table: the full tree, as the user made it
    for device in ("cpu", "cuda"):
        d.budget_tables[device] = BudgetTable(device, tree_key(tree), tree.num_nodes, [1, 4], [128],
                                              [[tree.num_nodes], [1]])
    table = d.budget_tables["cpu"]
    assert choose(None, d, tree, None, "cpu").adaptive
    for budget, device, greedy in ((None, "cpu", False), (None, "cuda", True), ("auto", "cpu", True)):
        rule = choose(budget, d, tree, None, device, greedy=greedy)  # sampled, on CUDA, asked for: the table
        assert not rule.adaptive and rule.table is d.budget_tables[device], (budget, device, greedy)
    pinned = choose(None, d, tree, "chain-3", "cpu")  # a tree passed pins its size
    assert not pinned.adaptive and pinned.table is None and pinned.nodes(1, 10) == tree.num_nodes
    d.budget_tables["cpu"] = BudgetTable("cpu", "[[9]]", table.full, [1], [128], [[1]])  # another tree's table
    assert not choose(None, d, tree, None, "cpu").adaptive
    with pytest.raises(ValueError, match="'adaptive', 'auto' or a node count"):
        choose("fast", d, tree, None, "cpu")


def test_adaptive_runs_eagerly_where_the_runner_was_asked_for(model):  # noqa: F811
    """Under runner.static_buffers() (the runner's path on the CPU: a batch of 3 padded to a bucket of 4) the
    adaptive budget runs the eager loop: no crash on the padded rows, plain greedy's tokens."""
    from hydra_kernels import runner as R

    d, tree = make(model, "hydra")
    plain = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=[])
    with R.static_buffers():
        out = generate(model, PROMPTS, drafter=d, tree=tree, budget="adaptive", max_new_tokens=12, eos_token_id=[],
                       backend="reference")
    assert out.sequences == plain.sequences and out.policy_s > 0


def test_step_costs_follow_the_fastest_first_plain_step_and_keep_row_costs_only_when_seen():
    """A first plain step that caught up a drafter's layer over the prompt (slow) does not set the scale; a row
    cost never observed is not remembered as learned."""
    mem = {}
    c = adaptive.StepCosts(mem, "k", "cpu")
    for ms in (80.0, 10.0):
        c.observe(1, ms)
    assert c.predict(1) == pytest.approx(10.0) and c.coef[1] == pytest.approx(10.0 * c.row_share)
    c.observe(1, 11.0)  # slower than the scale: an ordinary observation
    assert 10.0 < c.predict(1) < 11.0
    for _ in range(5):
        c.observe(1, 10.0)
    c.remember()
    assert mem["k"][1] == pytest.approx(mem["k"][0] * c.row_share)  # no wide step seen: the guess, not a fit
    c2 = adaptive.StepCosts(mem, "k", "cpu")
    for _ in range(20):
        c2.observe(1, 10.0)
        c2.observe(4, 16.0)  # 2 ms a node
    assert c2.coef[1] == pytest.approx(2.0, rel=0.1)
    c2.remember()
    assert mem["k"][1] == pytest.approx(c2.coef[1]) and mem["k"][2] == pytest.approx(c2.spec)


def test_step_costs_tell_a_drafted_steps_surcharge_from_its_rows():
    """a + c [T > 1] + b (T - 1): timed steps of widths 1, 2, 3 and 5 (a 6 ms plain step, 1.5 ms for any drafted
    step, 1.2 ms a node) are fitted so: the plain step is not priced at the drafted steps' surcharge, a node not at
    the first node's. Before any drafted step c is 0; the next run starts from this fit."""
    mem = {}
    c = adaptive.StepCosts(mem, "k", "cpu")
    for _ in range(3):
        c.observe(1, 6.0)
    assert c.spec == 0.0 and c.predict(1) == pytest.approx(6.0)
    truth = lambda w: 6.0 + (1.5 + 1.2 * (w - 1) if w > 1 else 0.0)  # noqa: E731
    for _ in range(40):
        for w in (1, 2, 1, 3, 1, 5):
            c.observe(w, truth(w))
    assert c.coef == pytest.approx([6.0, 1.2], rel=0.05) and c.spec == pytest.approx(1.5, rel=0.1)  # a ridge: shrunk a little
    assert [c.predict(w) for w in range(1, 7)] == pytest.approx([truth(w) for w in range(1, 7)], rel=0.02)
    assert c.rows(0.0) == 0.0 and c.rows(0.5) == pytest.approx(0.5 * (c.coef[1] + c.spec))
    assert c.rows(2.0) == pytest.approx(2 * c.coef[1] + c.spec)
    c.remember()
    c2 = adaptive.StepCosts(mem, "k", "cpu")
    assert c2.known and [c2.predict(w) for w in (1, 2, 4)] == pytest.approx([c.predict(w) for w in (1, 2, 4)])


def test_step_costs_price_each_step_by_its_size():
    """StepCosts fits ms / size (attention_share.step_size) and predicts times the current size: batch-2 steps over
    8000 keys where one sequence finishes part-way (size 8.6 with both attending, 4.8 after; 5.6 ms a unit for a plain
    step, 1.2 a node, 0.5 a drafted step's surcharge) are priced at either size within 3%, and a run at another context
    (size 1.5) starts from the same per-unit fit. Fitted on the raw times instead (size left at 1, the fit before
    2026-12-01), the mixed steps priced a 2-node step at both sizes well off what it took."""
    truth = lambda w, u: u * (5.6 + (0.5 + 1.2 * (w - 1) if w > 1 else 0.0))  # noqa: E731
    rng = random.Random(3)
    mem, raw = {}, adaptive.StepCosts({}, "k", "cpu", 2)
    c = adaptive.StepCosts(mem, "k", "cpu", 2)
    for step in range(120):
        u = 8.6 if step % 40 < 25 else 4.8  # a sequence finishes, the next answer starts level again
        w = rng.choice([1, 1, 2, 3]) if step % 40 < 25 else rng.choice([1, 2])  # the tail drafts narrow
        c.size = u
        ms = truth(w, u) * rng.uniform(0.99, 1.01)
        c.observe(w, ms)
        raw.observe(w, ms)
    for u in (8.6, 4.8):
        c.size = u
        assert [c.predict(w) for w in (1, 2, 3, 4)] == pytest.approx([truth(w, u) for w in (1, 2, 3, 4)], rel=0.03)
        assert c.plain() == pytest.approx(truth(1, u), rel=0.03)
        assert c.rows(1.0) == pytest.approx(truth(2, u) - truth(1, u), rel=0.05)
    assert max(abs(raw.predict(2) / truth(2, u) - 1) for u in (8.6, 4.8)) > 0.1  # one raw line cannot price both
    c.remember()
    c2 = adaptive.StepCosts(mem, "k", "cpu", 2)
    c2.size = 1.5
    assert c2.known and [c2.predict(w) for w in (1, 2)] == pytest.approx([truth(1, 1.5), truth(2, 1.5)], rel=0.03)


def test_the_policy_sizes_each_step_from_who_attends_over_how_much(model):  # noqa: F811
    """AdaptiveBudget.plan(contexts, done) sets its cost fit's size to attention_share.step_size (1 + K/V per weight
    byte x the committed lengths of the sequences not done); without them, or with no K/V price, size 1. generate()
    passes the loop's host lengths and done flags at every step: at batch 2 with one answer ending at an EOS the size
    drops once that sequence is done, and every step's size is step_size of the lengths plan saw.
    kv_per_weight_byte is computed once per model and dtype."""
    from hydra_kernels import attention_share
    from hydra_kernels.attention_share import kv_per_weight_byte, step_size
    assert step_size([100, 3000, 50], [False, False, True], 0.01) == pytest.approx(1.0 + 0.01 * 3100)
    assert step_size([100], [True], 0.01) == 1.0
    d, tree = make(model, "combined")
    p = AdaptiveBudget(d, 2, 4, model, torch.device("cpu"), kv_per_weight=0.001)
    p.plan([500, 700], [False, False])
    assert p.costs.size == pytest.approx(2.2)
    p.plan([500, 700], [False, True])
    assert p.costs.size == pytest.approx(1.5)
    p.plan()
    assert p.costs.size == pytest.approx(1.5)  # no lengths given: the last size stands
    q = AdaptiveBudget(d, 2, 4, model, torch.device("cpu"))
    q.plan([500, 700], [False, False])
    assert q.costs.size == 1.0  # no K/V price: every step size 1
    model.__dict__.pop("_kv_per_weight_byte", None)
    walks = []
    weight_bytes = attention_share.weight_bytes_per_step
    try:
        attention_share.weight_bytes_per_step = lambda m: walks.append(1) or weight_bytes(m)
        k = kv_per_weight_byte(model)
        assert kv_per_weight_byte(model) == k and len(walks) == 1
        assert k == pytest.approx(attention_share.kv_bytes_per_token(model) / weight_bytes(model))
        model.__dict__["_kv_per_weight_byte"] = {torch.bfloat16: 1.0}  # measured at another dtype: measured again
        assert kv_per_weight_byte(model) == k and len(walks) == 2
    finally:
        attention_share.weight_bytes_per_step = weight_bytes
    seen = []
    plan = AdaptiveBudget.plan

    def spy(self, contexts=None, done=None):
        out = plan(self, contexts, done)
        seen.append((list(contexts), list(done), self.costs.size))
        return out

    prompts = [PROMPTS[0], PROMPTS[1]]
    ref = generate(model, prompts, max_new_tokens=12, eos_token_id=[])
    eos = ref.sequences[0][4]  # sequence 0 ends at its 5th token (or earlier, where that token came before)
    AdaptiveBudget.plan = spy
    try:
        out = generate(model, prompts, drafter=d, tree=tree, budget="adaptive", max_new_tokens=12,
                       eos_token_id=[eos])
    finally:
        AdaptiveBudget.plan = plan
    assert out.sequences == generate(model, prompts, max_new_tokens=12, eos_token_id=[eos]).sequences
    assert seen and all(u == pytest.approx(step_size(n, dn, k)) for n, dn, u in seen)
    i = next(i for i, (_, dn, _) in enumerate(seen) if dn[0])  # the first step after sequence 0 is done
    assert not seen[i][1][1] and seen[i][2] < seen[i - 1][2]


def test_step_costs_fit_is_the_decayed_ridge_written_out():
    """StepCosts.observe's written-out update and _solve3 against their definition: the normal equations decayed toward
    the prior, A <- DECAY A + x x^T + (1 - DECAY) w diag(S), r <- DECAY r + (1 - DECAY) w S prior + x ms, x = (1, T - 1,
    [T > 1]), solved by torch.linalg.solve in float64; random widths and times (some past the outlier cap), a prior
    from an earlier run and none."""
    rng = random.Random(5)
    for mem in ({}, {"k": (7.0, 1.1, 0.4)}):
        c = adaptive.StepCosts(dict(mem), "k", "cpu", 2)
        ref_A = torch.tensor(c.A, dtype=torch.float64)
        ref_r = torch.tensor(c.r, dtype=torch.float64)
        S = torch.tensor(c.PRIOR_SCALE, dtype=torch.float64)
        for step in range(300):
            w = rng.choice([1, 1, 1, 2, 3, 5, 9])
            ms = 6.0 + 1.5 * (w > 1) + 1.2 * (w - 1) + rng.uniform(-1.0, 1.0) + (40.0 if step % 50 == 7 else 0.0)
            before = (c.plain_seen, c.known)
            capped = min(ms, 2.0 * c.predict(w) + 2.0)
            c.observe(w, ms)
            if not before[1] and w == 1 and before[0] < c.PLAIN_STEPS_TO_SCALE:  # the first plain steps scale the prior
                ref_A = torch.tensor(c.A, dtype=torch.float64)
                ref_r = torch.tensor(c.r, dtype=torch.float64)
                continue
            x = torch.tensor([1.0, w - 1.0, float(w > 1)], dtype=torch.float64)
            pull = (1 - adaptive.DECAY) * c.weight * S
            ref_A = adaptive.DECAY * ref_A + torch.outer(x, x) + torch.diag(pull)
            ref_r = adaptive.DECAY * ref_r + pull * torch.tensor(c.prior, dtype=torch.float64) + x * capped
            assert sum(c.A, []) == pytest.approx(ref_A.flatten().tolist(), rel=1e-9, abs=1e-12)
            assert c.r == pytest.approx(ref_r.tolist(), rel=1e-9, abs=1e-12)
            a, b, cc = torch.linalg.solve(ref_A, ref_r).tolist()
            assert c.coef == pytest.approx([a, b], rel=1e-6) and c.spec == pytest.approx(cc, rel=1e-6, abs=1e-9)
        assert c.coef[1] == pytest.approx(1.2, rel=0.25)  # and the fit is the timings'
    for _ in range(20):  # _solve3 on its own: random symmetric positive definite systems
        m = torch.randn(3, 3, dtype=torch.float64)
        A, r = m @ m.T + 0.1 * torch.eye(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        assert adaptive._solve3(A.tolist(), r.tolist()) == pytest.approx(torch.linalg.solve(A, r).tolist(), rel=1e-7,
                                                                            abs=1e-9)


def test_a_deeper_node_starts_from_its_part_and_signals_rate_at_the_other_depths():
    """A key never verified takes the rate its (part, signal) earned at the other depths (toward its own prior by
    POOL_PRIOR_WEIGHT), not PRIOR_RATE: a chain that is accepted at depth 1 is worth verifying one deeper. Keys of
    another signal or part keep the prior; a sequence's own counts pool the same way over the run's rates."""
    c = adaptive.Calibration(2, 2, {}, torch.device("cpu"))
    depth1 = c.keys(torch.tensor([[0]]), torch.tensor([[1]]), torch.tensor([[3]]))
    c.update(depth1.expand(2, 1).contiguous(), torch.tensor([[20.0], [0.0]]), torch.tensor([[19.0], [0.0]]))
    deeper = c.keys(torch.tensor([[0, 0, 0, 1]]), torch.tensor([[2, 5, 2, 2]]), torch.tensor([[3, 3, 4, 3]]))
    r = c.rates(deeper.expand(2, 4).contiguous())
    w_pool, w_run, w_seq = adaptive.POOL_PRIOR_WEIGHT, adaptive.RUN_PRIOR_WEIGHT, adaptive.SEQ_PRIOR_WEIGHT
    run = (19 + w_pool * adaptive.PRIOR_RATE) / (20 + w_pool)  # no counts of its own: its pooled rate
    seq0 = (19 + w_pool * run) / (20 + w_pool)  # sequence 0 earned the 19 in 20 itself
    assert r[0, :2].tolist() == pytest.approx([seq0] * 2) and r[1, :2].tolist() == pytest.approx([run] * 2)
    assert run > 0.8 and r[:, 2:].flatten().tolist() == pytest.approx([adaptive.PRIOR_RATE] * 4)
    assert c.host_rates({0: deeper[0].tolist(), 1: deeper[0].tolist()}) == \
        {b: pytest.approx(r[b].tolist()) for b in range(2)}
    c.remember()  # the next run's prior: this run's rates
    assert c.memory["rates"][deeper[0, 0]] == pytest.approx(run)


def test_under_greedy_acceptance_every_right_branch_is_learned():
    """The rates learn each verified node whose parent was right, and whether it was (its token the base argmax after its
    parent), on every branch: a duplicate sibling the accepted path did not take is right too, and so are the nodes under
    it. Sampled acceptance (no target) learns the accepted path alone."""
    # sequence 0: root; 1 and 2 carry the same token (5), 3 another (7); 4 under 1, 5 under 2, 6 under 4
    # sequence 1: root, 1 (right), 2 under 1 (wrong), 3 under 2 (the argmax after 2, but under a wrong node), padding
    # (as TreeBatch pads: parent -1, depth 0, not valid)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2, 4], [-1, 0, 1, 2, -1, -1, -1]])
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 3], [0, 1, 2, 3, 0, 0, 0]])
    valid = torch.tensor([[True] * 7, [True, True, True, True, False, False, False]])
    tokens = torch.tensor([[0, 5, 5, 7, 8, 9, 3], [0, 6, 2, 4, 0, 0, 0]])
    target = torch.tensor([[5, 8, 9, 1, 4, 2, 2], [6, 3, 4, 1, 1, 1, 1]])  # the base argmax after each node
    right = adaptive._correct_nodes(tokens, target, parents, depths, valid)
    assert right.tolist() == [[1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]]

    def observed(with_target: bool):
        p = learned_policy(0.5, 1.0, batch=2)
        p.calib.tested.zero_(), p.calib.accepted.zero_()
        keys = torch.arange(7).expand(2, 7) + torch.tensor([[0], [7]])  # a key per node and sequence
        groups = torch.zeros(2, 7, dtype=torch.long)
        p.step = ((True,), [0.0], 7, (keys, depths, valid, parents, groups), torch.ones(2), None, None, None)
        accept = torch.tensor([[0, 1, 4], [0, 1, -1]])  # the path takes 1 then 4 (a tie with 2 then 5)
        p.observe(accept, tokens, target if with_target else None)
        p.calib._settle()
        return p.calib.tested[:14].view(2, 7).tolist(), p.calib.accepted[:14].view(2, 7).tolist()

    tested, accepted = observed(True)
    assert tested == [[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert accepted == [[0, 1, 1, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0]]
    tested, accepted = observed(False)  # the accepted path only: 2 looks rejected, 5 untried
    assert tested == [[0, 1, 1, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert accepted == [[0, 1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("rate, row_ms, width", [(0.5, 1.0, 3), (0.9, 0.5, 5)])  # cut; verified whole
@pytest.mark.parametrize("outlined", [False, True])
def test_a_gate_judges_its_part_by_the_expected_tokens_of_the_nodes_it_kept(outlined, rate, row_ms, width):
    """What a part earned, for its gate, is the sum of P over its kept nodes (the calibrated chance each is accepted),
    not the step's one draw of them: 0 or 1 or 2 tokens where P says 0.9, a variance that closed parts that paid
    (EPYC VM, 2026-11-29, 2k-token prompts at batch 1: the adaptive budget 1.03x plain against the table's 1.23x; with
    the gates on expected tokens 1.15x)."""
    d = OutlinedChainDrafter() if outlined else OneChainDrafter()
    p = learned_policy(rate, row_ms, batch=2, drafter=d)
    active = torch.tensor([1, 0])  # the second sequence finished: its nodes count for nothing
    out = p.propose(d, None, torch.zeros(2, dtype=torch.long), None, active, (True,))
    w = out.tree.num_nodes
    r = float(p.calib.rates(torch.zeros(1, 1, dtype=torch.long)))
    expect = sum(r**k for k in range(1, w))
    assert w == width and p.step[-1] == pytest.approx([expect], rel=1e-5)
    nothing = torch.tensor([[0] + [-1] * (w - 1)] * 2)  # nothing accepted this time
    p.observe(nothing, out.tokens, out.tokens + 1)
    assert p.gates[0].gain == pytest.approx(expect, rel=1e-5) and p.gates[0].nodes == pytest.approx(w - 1)



class TwoPartDrafter(OneChainDrafter):
    """The chain stand-in with two parts (as the combined drafter's n-gram and heads), for the gates' judgment."""

    parts = ("ngram", "heads")


def test_two_parts_tried_together_share_their_steps_excess_by_their_charges():
    """Two held-back parts tried in one step that is verified plain: the step's excess over a plain step (its wall time
    plus observe's own, minus the fit's plain step) is shared in proportion to what each was charged. Here the step
    ran 1.1 ms over the plain step and observe took 0.1 ms (0.05 charged to each part): an excess of 1.2 ms, so parts
    charged 0.1 and 0.3 ms record 0.3 and 0.9; where one was charged more than its share (1.3 of 1.4 ms: 1.11), it
    keeps its charge (1.35)."""
    now = [0.0]
    tick = [0.0]  # ms the clock moves at each reading (observe's own time)

    def clock():
        now[0] += tick[0] / 1e3
        return now[0]

    p = AdaptiveBudget(TwoPartDrafter(), 2, 5, OneChainDrafter(), torch.device("cpu"), clock=clock)
    p.costs.coef = [10.0, 2.0]
    for part_ms, want in (([0.1, 0.3], [0.3, 0.9]), ([0.1, 1.3], [0.15, 1.35])):
        p.begin()
        for g in p.gates:
            g.open, g.trial = False, None
        p.step = ((True, True), part_ms, 1, None, None, None, 2.0, None)  # a refused check of both parts
        now[0] += (p.costs.plain() + 1.0) / 1e3  # the step: 1 ms over a plain one, + 0.1 at observe's t0
        tick[0] = 0.1  # each clock reading moves 0.1 ms: t0, then observe's own time (0.1 ms, 0.05 a part)
        p.observe(None)
        tick[0] = 0.0
        assert [g.trial for g in p.gates] == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_a_part_pays_where_its_rate_beats_the_steps_rate_without_it(seed):
    """A gate's judgment (_pays): the part's own rate (its gain over its drafting and the rows its nodes add) beats the
    step's rate without it by the margin, the other parts that ran counted on the side without it (their gains, their
    drafting, their nodes' rows; a drafted step's surcharge c paid once, rows as StepCosts.rows prices them, c < 0 from
    a fit included); at margin 1 that is the step's rate with the part beating the rate without it. Gates' means drawn
    at random (both outcomes occur); then the case the others' rows decide (EPYC VM, 2026-11-29: left out of the rate
    without a part, the n-gram was held back beside the heads on 2k-token prompts where it paid)."""
    gen = torch.Generator().manual_seed(seed)
    p = learned_policy(0.5, 2.0, batch=1, drafter=TwoPartDrafter())
    a = 10.0

    def rows(n, b, c):
        return max(0.0, b * n + c * min(1.0, n))

    outcomes = set()
    for _ in range(20):
        b, c = float(torch.rand((), generator=gen)) * 3, float(torch.rand((), generator=gen)) * 3 - 1
        p.costs.coef, p.costs.spec = [a, b], c
        for g in p.gates:
            g.gain, g.nodes, g.cost = (float(x) for x in torch.rand(3, generator=gen) * torch.tensor([1.0, 2.0, 2.0]))
        for margin in (1.0, 1.15):
            p.margin = margin
            for parts in ((True, True), (True, False), (False, True)):
                ran = [q for q in (0, 1) if parts[q]]
                for q in ran:
                    others = [p.gates[u] for u in ran if u != q]
                    on = sum(g.nodes for g in others)
                    tokens = 1 + sum(g.gain for g in others)
                    time = a + sum(g.cost for g in others) + rows(on, b, c)
                    its = p.gates[q].cost + rows(on + p.gates[q].nodes, b, c) - rows(on, b, c)
                    pays = p._pays(q, parts)
                    assert pays == (p.gates[q].gain / its > margin * tokens / time)
                    if margin == 1.0:
                        assert pays == ((tokens + p.gates[q].gain) / (time + its) > tokens / time)
                    outcomes.add(pays)
    assert outcomes == {True, False}
    # the n-gram earning 0.28 a step at 1 node and 0.2 ms beside the heads' 0.5 at 1 node and 1 ms, rows 2 ms, no
    # surcharge: with the n-gram 1.78 tokens in 15.2 ms beats the heads alone, 1.5 in 13 (0.117 against 0.115 a ms);
    # the rate without it priced without the heads' rows (1.5 in 11 ms: 0.136) held it back
    p.margin, p.costs.coef, p.costs.spec = 1.0, [10.0, 2.0], 0.0
    for g, (gain, cost) in zip(p.gates, ((0.28, 0.2), (0.5, 1.0))):
        g.gain, g.nodes, g.cost = gain, 1.0, cost
    ngram, heads = p.gates
    assert p._pays(0, (True, True))
    without_rows = ngram.gain * (p.costs.predict(1) + heads.cost) > (ngram.cost + p.costs.rows(ngram.nodes)) * (1 + heads.gain)
    assert not without_rows
