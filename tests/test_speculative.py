"""Speculative generate() on a small random model: exactness, EOS inside accepted paths, exact lengths,
typical acceptance, failures. (The real-model lossless test is test_lossless_smollm2.py.)"""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import GenerationError, generate
from test_llama_vs_transformers import make_hf

KINDS = ["medusa", "hydra", "hydra++"]


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


@pytest.fixture(scope="module")
def drafters(model):
    # A fresh Medusa head with the tied LM head proposes what the base model would say *now*, which
    # this small random model often repeats: long accepted paths without any training.
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        out[kind] = hk.new_drafter(model, kind=kind, num_heads=4, num_layers=1)
    return out


PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 40, 41, 40]]
TREE = hk.tree.default_tree(24, depth=4)


def plain(model, n, eos=()):
    return generate(model, PROMPTS, max_new_tokens=n, eos_token_id=list(eos)).sequences


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", ["chain-1", "chain-4", TREE])
def test_greedy_speculative_equals_plain(model, drafters, kind, tree):
    out = generate(model, PROMPTS, drafter=drafters[kind], tree=tree, max_new_tokens=40, eos_token_id=[])
    assert out.sequences == plain(model, 40)
    assert all(sum(a) + 1 == 40 for a in out.accept_lengths)
    assert out.num_steps == max(len(a) for a in out.accept_lengths)


def test_medusa_accepts_long_paths_here(model, drafters):
    out = generate(model, PROMPTS, drafter=drafters["medusa"], tree=TREE, max_new_tokens=40, eos_token_id=[])
    assert out.mean_accepted_tokens > 2 and max(max(a) for a in out.accept_lengths) == 5


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13])
def test_exact_max_new_tokens(model, drafters, n):
    for kind in KINDS:
        out = generate(model, PROMPTS, drafter=drafters[kind], tree=TREE, max_new_tokens=n, eos_token_id=[])
        assert out.sequences == plain(model, n), kind


def test_eos_inside_an_accepted_path_stops_exactly_there(model, drafters):
    free = generate(model, PROMPTS, drafter=drafters["medusa"], tree=TREE, max_new_tokens=30, eos_token_id=[])
    inside = 0
    for b, seq in enumerate(free.sequences):
        ends = set((torch.tensor([1] + free.accept_lengths[b]).cumsum(0) - 1).tolist())  # step boundaries
        for pos, tok in enumerate(seq):
            if seq.index(tok) != pos or pos in ends:
                continue  # want the first occurrence, strictly inside a multi-token step
            out = generate(model, PROMPTS, drafter=drafters["medusa"], tree=TREE, max_new_tokens=30, eos_token_id=tok)
            assert out.sequences == plain(model, 30, eos=[tok])
            assert out.sequences[b] == seq[: pos + 1]
            inside += 1
            break
    assert inside >= 2, "the test needs EOS tokens that land inside accepted paths"


def test_typical_acceptance_is_seeded_and_has_the_right_limits(model, drafters):
    d = drafters["hydra"]
    kw = dict(drafter=d, tree=TREE, max_new_tokens=20, eos_token_id=[], acceptance="typical", temperature=0.9)
    a = generate(model, PROMPTS, seed=11, **kw)
    b = generate(model, PROMPTS, seed=11, **kw)
    assert a.sequences == b.sequences and a.accept_lengths == b.accept_lengths
    assert generate(model, PROMPTS, seed=12, **kw).sequences != a.sequences
    never = generate(model, PROMPTS, seed=11, posterior_threshold=1e9, posterior_alpha=1e9, **kw)
    assert all(x == 1 for acc in never.accept_lengths for x in acc)  # one token per step
    always = generate(model, PROMPTS, seed=11, posterior_threshold=0.0, posterior_alpha=0.0, **kw)
    assert max(max(acc) for acc in always.accept_lengths) == TREE.depth + 1  # every drafted token passes
    assert all(len(s) == 20 for s in always.sequences)


def test_typical_at_temperature_zero_is_greedy(model, drafters):
    out = generate(model, PROMPTS, drafter=drafters["hydra"], tree=TREE, max_new_tokens=15, eos_token_id=[],
                   acceptance="typical", temperature=0.0)
    assert out.sequences == plain(model, 15)


def test_failure_mid_speculation_keeps_tokens(model, drafters, monkeypatch):
    d = drafters["medusa"]
    full = generate(model, PROMPTS, drafter=d, tree=TREE, max_new_tokens=30, eos_token_id=[])
    real, calls = d.propose, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(d, "propose", failing)
    with pytest.raises(GenerationError) as err:
        generate(model, PROMPTS, drafter=d, tree=TREE, max_new_tokens=30, eos_token_id=[])
    got = err.value.output
    assert got.num_steps == 2
    for b in range(len(PROMPTS)):
        n = 1 + sum(full.accept_lengths[b][:2])
        assert got.sequences[b] == full.sequences[b][:n]
