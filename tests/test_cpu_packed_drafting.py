"""Drafting through the packed CPU kernel (hydra_kernels/drafters/cpu_packed.py).

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
from hydra_kernels.drafters.cpu_packed import PackedDraftHeads, packed_draft_heads
from hydra_kernels.generate import generate
from hydra_kernels.model.packed_linear import packed_kernel_off, packed_linear_available
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


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
@pytest.mark.parametrize("lm_head", ["tied", "per_head"])
@pytest.mark.parametrize("B", [1, 3])
def test_packed_draft_equals_reference_draft(packed_model, kind, lm_head, B):
    model = packed_model
    d = drafter_for(model, kind, lm_head)
    tree = hk.tree.default_tree(15, depth=3)
    g = torch.Generator().manual_seed(B)
    h = torch.randn(B, model.config.hidden_size, generator=g)
    root = torch.randint(0, model.config.vocab_size, (B,), generator=g)
    with torch.no_grad():
        assert packed_draft_heads(d, model, h, "auto", rows=B * 4) is not None
        ref = d.draft(model, h, root, tree, backend="reference")
        got = d.draft(model, h, root, tree)  # auto on a packed CPU model: the packed path
        assert torch.equal(got, ref)
        if kind == "medusa":
            assert torch.equal(d.medusa_candidates(model, h, tree), d.medusa_candidates(model, h, tree, backend="reference"))


def test_packed_heads_compute_the_head_logits(packed_model):
    """Head outputs and logits of the packed path against Drafter.logits, to fp32 accuracy."""
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    packed = PackedDraftHeads(d, model)
    H = model.config.hidden_size
    x = torch.randn(5, 3 * H, generator=torch.Generator().manual_seed(0))  # head 1's input: h, E(root), E(x1)
    with torch.no_grad():
        ref = d.logits(model, 1, x)
        got = packed.lm[1](packed.run_blocks(1, x))
    assert_close_rel(got, ref, RTOL[torch.float32], "packed head 1 logits")


def test_packed_heads_follow_weight_changes(packed_model):
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    tree = hk.tree.default_tree(10, depth=3)
    h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    root = torch.tensor([4, 9])
    with torch.no_grad():
        d.draft(model, h, root, tree)
        first = d.__dict__["_cpu_packed"][1]
        d.draft(model, h, root, tree)
        assert d.__dict__["_cpu_packed"][1] is first  # unchanged weights: packed once
        randomise(d.heads[0], 9)
        to_bf16_values(d.heads[0])  # in-place change of head 0's weights
        assert torch.equal(d.draft(model, h, root, tree), d.draft(model, h, root, tree, backend="reference"))
        assert d.__dict__["_cpu_packed"][1] is not first


def test_packed_path_only_where_it_applies(packed_model):
    model = packed_model
    d = drafter_for(model, "hydra", "tied")
    h = torch.randn(2, model.config.hidden_size)
    with torch.no_grad():
        assert packed_draft_heads(d, model, h, "native", rows=8) is not None
        assert packed_draft_heads(d, model, h, "reference", rows=8) is None
        assert packed_draft_heads(d, model, h, "triton", rows=8) is None
        assert packed_draft_heads(d, model, h, "auto", rows=65) is None  # beyond the small-M kernel's rows
        assert packed_draft_heads(d, model, h.double(), "auto", rows=8) is None
    with torch.enable_grad():
        assert packed_draft_heads(d, model, h, "auto", rows=8) is None
    with torch.no_grad(), packed_kernel_off(model):  # the model steps on F.linear: drafting does too
        assert packed_draft_heads(d, model, h, "auto", rows=8) is None


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_generate_through_packed_drafting_is_lossless(packed_model, kind):
    model = packed_model
    d = drafter_for(model, kind, "tied", seed=2)
    prompts = [[5, 9, 2, 44, 7], [3, 1]]
    plain = generate(model, prompts, max_new_tokens=20)
    spec = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(15, depth=3), max_new_tokens=20)
    assert spec.sequences == plain.sequences
    assert "_cpu_packed" in d.__dict__  # the packed path drafted


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
                           d2.draft(model, h, torch.tensor([1]), tree, backend="reference"))
