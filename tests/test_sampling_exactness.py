"""Speculative sampling draws exactly from the base model's distribution: a statistical test.

A tiny random Llama (vocabulary 8, one layer) makes the exact law of the next 3 new tokens enumerable:
P(t1 t2 t3) = p(t1 | prompt) p(t2 | prompt t1) p(t3 | prompt t1 t2), each p the base distribution after
temperature / top-k / top-p (sampling.sampling_probs, the one definition plain and speculative sampling
share), computed by brute force from full forwards over all 8^2 continuations. Each setting decodes N
independent sequences in one batch (the same prompt repeated, one seed) and compares the 512-cell
histogram with the exact law by a G-test (cells expected < 5 pooled into one; df = cells - 1; p-value
from the chi-square tail).

Significance: family-wise alpha = 1e-3 over the positive settings, Bonferroni-corrected (each passes at
p > 1e-3 / m). Seeds are fixed, so every run sees the same samples. The harness has power: typical
acceptance, a rejection sampler that draws the next root from p instead of the residual (rejected
children not removed: the classic bug), and, for sampled drafts, the min(1, p/q) rule with the residual
left at r after a rejection (q not subtracted) are refused by the same test at p < 1e-6 each.

The fused path (acceptance from LM-head statistics, ops.rejection_accept, with residual draws from
ops.lm_head_residual_sample: no [B, T, V] probabilities) runs its Triton kernels (interpreted on the
CPU) inside an otherwise reference plan, with a static tree and with per-sequence trees; a fused
sampler whose residual draw removes nothing is refused like the classic bug.

Drafters: fresh Medusa / Hydra / Hydra++ / Amphista heads with randomised weights (drafts away from the base
argmax, so acceptance and rejection both happen at every depth; Amphista's also under the adaptive budget, whose cut
ranks its guesses by its own confidence classes), a static tree with siblings at two
depths, and a test drafter proposing a random tree per sequence per step (TreeBatch, ragged, repeated
sibling tokens); settings with top-k, top-p, a batch of two different prompts, and a node budget that
changes with the context (the full tree, then a plain step: hydra_kernels/budget.py).

Sampled drafts (kinds "sampled-..."; ops.rejection_verify's min(1, p/q) rule): the head drafters with
draft_temperature > 0 (children drawn i.i.d. from the head's softmax), the combined drafter over them
(n-gram nodes as one-hot rows beside sampled siblings), and a test drafter proposing random per-sequence
trees whose every node draws its token from its own random q (a sparse one, its parent's shared row:
i.i.d. siblings, or a one-hot row: a deterministic child among sampled ones). The deterministic rule on
sampled drafts (draft_probs dropped) is exact too (its proof conditions on the drafted tokens), only
less often accepting: a positive setting, not a negative control.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import ops
from hydra_kernels.drafters import CombinedDrafter, Drafter, Proposal
from hydra_kernels.ops import reference
from hydra_kernels.generate import generate
from hydra_kernels.sampling import sampling_probs
from hydra_kernels.tree import TreeBatch
from test_llama_vs_transformers import make_hf

V = 8  # vocabulary: 8^3 = 512 cells for the next 3 tokens
N = 12000  # samples per setting (one batch)
NEW = 3
FAMILY_ALPHA = 1e-3
NEGATIVE_P = 1e-6  # a negative control must be refused at least this clearly
PROMPTS = ([3, 1, 4, 1, 5], [2, 7])
TREE = hk.Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # siblings at depths 1 and 2, depth 3
DRAFT_TEMPERATURE = {"medusa": 1.0, "hydra": 0.7, "hydra++": 1.3}  # the sampled head drafters' q temperatures


def law_hf():
    """The harness's enumerable model as transformers builds it: 1 layer over V tokens, its LM head sharpened
    (sharper next-token laws than the random init gives: more power). Also the runner's tests' model."""
    hf = make_hf("gqa3-tied", seed=5, vocab_size=V, num_hidden_layers=1, hidden_size=16, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=24)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    return hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(law_hf())


def random_head_drafter(model, kind):
    torch.manual_seed({"medusa": 1, "hydra": 2, "hydra++": 3, "amphista": 4}[kind])
    # Amphista: its heads' top-k guesses (never sampled) from its stages over the committed text and its mixer
    d = hk.new_drafter(model, kind=kind, num_heads=3, **({} if kind == "amphista" else {"num_layers": 1}))
    with torch.no_grad():
        for name, p in d.named_parameters():  # random; Amphista's norms near 1 (its stages and mixer are layers)
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if kind == "amphista" and "norm" in name else 0.0))
    return d


class RandomTreeDrafter(Drafter):
    """A random tree per sequence per step: 1..7 nodes, random parents (depth <= 6), random tokens
    (repeated siblings included), drawn from its own generator (so drafts are fixed before the step's
    acceptance draws)."""

    kinds = ("test-random-trees",)

    @property
    def kind(self):
        return "test-random-trees"

    def check_model(self, model):
        pass

    def resolve_tree(self, tree, device_type):
        return hk.tree.chain(6)  # bounds every proposal: 7 nodes, depth 6

    def start(self, model, batch_size, max_seq_len, tree, backends):
        return torch.Generator().manual_seed(123)

    def after_prefill(self, state, hidden, lengths):
        pass

    def after_step(self, state, accepted_hidden, accepted_tokens, accept_lengths):
        pass

    def propose(self, gen, root, seqlens):
        B, T = root.shape[0], 7
        node = torch.arange(T)
        parents = (torch.rand(B, T, generator=gen) * node).long()  # parent of node i uniform in [0, i)
        parents[:, 0] = -1
        valid = node[None, :] < torch.randint(1, T + 1, (B, 1), generator=gen)
        tokens = torch.randint(V, (B, T), generator=gen)
        tokens[:, 0] = root
        return Proposal(tokens, TreeBatch(parents, valid))


class RandomSampledTreeDrafter(RandomTreeDrafter):
    """RandomTreeDrafter's trees, tokens drawn from q: node j's row is, at random, its parent's shared row
    (i.i.d. siblings), a row of its own, or a one-hot row (a deterministic draft); rows are sparse
    (about half the vocabulary at 0), so p > 0 = q and q > 0 = p both occur."""

    kinds = ("test-random-sampled-trees",)

    def propose(self, gen, root, seqlens):
        B, T = root.shape[0], 7
        tree = RandomTreeDrafter.propose(self, gen, root, seqlens).tree
        own = torch.rand(B, T, V, generator=gen) ** 2 * (torch.rand(B, T, V, generator=gen) < 0.5)
        own[..., 0] += (own.sum(-1) == 0)  # never an empty row
        shared = own.gather(1, tree.parents.clamp(min=0)[:, :, None].expand(B, T, V))  # the parent's row
        one_hot = torch.nn.functional.one_hot(torch.randint(V, (B, T), generator=gen), V).float()
        kind = torch.randint(3, (B, T, 1), generator=gen)
        q = torch.where(kind == 0, shared, torch.where(kind == 1, own, one_hot))
        q = q / q.sum(-1, keepdim=True)
        tokens = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
        tokens[:, 0] = root
        return Proposal(tokens, tree, draft_probs=q)


def exact_law(model, prompt, temperature, top_k, top_p):
    """P(t1, t2, t3) over all V^3 continuations: [V, V, V]."""
    cont = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V^2, 2]: (t1, t2)
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), cont], dim=1)
    with torch.inference_mode():
        logits = model(ids)[:, len(prompt) - 1:]  # [V^2, 3, V]: after the prompt, after t1, after t2
    p = sampling_probs(logits, temperature, top_k, top_p)
    p1 = p[0, 0]  # [V]
    p2 = p[::V, 1]  # [V] rows with t2 = 0 for every t1: p(t2 | t1)
    p3 = p[:, 2].view(V, V, V)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


def g_test(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value of a G-test of counts against the law expected_p (cells expected < 5 pooled)."""
    counts, exp = counts.flatten().double(), expected_p.flatten().double() * counts.sum()
    seen_impossible = counts[exp == 0].sum()
    if seen_impossible > 0:
        return 0.0  # a sequence the base law gives probability 0
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    g = 2 * torch.special.xlogy(obs, obs / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), g / 2))


