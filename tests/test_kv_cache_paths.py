"""The cached entry points (prefill, step with T = 1, chains and trees) equal the full forward."""
import pytest
import torch

import hydra_kernels as hk
from helpers import DEV, assert_close_rel, random_parents, tree_from_parents
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module", params=["gqa3-tied", "mha-untied", "gqa4-llama3-rope"])
def model(request):
    return hk.Llama.from_hf(make_hf(request.param, seed=7)).to(DEV)  # the GPU tier runs these on CUDA


def ids(B, L, seed):
    return torch.randint(0, 101, (B, L), generator=torch.Generator().manual_seed(seed)).to(DEV)


def test_prefill_then_single_token_steps_equal_full_forward(model):
    x = ids(2, 30, 0)
    full = model(x)
    P = 11
    cache = model.new_kv_cache(2, 40)
    h = model.prefill(x[:, :P], torch.tensor([P, P], dtype=torch.int32, device=DEV), cache, all_hidden=True)
    assert_close_rel(model.output(h), full[:, :P], 1e-4, "prefill")
    for t in range(P, 30):
        h = model.step(x[:, t : t + 1], cache)
        cache.advance(1)
        assert_close_rel(model.output(h)[:, 0], full[:, t], 1e-4, f"step at position {t}")
    assert cache.seqlens.tolist() == [30, 30]


def test_chain_step_equals_full_forward(model):
    """T tokens in one step with the default causal tree mask (a chain) = the full forward."""
    x = ids(1, 25, 1)
    full = model(x)
    cache = model.new_kv_cache(1, 32)
    model.prefill(x[:, :9], torch.tensor([9], dtype=torch.int32, device=DEV), cache)
    h = model.step(x[:, 9:], cache, kv_len=25)
    assert_close_rel(model.output(h), full[:, 9:], 1e-4, "chain step")


@pytest.mark.parametrize("T", [1, 2, 7, 16])
def test_tree_step_node_equals_full_forward_on_its_path(model, T):
    """Node i of a random tree sees prefix + its ancestors: its logits equal a full forward over
    prefix + the path to i (tokens at positions L + depth)."""
    gen = torch.Generator().manual_seed(T)
    parents = random_parents(T, gen)
    mask, depths = (t.to(DEV) for t in tree_from_parents(parents))
    B, lens = 3, [5, 12, 8]
    prompts = [ids(1, n, 10 + b)[0] for b, n in enumerate(lens)]
    tree_tokens = ids(B, T, 20 + T)
    cache = model.new_kv_cache(B, max(lens) + T + 2)
    padded = torch.zeros(B, max(lens), dtype=torch.long, device=DEV)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    model.prefill(padded, torch.tensor(lens, dtype=torch.int32, device=DEV), cache)
    logits = model.output(model.step(tree_tokens, cache, mask, depths))
    for b in range(B):
        for i in range(T):
            path = [j for j in range(T) if mask[i, j]]  # ancestors in BFS order = root .. i
            seq = torch.cat([prompts[b], tree_tokens[b, path]])[None]
            assert_close_rel(logits[b, i], model(seq)[0, -1], 1e-4, f"seq {b} node {i}")


def test_ragged_prefill_equals_each_sequence_alone(model):
    lens = [3, 17, 9]
    prompts = [ids(1, n, 30 + b)[0] for b, n in enumerate(lens)]
    padded = torch.full((3, 17), 55, dtype=torch.long, device=DEV)  # non-zero padding: it must not matter
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    cache = model.new_kv_cache(3, 24)
    last = model.output(model.prefill(padded, torch.tensor(lens, dtype=torch.int32, device=DEV), cache))
    for b, p in enumerate(prompts):
        assert_close_rel(last[b], model(p[None])[0, -1], 1e-4, f"sequence {b}")
    assert cache.seqlens.tolist() == lens


def prefilled(model, lens, extra, seed):
    """(cache, prompts) after a ragged prefill of random prompts of the given lengths."""
    prompts = [ids(1, n, seed + b)[0] for b, n in enumerate(lens)]
    padded = torch.full((len(lens), max(lens)), 7, dtype=torch.long, device=DEV)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    cache = model.new_kv_cache(len(lens), max(lens) + extra)
    model.prefill(padded, torch.tensor(lens, dtype=torch.int32, device=DEV), cache)
    return cache, prompts


def test_per_sequence_depths_equal_each_sequence_alone(model):
    """depths [B, T]: sequence b's nodes sit at seqlens[b] + depths[b] (its own rope positions), the
    same as running sequence b alone with depths[b]; explicit positions give the same again."""
    T = 6
    mask = tree_from_parents([-1, 0, 0, 1, 1, 2])[0].to(DEV)
    # the second row: positions only, not a tree
    depths = torch.tensor([[0, 1, 1, 2, 2, 2], [0, 2, 1, 3, 5, 4]], device=DEV)
    lens = [9, 4]
    tokens = ids(2, T, 40)
    cache, prompts = prefilled(model, lens, T + 1, 41)
    h = model.step(tokens, cache, mask, depths, backends="reference")
    pos = cache.seqlens.long()[:, None] + depths
    assert torch.equal(model.step(tokens, cache, mask, positions=pos, backends="reference"), h)
    for b in range(2):
        alone, _ = prefilled(model, [lens[b]], T + 1, 41 + b)
        ref = model.step(tokens[b:b + 1], alone, mask, depths[b], backends="reference")
        assert_close_rel(h[b], ref[0], 1e-4, f"sequence {b} alone")
    with pytest.raises(ValueError, match="depths must be"):
        model.step(tokens, cache, mask, depths[:, :-1])


def test_per_sequence_mask_of_one_tree_equals_shared_mask(model):
    """tree_mask [B, T, T] holding the same tree for every sequence = the shared [T, T] mask."""
    T = 7
    mask, depths = (t.to(DEV) for t in tree_from_parents(random_parents(T, torch.Generator().manual_seed(3))))
    tokens = ids(3, T, 50)
    cache, _ = prefilled(model, [5, 12, 8], T + 1, 51)
    for backend in ("reference", "auto"):
        shared = model.step(tokens, cache, mask, depths, backends=backend)
        per_seq = model.step(tokens, cache, mask.expand(3, T, T).clone(), depths.expand(3, T).clone(), backends=backend)
        assert_close_rel(per_seq, shared, 1e-5, f"[B, T, T] mask of one tree, {backend}")


def test_backend_plan_name_and_default_agree(model):
    """step and greedy_tokens take a BackendPlan, a backend name or None (resolved on the model)."""
    T = 3
    tokens = ids(2, T, 60)
    cache, _ = prefilled(model, [6, 3], T + 1, 61)
    plan = model.backend_plan("reference")
    assert isinstance(plan, hk.ops.backend.BackendPlan) and model.backend_plan(plan) is plan
    h = model.step(tokens, cache, backends=plan)
    assert torch.equal(model.step(tokens, cache, backends="reference"), h)
    assert_close_rel(model.step(tokens, cache), h, 1e-5, "auto backend")
    want = model.output(h).argmax(-1)
    for backends in (None, "reference", "auto", plan):
        assert torch.equal(model.greedy_tokens(h, backends), want), backends
    assert model.backend_plan().packed_linear == model.has_packed_weights
