"""Drafting through the packed CPU kernel (the draft heads' Linear layers on a packed_linear plan).

The panels hold the head weights rounded to bf16, accumulated in fp32. On heads whose weights are bf16
values already, the packed path therefore computes the definition's logits up to fp32 summation order,
and must draft the same tokens as the ops path (backend="reference", itself tested node by node against
Drafter.logits in test_drafters.py). Also: repacked after a weight changes, used only where it applies,
and speculative decoding through it stays lossless.
"""
import copy

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.model.packed_linear import packed_linear_available
from helpers import RTOL, assert_close_rel
from test_drafters import randomise
from test_llama_vs_transformers import make_hf

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="packed CPU kernel not built or no AVX-512")


def to_bf16_values(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.bfloat16().float())
    return module


@pytest.fixture(scope="module")
def packed_model():
    """A tiny tied Llama whose weights are bf16 values, running its own steps on the packed kernel."""
    model = to_bf16_values(hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)))
    assert model.use_packed_cpu_weights()
    return model


def drafter_for(model, kind, lm_head, seed=1):
    V = model.config.vocab_size
    dv = torch.arange(3, V, 3) if lm_head == "tied" else None  # a draft vocabulary (odd size) on the tied head
    d = hk.new_drafter(model, kind=kind, num_heads=3, num_layers=2, lm_head=lm_head, draft_vocab=dv)
    return to_bf16_values(randomise(d, seed)).eval()


def packed_calls(monkeypatch) -> list:
    """Counts the draft heads' calls of the packed kernel (the heads' Linear layers, and the tied slice's
    panels through fit.TiedLMHead)."""
    import hydra_kernels.drafters.fit as fit
    import hydra_kernels.model.packed_linear as pl

    calls = []
    for mod in (fit, pl):
        real = mod.packed_linear

        def spy(x, packed, n, bias=None, _real=real):
            calls.append(x.shape)
            return _real(x, packed, n, bias)

        monkeypatch.setattr(mod, "packed_linear", spy)
    return calls


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
@pytest.mark.parametrize("lm_head", ["tied", "per_head"])
@pytest.mark.parametrize("B", [1, 3])
def test_packed_draft_equals_reference_draft(packed_model, kind, lm_head, B, monkeypatch):
    model = packed_model
    d = drafter_for(model, kind, lm_head)
    tree = hk.tree.default_tree(15, depth=3)
    g = torch.Generator().manual_seed(B)
    h = torch.randn(B, model.config.hidden_size, generator=g)
    root = torch.randint(0, model.config.vocab_size, (B,), generator=g)
    calls = packed_calls(monkeypatch)
    with torch.no_grad():
        ref = d.draft(model, h, root, tree, "reference")
        assert not calls  # the reference plan never touches the packed kernel
        got = d.draft(model, h, root, tree)  # auto on a packed CPU model: the packed path
        assert calls
        assert torch.equal(got, ref)
        if kind == "medusa":
            assert torch.equal(d.candidates(model, h, tree, model.backend_plan()), d.candidates(model, h, tree, model.backend_plan("reference")))


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_packed_sampled_drafts_equal_reference_sampled_drafts(packed_model, kind, monkeypatch):
    """draft_temperature > 0 on the packed plan: the heads' distributions (the tied draft-vocabulary slice
    on the packed kernel) match the reference plan's, and the same seed draws the same tokens."""
    model = packed_model
    d = drafter_for(model, kind, "tied")
    d.draft_temperature = 0.8
    tree = hk.tree.default_tree(15, depth=3)
    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    root, seqlens = torch.tensor([4, 9, 1]), torch.tensor([5, 5, 5], dtype=torch.int32)
    calls = packed_calls(monkeypatch)

    def propose(backend):
        state = d.start(model, 3, 32, tree, model.backend_plan(backend))
        d.use_generator(state, torch.Generator().manual_seed(7))
        state.h = h
        return d.propose(state, root, seqlens)

    with torch.no_grad():
        ref = propose("reference")
        assert not calls
        got = propose(None)  # auto on a packed CPU model: the packed path
        assert calls
    assert torch.equal(got.tokens, ref.tokens)
    assert_close_rel(got.draft_probs, ref.draft_probs, RTOL[torch.float32], "packed draft distributions")


def test_packed_heads_compute_the_head_logits(packed_model):
    """Head outputs and logits of the packed path against Drafter.logits, to fp32 accuracy."""
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    plan = model.backend_plan()
    d.use_packed_cpu_weights(True)
    H = model.config.hidden_size
    x = torch.randn(5, 3 * H, generator=torch.Generator().manual_seed(0))  # head 1's input: h, E(root), E(x1)
    with torch.no_grad():
        ref = d.logits(model, 1, x)
        hidden = d.heads[1].infer(x, plan)
        from hydra_kernels.drafters.draft_heads import DRAFT_PACK_DTYPE
        from hydra_kernels.ops.packed_linear import pack_linear_weight, packed_linear

        got = packed_linear(hidden, pack_linear_weight(d.tied_lm_weight(model), DRAFT_PACK_DTYPE), ref.shape[-1])
    assert_close_rel(got, ref, RTOL[torch.float32], "packed head 1 logits")


