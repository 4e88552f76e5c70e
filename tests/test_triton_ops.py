"""Triton kernels against the reference ops (CPU tier: TRITON_INTERPRET=1, set in conftest.py)."""
import os

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from test_tree import random_choices
from test_verify_commit_reference import planted

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("seed,B,n_nodes", [(0, 1, 0), (1, 1, 5), (2, 3, 20), (3, 4, 70), (4, 2, 100)])
def test_greedy_verify_triton_equals_reference(seed, B, n_nodes):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=n_nodes, depth=5)) if n_nodes else hk.Tree([])
    target, tokens = planted(gen, B, tree, V=4)
    out = hk.ops.greedy_verify(target, tokens, tree.paths, backend="triton")
    ref = hk.ops.greedy_verify(target, tokens, tree.paths, backend="reference")
    for x, y, name in zip(out, ref, out._fields):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("B,K1,T,row", [(1, 1, 1, (3, 16)), (1, 6, 64, (3, 64)), (3, 5, 70, (1, 128)), (2, 9, 33, (9, 64))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_kv_triton_equals_reference(B, K1, T, row, dtype):
    gen = torch.Generator().manual_seed(B + K1 + T)
    S = T + 20
    kv = torch.randn(2, 2, B, S, *row, generator=gen).to(dtype)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(torch.int32)
    lens = torch.randint(1, K1 + 1, (B,), generator=gen)
    idx = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):  # root path: 0, then increasing node ids -> sources overlap destinations
        idx[b, : lens[b]] = torch.tensor([0] + sorted(torch.randperm(T - 1, generator=gen)[: lens[b] - 1].add(1).tolist()))
    ref = kv.clone()
    reference.commit_kv(ref, seqlens, idx, lens)
    hk.ops.commit_kv(kv, seqlens, idx.to(torch.int32), lens, backend="triton")
    assert torch.equal(kv, ref)


def test_commit_kv_triton_arbitrary_overlap():
    kv = torch.arange(2 * 1 * 10 * 1 * 2, dtype=torch.float32).reshape(1, 2, 1, 10, 1, 2)
    ref = kv.clone()
    idx, lens, s = torch.tensor([[3, 0, 1, 2]]), torch.tensor([4]), torch.tensor([2], dtype=torch.int32)
    reference.commit_kv(ref, s, idx, lens)
    hk.ops.commit_kv(kv, s, idx, lens, backend="triton")
    assert torch.equal(kv, ref)


def test_generate_with_triton_backend_is_lossless():
    """backend="triton" runs commit_kv and greedy_verify as Triton kernels (the other ops fall back)."""
    from hydra_kernels.generate import generate
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    plain = generate(model, prompts, max_new_tokens=20, eos_token_id=[], backend="reference").sequences
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind="medusa", num_heads=4)
    out = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(24), max_new_tokens=20, eos_token_id=[],
                   backend="triton")
    assert out.sequences == plain and out.mean_accepted_tokens > 1
