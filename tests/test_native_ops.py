"""The compiled extension's CPU kernels against the reference ops (CI builds hydra_kernels._C)."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.ops import reference
from test_tree import random_choices
from test_verify_commit_reference import planted

pytestmark = pytest.mark.skipif(not hk.ops.native_available(), reason="hydra_kernels._C is not built")


def test_extension_is_built_here():
    """`make test` installs the package with its extension: on this machine it must be there."""
    import hydra_kernels._C  # noqa: F401

    assert hasattr(torch.ops.hydra_kernels, "commit_kv")


def tree_for(seed, n):
    gen = torch.Generator().manual_seed(seed)
    return gen, hk.Tree(random_choices(gen, n=n, depth=5))


@pytest.mark.parametrize("seed,B,n_nodes", [(0, 1, 0), (1, 1, 5), (2, 3, 20), (3, 4, 70), (4, 2, 100)])
def test_greedy_verify_native_equals_reference(seed, B, n_nodes):
    gen, tree = tree_for(seed, max(n_nodes, 1)) if n_nodes else (torch.Generator().manual_seed(0), hk.Tree([]))
    target, tokens = planted(gen, B, tree, V=4)
    a = hk.ops.greedy_verify(target, tokens, tree.paths, backend="native")
    b = hk.ops.greedy_verify(target, tokens, tree.paths, backend="reference")
    for x, y, name in zip(a, b, a._fields):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("B,K1,T", [(1, 1, 1), (1, 6, 64), (3, 5, 70), (5, 8, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_commit_kv_native_equals_reference(B, K1, T, dtype, index_dtype):
    gen = torch.Generator().manual_seed(B + K1 + T)
    S = T + 40
    kv = torch.randn(2, 2, B, S, 3, 16, generator=gen).to(dtype)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(torch.int32)
    lens = torch.randint(1, K1 + 1, (B,), generator=gen)
    idx = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):  # a root path: 0 first, then increasing node ids (overlapping rows)
        idx[b, : lens[b]] = torch.tensor([0] + sorted(torch.randperm(T - 1, generator=gen)[: lens[b] - 1].add(1).tolist()))
    ref = kv.clone()
    reference.commit_kv(ref, seqlens, idx, lens)
    hk.ops.commit_kv(kv, seqlens, idx.to(index_dtype), lens.to(index_dtype), backend="native")
    assert torch.equal(kv, ref)


def test_commit_kv_native_handles_arbitrary_overlap():
    """Indices in any order, pointing at rows other entries write: every source is read first."""
    kv = torch.arange(1 * 2 * 1 * 10 * 1 * 2, dtype=torch.float32).reshape(1, 2, 1, 10, 1, 2)
    ref = kv.clone()
    idx, lens, s = torch.tensor([[3, 0, 1, 2]]), torch.tensor([4]), torch.tensor([2], dtype=torch.int32)
    reference.commit_kv(ref, s, idx, lens)
    hk.ops.commit_kv(kv, s, idx, lens, backend="native")
    assert torch.equal(kv, ref)


@pytest.mark.parametrize("B,n_nodes", [(1, 0), (2, 10), (3, 63)])
def test_tree_inputs_native_equals_reference(B, n_nodes):
    tree = hk.tree.default_tree(n_nodes + 1, depth=4) if n_nodes else hk.Tree([])
    gen = torch.Generator().manual_seed(n_nodes)
    C = int(tree.flat_source.max()) + 1
    root = torch.randint(0, 1000, (B,), generator=gen)
    cand = torch.randint(0, 1000, (B, C), generator=gen)
    seqlens = torch.randint(0, 50, (B,), generator=gen).to(torch.int32)
    a = hk.ops.tree_inputs(root, cand, tree.flat_source, tree.depths, seqlens, backend="native")
    b = hk.ops.tree_inputs(root, cand, tree.flat_source, tree.depths, seqlens, backend="reference")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_native_errors_are_clear():
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous"):
        torch.ops.hydra_kernels.commit_kv(torch.zeros(1, 2, 2, 8, 2, 4).transpose(4, 5), torch.zeros(2, dtype=torch.int32),
                                          torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        torch.ops.hydra_kernels.commit_kv(torch.zeros(1, 2, 2, 8, 1, 4), torch.zeros(2), torch.zeros(2, 1, dtype=torch.long),
                                          torch.ones(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="paths must be int64"):
        torch.ops.hydra_kernels.greedy_verify(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                                              torch.zeros(2, 2, dtype=torch.int32))


def test_generate_with_native_backend_is_lossless():
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    plain = generate(model, prompts, max_new_tokens=30, eos_token_id=[], backend="reference").sequences
    for kind in ("medusa", "hydra"):
        torch.manual_seed(0)
        d = hk.new_drafter(model, kind=kind, num_heads=4)
        out = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(24), max_new_tokens=30, eos_token_id=[],
                       backend="native")
        assert out.sequences == plain, kind


def test_native_ops_trace_under_torch_compile_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.hydra_kernels.greedy_verify(torch.empty(2, 5, dtype=torch.long), torch.empty(2, 5, dtype=torch.long),
                                                    torch.empty(3, 4, dtype=torch.long))
        assert [tuple(t.shape) for t in out] == [(2,), (2, 4), (2,), (2,)]
