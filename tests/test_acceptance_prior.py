"""A drafter's acceptance prior (hydra_kernels/acceptance_prior.py): saved and loaded with the drafter, a corrupt or
mismatched file refused or not taken, where the adaptive budget starts its rates in a fresh process (and only there),
measured by hydra_kernels/training/acceptance_calibration.py with every node verified; the shipped default drafter has
one."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import adaptive
from hydra_kernels.acceptance_prior import FILE, AcceptancePrior, load_prior
from hydra_kernels.drafters.registry import shipped_drafters
from hydra_kernels.generate import generate
from test_budget import PROMPTS, make, model  # noqa: F401 (model: the fixture)

K_PER_PART = adaptive.MAX_DEPTH_KEY * adaptive.SIGNALS


def prior_for(parts, seed: int = 0) -> AcceptancePrior:
    g = torch.Generator().manual_seed(seed)
    n = len(parts) * K_PER_PART
    return AcceptancePrior(list(parts), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS,
                           torch.rand(n, generator=g).tolist(), (torch.rand(n, generator=g) * 20).tolist(), "a test")


def test_saved_loaded_and_corrupt_files_refused(tmp_path):
    p = prior_for(("ngram", "heads"))
    assert load_prior(tmp_path) is None
    p.save(tmp_path)
    assert load_prior(tmp_path) == p
    good = json.loads((tmp_path / FILE).read_text())
    bad = {"not json": "{", "a rate too few": {**good, "rates": good["rates"][:-1]},
           "a rate above 1": {**good, "rates": [1.5] + good["rates"][1:]},
           "a NaN rate": {**good, "rates": [math.nan] + good["rates"][1:]},
           "a negative count": {**good, "tested": [-1.0] + good["tested"][1:]},
           "an unknown field": {**good, "extra": 1}, "no parts": {**good, "parts": []}}
    for why, content in bad.items():
        (tmp_path / FILE).write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ValueError, match=f"{FILE} is not an acceptance prior"):
            load_prior(tmp_path)
    assert p.fits(("ngram", "heads"), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS)
    assert not p.fits(("draft",), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS)
    assert not p.fits(("ngram", "heads"), adaptive.MAX_DEPTH_KEY + 1, adaptive.SIGNALS)


def test_a_drafter_carries_its_prior_and_a_fresh_run_starts_from_it(model, tmp_path):  # noqa: F811
    d, _ = make(model, "hydra")
    d.acceptance_prior = prior = prior_for(d.parts, seed=1)
    d.save(tmp_path)
    back = hk.load_drafter(tmp_path, model=model)
    assert back.acceptance_prior == prior
    budget = adaptive.AdaptiveBudget(back, 1, 4, model, torch.device("cpu"))
    assert torch.equal(budget.calib.prior, torch.tensor(prior.rates, dtype=torch.float32))
    # one sequence: what the run learns needs a verified draft, and a batch's drafts must move every sequence (the
    # batch's end: adaptive.bottleneck_expected), which this prior's random rates on an untrained model need not give
    plain = generate(model, PROMPTS[:1], max_new_tokens=10, eos_token_id=[])
    out = generate(model, PROMPTS[:1], drafter=back, budget="adaptive", max_new_tokens=10, eos_token_id=[])
    assert out.sequences == plain.sequences and max(out.step_nodes) > 1  # a draft was verified: something learned
    # the next run starts from what this one learned, not from the file
    learned = adaptive.memory(back, "memory")["rates"]
    again = adaptive.AdaptiveBudget(back, 1, 4, model, torch.device("cpu"))
    assert torch.equal(again.calib.prior, learned) and not torch.equal(learned, budget.calib.prior)
    # without a prior: PRIOR_RATE everywhere
    d2, _ = make(model, "hydra")
    fresh = adaptive.AdaptiveBudget(d2, 1, 4, model, torch.device("cpu"))
    assert torch.all(fresh.calib.prior == adaptive.PRIOR_RATE)


def test_a_prior_keyed_for_other_parts_is_not_taken(model):  # noqa: F811
    d, _ = make(model, "combined")
    d.acceptance_prior = prior_for(("draft",))  # a single-part drafter's
    with pytest.warns(RuntimeWarning, match="acceptance prior keys parts"):
        budget = adaptive.AdaptiveBudget(d, 1, 4, model, torch.device("cpu"))
    assert torch.all(budget.calib.prior == adaptive.PRIOR_RATE)
    # once a run has learned rates, the shipped prior is not read again (nor built, nor warned about)
    learned = torch.rand(budget.calib.K)
    adaptive.memory(d, "memory")["rates"] = learned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        later = adaptive.AdaptiveBudget(d, 1, 4, model, torch.device("cpu"))
    assert torch.equal(later.calib.prior, learned)


def test_measured_prior_counts_every_verified_node(model):  # noqa: F811
    """Every part drafting every step, every node verified: the counts are the nodes whose parent was right (greedy),
    the rates in [0, 1], untested keys at their pooled prior; the real policy class and the drafter's memory back."""
    from hydra_kernels.training.acceptance_calibration import measure_acceptance_prior

    d, _ = make(model, "combined")
    memory = adaptive.memory(d, "memory")
    memory["marker"] = 1
    real = adaptive.AdaptiveBudget
    prompts = [p * 3 for p in PROMPTS]  # repeats: the n-gram part matches
    prior = measure_acceptance_prior(model, d, prompts, new_tokens=12, batch=2, measured="a test")
    assert adaptive.AdaptiveBudget is real and d.__dict__["_adaptive_memory"] is memory
    assert prior.fits(d.parts, adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS) and prior.measured.startswith("a test; ")
    tested = torch.tensor(prior.tested).view(len(d.parts), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS)
    assert tested[0].sum() > 0 and tested[1, 0].sum() > 0  # the n-gram's nodes and the heads' first depth
    assert all(0.0 <= r <= 1.0 for r in prior.rates)
    # a part x signal never tested at any depth keeps PRIOR_RATE
    never = (tested.sum(1) == 0).nonzero().tolist()
    rates = torch.tensor(prior.rates).view(len(d.parts), adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS)
    assert never and all(torch.allclose(rates[p, :, s], torch.tensor(adaptive.PRIOR_RATE)) for p, s in never)


@pytest.mark.parametrize("kind", ["combined", *shipped_drafters()])
def test_every_shipped_drafter_ships_a_prior_keyed_for_its_parts(kind):
    """The default (the composed combined kind, beside its table) and every shipped kind: a fresh process's first
    adaptive run starts from measured rates, not PRIOR_RATE everywhere."""
    from hydra_kernels.drafters.registry import family, measured_files_dir

    prior = load_prior(measured_files_dir(kind))
    assert prior is not None, f"the shipped {kind} drafter has no {FILE} (python python/calibrate_acceptance.py --kind {kind})"
    assert prior.fits(family(kind).parts, adaptive.MAX_DEPTH_KEY, adaptive.SIGNALS)
    assert sum(prior.tested) > 1000 and all(0.0 <= r <= 1.0 for r in prior.rates)
    # measured, not left at the prior: the first depth's rates differ by confidence class
    first = [prior.rates[s] for s in range(adaptive.SIGNALS) if prior.tested[s] > 0]
    assert len(first) >= 2 and max(first) - min(first) > 0.1, first