def histogram(sequences, rows) -> torch.Tensor:
    s = torch.tensor([sequences[b] for b in rows])  # [n, 3]
    return torch.bincount(s[:, 0] * V * V + s[:, 1] * V + s[:, 2], minlength=V ** 3).view(V, V, V)


def use_fused_rejection(monkeypatch):
    """generate() plans the reference backend but the fused rejection ops' Triton kernels (the model's
    own ops under the interpreter would take minutes at this batch), so it takes the fused path. Returns
    the list the fused acceptance op appends to on each call."""
    gen_module = sys.modules["hydra_kernels.generate"]
    real_plan, real_accept = gen_module.plan_backends, ops.rejection_accept
    fused = {"lm_head_residual_sample": "triton", "rejection_accept": "triton"}

    def plan(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        return dataclasses.replace(p, ops={**p.ops, **fused})

    calls = []
    monkeypatch.setattr(gen_module, "plan_backends", plan)
    monkeypatch.setattr(ops, "rejection_accept", lambda *a, **k: calls.append(k["backend"]) or real_accept(*a, **k))
    monkeypatch.setattr(ops, "rejection_verify", lambda *a, **k: pytest.fail("the logits path ran"))
    return calls


def sample(model, drafter, prompts, temperature, top_k, top_p, acceptance, seed=0):
    """N sequences, prompts cycled through the batch -> (out, {prompt index: histogram})."""
    batch = [prompts[i % len(prompts)] for i in range(N)]
    auto = drafter is not None and bool(drafter.budget_tables)
    static = getattr(drafter, "num_heads", 0) or isinstance(drafter, CombinedDrafter)  # head drafters: TREE
    out = generate(model, batch, drafter=drafter, tree=TREE if static else None,
                   budget="auto" if auto else None,
                   max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   acceptance=acceptance if drafter is not None else None, eos_token_id=[], backend="reference")
    assert all(len(s) == NEW for s in out.sequences)
    return out, {i: histogram(out.sequences, range(i, N, len(prompts))) for i in range(len(prompts))}


SETTINGS = {  # name: (drafter kind or None (plain sampling), temperature, top_k, top_p, number of prompts)
    "plain": (None, 0.8, 0, 1.0, 1),
    "plain-top_p": (None, 0.8, 0, 0.8, 1),
    "medusa": ("medusa", 0.8, 0, 1.0, 1),
    "hydra": ("hydra", 1.0, 0, 1.0, 1),
    "hydra++": ("hydra++", 0.8, 0, 1.0, 1),
    "per-sequence-trees": ("random-trees", 0.8, 0, 1.0, 1),
    "hydra-top_k": ("hydra", 0.8, 4, 1.0, 1),
    "medusa-top_p": ("medusa", 0.8, 0, 0.8, 1),
    "per-sequence-trees-top_k-top_p": ("random-trees", 1.0, 5, 0.9, 1),
    "hydra-batch-2-prompts": ("hydra", 0.8, 0, 1.0, 2),
    "amphista-batch-2-prompts": ("amphista", 0.8, 0, 1.0, 2),
    "hydra-varying-budget": ("hydra-budget", 0.8, 0, 1.0, 1),  # the full tree, then a plain step
    "sampled-medusa": ("sampled-medusa", 0.8, 0, 1.0, 1),
    "sampled-hydra-top_k": ("sampled-hydra", 0.8, 4, 1.0, 1),
    "sampled-hydra++-top_p": ("sampled-hydra++", 1.0, 0, 0.8, 1),
    "sampled-hydra-batch-2-prompts": ("sampled-hydra", 0.8, 0, 1.0, 2),
    "sampled-combined-ngram-hydra": ("sampled-combined", 0.8, 0, 1.0, 1),
    "sampled-per-sequence-trees-batch-2-prompts": ("sampled-random-trees", 0.8, 0, 1.0, 2),
    "sampled-per-sequence-trees-top_k-top_p": ("sampled-random-trees", 1.0, 5, 0.9, 1),
}
DETERMINISTIC_RULE_ON_SAMPLED = ("sampled-hydra", 0.8, 0, 1.0, 1)  # draft_probs dropped: still exact
FUSED_SETTINGS = {  # the fused path (temperature only): name -> (drafter kind, temperature, number of prompts)
    "fused-hydra-batch-2-prompts": ("hydra", 0.8, 2),
    "fused-per-sequence-trees": ("random-trees", 1.0, 2),
    "fused-hydra-varying-budget": ("hydra-budget", 0.8, 1),  # a plain step: a root-only tree, fused too
}
# the adaptive budget (hydra_kernels/adaptive.py) with random costs and part gates: each step verifies an
# arbitrary cut of the proposal, a plain step or nothing drafted, chosen before the step's draws
ADAPTIVE_SETTINGS = {  # name -> (drafter kind, temperature, number of prompts)
    "adaptive-hydra-batch-2-prompts": ("hydra", 0.8, 2),
    "adaptive-per-sequence-trees": ("random-trees", 1.0, 1),
    "adaptive-sampled-combined-ngram-hydra": ("sampled-combined", 0.8, 1),
    "adaptive-amphista": ("amphista", 0.8, 1),  # its confidence classes (a head's p of its guess) steer the cut
}
# number of G-tests among the positive settings (+ 1: the deterministic rule on sampled drafts)
M = (sum(n for *_, n in SETTINGS.values()) + sum(n for *_, n in FUSED_SETTINGS.values())
     + sum(n for *_, n in ADAPTIVE_SETTINGS.values()) + 1)


def make_drafter(model, kind):
    if kind is None:
        return None
    if kind == "sampled-random-trees":
        return RandomSampledTreeDrafter()
    if kind == "sampled-combined":  # n-gram nodes (deterministic) beside sampled Hydra nodes under the root
        heads = make_drafter(model, "sampled-hydra")
        return hk.new_drafter(model, kind="combined", drafters=[hk.new_drafter(model, kind="ngram"), heads])
    if kind.startswith("sampled-"):
        d = make_drafter(model, kind[len("sampled-"):])
        d.draft_temperature = DRAFT_TEMPERATURE[kind[len("sampled-"):]]
        return d
    if kind == "hydra-budget":  # the node budget changes with the context at every position (budget.py)
        from hydra_kernels.budget import BudgetTable, tree_key

        d = random_head_drafter(model, "hydra")  # 3 new tokens: a full-tree step, then a plain step if needed
        d.budget_tables["cpu"] = BudgetTable(device="cpu", tree=tree_key(TREE), full=TREE.num_nodes, batch_sizes=[1],
                                             contexts=[5, 6, 7], nodes=[[TREE.num_nodes, 1, 3]])
        return d
    return RandomTreeDrafter() if kind == "random-trees" else random_head_drafter(model, kind)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rejection_sampling_is_exact(model, name):
    kind, temperature, top_k, top_p, n_prompts = SETTINGS[name]
    prompts = PROMPTS[:n_prompts]
    out, hists = sample(model, make_drafter(model, kind), prompts, temperature, top_k, top_p, "rejection")
    if kind is not None:  # drafts were both accepted and rejected: the walk's every branch ran
        lens = torch.tensor([a for row in out.accept_lengths for a in row])
        assert (lens > 1).float().mean() > 0.05 and (lens == 1).float().mean() > 0.05, lens.float().mean()
    for i, prompt in enumerate(prompts):
        p = g_test(hists[i], exact_law(model, prompt, temperature, top_k, top_p))
        print(f"{name}, prompt {i}: G-test p = {p:.3g}")
        assert p > FAMILY_ALPHA / M, f"{name}, prompt {i}: G-test p = {p:.2e} <= {FAMILY_ALPHA / M:.1e}"


@pytest.mark.parametrize("name", list(ADAPTIVE_SETTINGS))
def test_adaptive_rejection_sampling_is_exact(model, name, monkeypatch):
    """The adaptive policy decides each step's tree from the drafts and earlier steps (their accepted tokens: the
    sequences' leads its batch objective weighs), never from the step's own draws, so rejection sampling stays exact;
    here its costs, gates and expected progress are random (seeded apart from the run's generator; the progress the
    real objective's, from the real leads, plus noise: a batch of hundreds of level sequences would draft nothing), so
    steps verify every width, plain steps and undrafted steps."""
    import random

    from hydra_kernels import adaptive

    rng = random.Random(len(name))
    monkeypatch.setattr(adaptive, "memory", lambda owner, name: {})  # no earlier run's learning: any test order
    monkeypatch.setattr(adaptive.StepCosts, "predict", lambda self, w: rng.uniform(1.0, 1.3))  # cuts of any width
    monkeypatch.setattr(adaptive.PartGate, "due", lambda self: rng.random() < 0.8)
    for objective in ("bottleneck_expected", "bottleneck_expected_tensor"):
        real = getattr(adaptive, objective)
        monkeypatch.setattr(adaptive, objective, lambda *a, real=real: [e + rng.uniform(0.0, 1.0) * w
                                                                        for w, e in enumerate(real(*a))])
    kind, temperature, n_prompts = ADAPTIVE_SETTINGS[name]
    prompts = PROMPTS[:n_prompts]
    drafter = make_drafter(model, kind)
    batch = [prompts[i % len(prompts)] for i in range(N)]
    static = getattr(drafter, "num_heads", 0) or isinstance(drafter, CombinedDrafter)
    out = generate(model, batch, drafter=drafter, tree=TREE if static else None, budget="adaptive",
                   max_new_tokens=NEW, temperature=temperature, seed=0,
                   acceptance="rejection", eos_token_id=[], backend="reference")
    assert all(len(s) == NEW for s in out.sequences)
    assert max(out.step_nodes) > 1, out.step_nodes  # drafts were verified (a 3-token run has 2-3 steps)
    for i, prompt in enumerate(prompts):
        p = g_test(histogram(out.sequences, range(i, N, len(prompts))), exact_law(model, prompt, temperature, 0, 1.0))
        print(f"{name}, prompt {i}: G-test p = {p:.3g}")
        assert p > FAMILY_ALPHA / M, f"{name}, prompt {i}: G-test p = {p:.2e} <= {FAMILY_ALPHA / M:.1e}"


@pytest.mark.parametrize("name", list(FUSED_SETTINGS))
def test_fused_rejection_sampling_is_exact(model, name, monkeypatch):
    kind, temperature, n_prompts = FUSED_SETTINGS[name]
    prompts = PROMPTS[:n_prompts]
    calls = use_fused_rejection(monkeypatch)
    out, hists = sample(model, make_drafter(model, kind), prompts, temperature, 0, 1.0, "rejection")
    assert calls and set(calls) == {"triton"}, calls  # the fused kernels ran, every step
    lens = torch.tensor([a for row in out.accept_lengths for a in row])
    assert (lens > 1).float().mean() > 0.05 and (lens == 1).float().mean() > 0.05, lens.float().mean()
    for i, prompt in enumerate(prompts):
        p = g_test(hists[i], exact_law(model, prompt, temperature, 0, 1.0))
        print(f"{name}, prompt {i}: G-test p = {p:.3g}")
        assert p > FAMILY_ALPHA / M, f"{name}, prompt {i}: G-test p = {p:.2e} <= {FAMILY_ALPHA / M:.1e}"


def test_fused_residual_bug_is_refused_by_the_same_test(model, monkeypatch):
    """Negative control for the fused path: residual draws that remove no child (exclude all -1) draw
    from p instead of the residual, the classic bug; the same test must catch it."""
    use_fused_rejection(monkeypatch)
    exact = ops.lm_head_residual_sample
    monkeypatch.setattr(ops, "lm_head_residual_sample",
                        lambda x, w, t, seed, exclude, **k: exact(x, w, t, seed, torch.full_like(exclude, -1), **k))
    _, hists = sample(model, random_head_drafter(model, "medusa"), PROMPTS[:1], 0.8, 0, 1.0, "rejection")
    p = g_test(hists[0], exact_law(model, PROMPTS[0], 0.8, 0, 1.0))
    print(f"fused residual bug: G-test p = {p:.3g}")
    assert p < NEGATIVE_P, f"the fused residual bug passed the exactness test (p = {p:.2e}): the harness has no power"


def test_typical_acceptance_is_refused_by_the_same_test(model):
    """Negative control: Medusa's typical acceptance is not distribution-preserving."""
    _, hists = sample(model, random_head_drafter(model, "hydra"), PROMPTS[:1], 0.8, 0, 1.0, "typical")
    p = g_test(hists[0], exact_law(model, PROMPTS[0], 0.8, 0, 1.0))
    print(f"typical acceptance: G-test p = {p:.3g}")
    assert p < NEGATIVE_P, f"typical acceptance passed the exactness test (p = {p:.2e}): the harness has no power"


def test_residual_bug_is_refused_by_the_same_test(model, monkeypatch):
    """Negative control, subtle: the next root drawn from p instead of the residual (rejected children
    not removed) over-weights drafted tokens; the same test must catch it."""
    exact = ops.rejection_verify

    def biased(logits, tree_tokens, paths, *, temperature, top_k=0, top_p=1.0, generator=None, draft_probs=None,
               backend="auto"):
        v = exact(logits, tree_tokens, paths, temperature=temperature, top_k=top_k, top_p=top_p,
                  generator=generator, draft_probs=draft_probs, backend=backend)
        p_last = sampling_probs(logits[torch.arange(logits.shape[0]), v.last_node], temperature, top_k, top_p)
        return v._replace(next_root=torch.multinomial(p_last, 1, generator=generator)[:, 0])

    monkeypatch.setattr(ops, "rejection_verify", biased)
    _, hists = sample(model, random_head_drafter(model, "medusa"), PROMPTS[:1], 0.8, 0, 1.0, "rejection")
    p = g_test(hists[0], exact_law(model, PROMPTS[0], 0.8, 0, 1.0))
    print(f"residual bug: G-test p = {p:.3g}")
    assert p < NEGATIVE_P, f"the residual bug passed the exactness test (p = {p:.2e}): the harness has no power"


def test_deterministic_rule_on_sampled_drafts_is_exact_too(model, monkeypatch):
    """Sampled Hydra drafts verified without their draft_probs: the deterministic rule, exact for any draft
    drawn independently of the step's acceptance draws; it accepts less often than min(1, p/q)."""
    kind, temperature, top_k, top_p, _ = DETERMINISTIC_RULE_ON_SAMPLED
    exact = ops.rejection_verify
    monkeypatch.setattr(ops, "rejection_verify", lambda *a, draft_probs=None, **k: exact(*a, **k))
    out, hists = sample(model, make_drafter(model, kind), PROMPTS[:1], temperature, top_k, top_p, "rejection")
    p = g_test(hists[0], exact_law(model, PROMPTS[0], temperature, top_k, top_p))
    print(f"deterministic rule on sampled drafts: G-test p = {p:.3g}")
    assert p > FAMILY_ALPHA / M, f"G-test p = {p:.2e} <= {FAMILY_ALPHA / M:.1e}"
    monkeypatch.setattr(ops, "rejection_verify", exact)
    out_q, _ = sample(model, make_drafter(model, kind), PROMPTS[:1], temperature, top_k, top_p, "rejection")
    assert out_q.mean_accepted_tokens > out.mean_accepted_tokens  # what min(1, p/q) buys


def test_sampled_drafts_without_subtracting_q_are_refused_by_the_same_test(model, monkeypatch):
    """Negative control for the min(1, p/q) rule: after a rejected draw the residual stays r instead of
    max(r - q, 0) renormalised; the emitted token then over-weights what q and p share."""
    monkeypatch.setattr(reference, "_residual_after_rejection", lambda r, q: r)
    _, hists = sample(model, make_drafter(model, "sampled-medusa"), PROMPTS[:1], 0.8, 0, 1.0, "rejection")
    p = g_test(hists[0], exact_law(model, PROMPTS[0], 0.8, 0, 1.0))
    print(f"q not subtracted: G-test p = {p:.3g}")
    assert p < NEGATIVE_P, f"the unsubtracted residual passed the exactness test (p = {p:.2e}): no power"