def test_packed_heads_follow_weight_changes(packed_model, monkeypatch):
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    tree = hk.tree.default_tree(10, depth=3)
    h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    root = torch.tensor([4, 9])
    lin = d.heads[0].blocks[0].linear
    with torch.no_grad():
        d.draft(model, h, root, tree)
        first = lin.packed_weight()
        d.draft(model, h, root, tree)
        assert lin.packed_weight() is first  # unchanged weights: packed once
        randomise(d.heads[0], 9)
        to_bf16_values(d.heads[0])  # in-place change of head 0's weights
        assert torch.equal(d.draft(model, h, root, tree), d.draft(model, h, root, tree, "reference"))
        d.draft(model, h, root, tree)
        assert lin.packed_weight() is not first


def test_packed_path_only_where_it_applies(packed_model, monkeypatch):
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    tree = hk.tree.default_tree(10, depth=3)
    root = torch.tensor([4, 9])
    h = torch.randn(2, model.config.hidden_size)
    calls = packed_calls(monkeypatch)

    def drafted_packed(backend, hh=h, r=root, n_rows_ok=True):
        calls.clear()
        d.draft(model, hh, r, tree, backend)
        return bool(calls) and all(s.numel() <= 64 * s[-1] for s in calls)

    with torch.no_grad():
        assert drafted_packed("native") and drafted_packed("auto")
        assert not drafted_packed("reference")
        wide = torch.randn(70, model.config.hidden_size)  # 70 sequences: beyond the small-M kernel's rows
        assert not drafted_packed("auto", wide, torch.ones(70, dtype=torch.long))
    with torch.enable_grad():
        assert not drafted_packed("auto")
    with torch.no_grad():
        assert not drafted_packed(model.backend_plan("auto").__class__("auto", "cpu", model.backend_plan().ops, False))


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_generate_through_packed_drafting_is_lossless(packed_model, kind, monkeypatch):
    model = packed_model
    d = drafter_for(model, kind, "tied", seed=2)
    prompts = [[5, 9, 2, 44, 7], [3, 1]]
    plain = generate(model, prompts, max_new_tokens=20)
    calls = packed_calls(monkeypatch)
    spec = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(15, depth=3), max_new_tokens=20)
    assert spec.sequences == plain.sequences
    assert any(s[-1] == model.config.hidden_size * 2 or s[-1] == model.config.hidden_size for s in calls)


def test_packed_drafter_copies_repack():
    """A deep copy (new storages) never reuses the original's packed panels."""
    model = to_bf16_values(hk.Llama.from_hf(make_hf("gqa3-tied", seed=6)))
    assert model.use_packed_cpu_weights()
    d = drafter_for(model, "hydra", "tied")
    h = torch.randn(1, model.config.hidden_size)
    with torch.no_grad():
        d.draft(model, h, torch.tensor([1]), hk.tree.default_tree(6, depth=2))
        d2 = copy.deepcopy(d)
        d2.heads[1].blocks[0].linear.weight.zero_()
        tree = hk.tree.default_tree(6, depth=2)
        assert torch.equal(d2.draft(model, h, torch.tensor([1]), tree),
                           d2.draft(model, h, torch.tensor([1]), tree, "reference"))


@pytest.mark.parametrize("tie_base", [False, True])
def test_mlp_speculator_drafts_on_the_packed_kernel(packed_model, monkeypatch, tie_base):
    """The MLPSpeculator's stages (proj, head; tie_base: proj, out and the base LM head's draft rows) take
    the packed kernel in a CPU run: on bf16-valued weights it ranks the same candidates as F.linear in fp32,
    and generate() through it stays lossless."""
    import hydra_kernels.model.packed_linear as pl

    model = packed_model
    dv = torch.arange(2, model.config.vocab_size, 3) if tie_base else None
    d = hk.new_drafter(model, kind="mlp_speculator", n_predict=3, top_k_tokens_per_head=[3, 2, 2], n_candidates=5,
                       tie_base=tie_base, draft_vocab=dv)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0.0, 0.3)
    d = to_bf16_values(d).eval()
    h, root = torch.randn(3, model.config.hidden_size), torch.tensor([4, 17, 60])
    with torch.no_grad():
        d.use_packed_cpu_weights(False)
        want, want_scores = d.candidates(h, root, model=model)
        d.use_packed_cpu_weights(True)
        calls = packed_calls(monkeypatch)
        got, got_scores = d.candidates(h, root, model=model)
    assert len(calls) == (9 if tie_base else 6)  # proj and head (tie_base: proj, out, base head) of each stage
    assert torch.equal(got, want)
    assert_close_rel(got_scores, want_scores, RTOL[torch.float32], "candidate scores")
    prompts = [[5, 9, 2, 44, 7], [3, 1]]
    plain = generate(model, prompts, max_new_tokens=20)
    d.use_packed_cpu_weights(False)
    calls.clear()
    assert generate(model, prompts, drafter=d, max_new_tokens=20).sequences == plain.sequences
    assert calls and all(isinstance(m, pl.Linear) and m.packed_on for m in (*d.proj, *(d.out or d.head)))
