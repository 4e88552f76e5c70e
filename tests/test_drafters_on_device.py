"""Every drafter family end to end on the test device (helpers.DEV: the GPU tier's CUDA, else the CPU).

The op tests check each kernel against the reference on the GPU; this checks what a user runs there:
generate() with each kind of drafter on a model that lives on the device, its kernels chosen by the planner
("auto": compiled Triton / the CUDA extension on a GPU), against plain greedy decoding on the same device.
- greedy: every kind (medusa, hydra, hydra++, EAGLE-1, EAGLE-3 with a draft vocabulary, MLPSpeculator,
  Amphista, n-gram, lookahead, combined n-gram + Hydra) emits exactly plain greedy's tokens, ragged prompts
  in one batch, a per-sequence dynamic tree (EAGLE) and static trees, in float32 and (on a GPU) bfloat16;
- sampling: rejection sampling over Hydra's tree on the device draws the next 3 tokens from the exact base
  law (test_sampling_exactness's enumerable model and G-test), and the same harness refuses typical
  acceptance (the negative control), so the check has power on the device too.
Head drafters (Medusa, Hydra, Hydra++, the combined drafter's) are fresh (their tied LM head proposes what this
small model often repeats: long accepted paths), the others carry random weights; every kind but MLPSpeculator
must get drafts accepted (checked).
"""
from __future__ import annotations

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from helpers import DEV
from test_budget import randomised  # random weights in place, norms near 1 (copy_ casts to the device / dtype)
from test_llama_vs_transformers import make_hf
import test_sampling_exactness as exact

DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
PROMPTS = [[5, 17, 3, 44, 9, 5, 17, 3], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67, 60, 61, 62], [7]]
NEW = 24
HEAD_TREE = hk.tree.default_tree(12, depth=3)


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).split(".")[-1])
def model(request):
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to(DEV, request.param)


def make(model, kind: str):
    """(drafter, tree argument) of `kind` for the model, on its device and dtype."""
    torch.manual_seed(0)
    vocab = list(range(0, 101, 2))  # a draft vocabulary of every other token
    heads = lambda k: hk.new_drafter(model, kind=k, num_heads=3, num_layers=1)  # noqa: E731 (fresh tied heads)
    if kind in ("medusa", "hydra", "hydra++"):
        return heads(kind), HEAD_TREE
    if kind == "eagle-1":
        return randomised(hk.new_drafter(model, kind="eagle", input_norm=False, final_norm=False), 1), None
    if kind == "eagle-3":
        return randomised(hk.new_drafter(model, kind="eagle", feature_layers="eagle3", draft_vocab=vocab), 2), None
    if kind == "mlp_speculator":
        return randomised(hk.new_drafter(model, kind="mlp_speculator", n_predict=3), 3), None
    if kind == "amphista":
        return randomised(hk.new_drafter(model, kind="amphista", num_heads=3, draft_vocab=vocab), 4), HEAD_TREE
    if kind == "ngram":
        return hk.new_drafter(model, kind="ngram", max_ngram=3, num_tokens=4, num_branches=2), None
    if kind == "lookahead":
        return hk.new_drafter(model, kind="lookahead"), None
    if kind == "combined":
        ng = hk.new_drafter(model, kind="ngram", max_ngram=3, num_tokens=4)
        return hk.new_drafter(model, kind="combined", drafters=[ng, heads("hydra")], node_budget=8), HEAD_TREE
    raise AssertionError(kind)


KINDS = ["medusa", "hydra", "hydra++", "eagle-1", "eagle-3", "mlp_speculator", "amphista", "ngram", "lookahead",
         "combined"]


def test_every_family_is_named():
    """A new family must join this file's list (its device path is otherwise never run on a GPU)."""
    from hydra_kernels.drafters.registry import KINDS as REGISTERED

    assert set(REGISTERED) == {k.split("-")[0] for k in KINDS}


@pytest.fixture(scope="module")
def plain(model):
    return generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain_on_the_device(model, plain, kind):
    drafter, tree = make(model, kind)
    out = generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=[])
    assert out.sequences == plain, f"{kind} on {DEV} ({model.dtype}) differs from plain greedy"
    assert all(sum(a) + 1 == NEW for a in out.accept_lengths)  # the prefill's token, then each step's
    if kind != "mlp_speculator":  # random MLP stages over 101 tokens almost never guess (1.00-1.02 tokens/step
        # on the CPU); its per-sequence trees are the path n-gram and lookahead accept through
        assert out.mean_accepted_tokens > 1, f"{kind}: no draft accepted, so the accept path went untested"


@pytest.fixture(scope="module")
def law_model():
    """test_sampling_exactness's enumerable model (vocabulary 8, one layer) on the CPU in float32 (the exact
    law) and a copy on the device (the samples)."""
    hf = make_hf("gqa3-tied", seed=5, vocab_size=exact.V, num_hidden_layers=1, hidden_size=16, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=24)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    cpu = hk.Llama.from_hf(hf)
    return cpu, hk.Llama.from_hf(hf).to(DEV)


def sampled_p_value(law_model, acceptance: str) -> float:
    cpu, dev = law_model
    torch.manual_seed(2)
    d = hk.new_drafter(dev, kind="hydra", num_heads=3, num_layers=1)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    prompt = exact.PROMPTS[0]
    out = generate(dev, [prompt] * exact.N, drafter=d, tree=exact.TREE, max_new_tokens=exact.NEW, temperature=0.8,
                   seed=0, acceptance=acceptance, eos_token_id=[])
    if acceptance == "rejection":  # the positive setting has power only where drafts are both accepted and rejected
        lens = torch.tensor([a for r in out.accept_lengths for a in r])  # tokens emitted per step: 1 = all rejected
        assert (lens > 1).float().mean() > 0.05 and (lens == 1).float().mean() > 0.05, "acceptance and rejection both needed"
    return exact.g_test(exact.histogram(out.sequences, range(exact.N)), exact.exact_law(cpu, prompt, 0.8, 0, 1.0))


def test_rejection_sampling_is_exact_on_the_device(law_model):
    assert sampled_p_value(law_model, "rejection") > 1e-3


def test_typical_acceptance_is_refused_on_the_device(law_model):
    assert sampled_p_value(law_model, "typical") < exact.NEGATIVE_P
