"""commit_kv on every backend (reference, Triton, native) against a row-by-row copy: overlapping sources
and destinations, int32 / int64 indices, fp32 / bf16 caches, and accept indices from per-sequence trees
(each sequence its own tree's accepted path)."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, planted, random_tree_batch

pytestmark = pytest.mark.backends("reference", "triton", "native", op="commit_kv")


def row_by_row(kv, seqlens, idx, lens):
    """The expected cache: for each sequence, the accepted rows gathered first, then written in order."""
    expected = kv.clone()
    for b in range(kv.shape[2]):
        s = int(seqlens[b])
        src = [kv[:, :, b, s + int(idx[b, i])].clone() for i in range(int(lens[b]))]
        for i, row in enumerate(src):
            expected[:, :, b, s + i] = row
    return expected


def root_paths(gen, B, K1, T):
    """(accept_indices [B, K1], accept_lengths [B]): a root path per sequence: 0 first, then increasing
    node ids (each >= its position: sources overlap destinations), -1 after the length."""
    lens = torch.randint(1, K1 + 1, (B,), generator=gen)
    idx = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):
        picks = sorted(torch.randperm(T - 1, generator=gen)[: lens[b] - 1].add(1).tolist())
        idx[b, : lens[b]] = torch.tensor([0] + picks)
    return idx, lens


@pytest.mark.parametrize("B,K1,lens", [(1, 1, [1]), (1, 5, [5]), (3, 4, [1, 4, 2]), (4, 6, [6, 3, 1, 5])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_commit_kv_matches_row_by_row_copy(backend, B, K1, lens, index_dtype):
    gen = torch.Generator().manual_seed(B * 10 + K1)
    T, S = 12, 40
    kv = torch.randn(3, 2, B, S, 2, 8, generator=gen)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(torch.int32)
    idx = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):
        picks = sorted(torch.randperm(T - 1, generator=gen)[: lens[b] - 1].add(1).tolist())
        idx[b, : lens[b]] = torch.tensor([0] + picks)
    expected = row_by_row(kv, seqlens, idx, lens)
    kv = kv.to(DEV)
    hk.ops.commit_kv(kv, seqlens.to(DEV), idx.to(DEV, index_dtype), torch.tensor(lens, dtype=index_dtype, device=DEV),
                     backend=backend)
    assert torch.equal(kv.cpu(), expected)


@pytest.mark.parametrize("B,K1,T,row", [(1, 1, 1, (3, 16)), (1, 6, 64, (3, 64)), (3, 5, 70, (1, 128)),
                                        (2, 9, 33, (9, 64)), (5, 8, 100, (3, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_commit_kv_equals_reference(backend, B, K1, T, row, dtype, index_dtype):
    gen = torch.Generator().manual_seed(B + K1 + T)
    S = T + 20
    kv = torch.randn(2, 2, B, S, *row, generator=gen).to(DEV, dtype)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(DEV, torch.int32)
    idx, lens = root_paths(gen, B, K1, T)
    ref = kv.clone()
    reference.commit_kv(ref, seqlens, idx.to(DEV), lens.to(DEV))
    hk.ops.commit_kv(kv, seqlens, idx.to(DEV, index_dtype), lens.to(DEV, index_dtype), backend=backend)
    assert torch.equal(kv, ref)


def test_commit_kv_arbitrary_overlap(backend):
    """Indices in any order, pointing at rows other entries write: every source is read first."""
    kv = torch.arange(1 * 2 * 1 * 10 * 1 * 2, dtype=torch.float32).reshape(1, 2, 1, 10, 1, 2)
    idx, lens, s = torch.tensor([[3, 0, 1, 2]]), torch.tensor([4]), torch.tensor([2], dtype=torch.int32)
    expected = row_by_row(kv, s, idx, lens)
    kv = kv.to(DEV)
    hk.ops.commit_kv(kv, s.to(DEV), idx.to(DEV), lens.to(DEV), backend=backend)
    assert torch.equal(kv.cpu(), expected)


@pytest.mark.parametrize("seed,sizes", [(0, [1, 9, 4]), (1, [20, 2, 11, 6]), (2, [7])])
def test_commit_kv_after_per_sequence_trees(backend, seed, sizes):
    """A step with a tree per sequence: greedy_verify's accept indices (each its own tree's path, padded
    to the longest tree's depth) move exactly each sequence's accepted rows."""
    gen = torch.Generator().manual_seed(300 + seed)
    _, batch = random_tree_batch(gen, sizes)
    B, T = batch.parents.shape
    target, tokens = planted(gen, B, batch.parents, V=2, p_accept=0.8)
    v = hk.ops.greedy_verify(target, tokens, batch.paths, backend="reference")
    assert v.accept_lengths.max() >= 2
    S = T + 30
    kv = torch.randn(2, 2, B, S, 2, 16, generator=gen)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(torch.int32)
    expected = row_by_row(kv, seqlens, v.accept_indices, v.accept_lengths)
    kv = kv.to(DEV)
    hk.ops.commit_kv(kv, seqlens.to(DEV), v.accept_indices.to(DEV), v.accept_lengths.to(DEV), backend=backend)
    assert torch.equal(kv.cpu(), expected)


def test_commit_kv_bad_inputs():
    kv = torch.zeros(1, 2, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="accept_indices must be"):
        hk.ops.commit_kv(kv, torch.zeros(2, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.long),
                         torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="int32 or int64"):
        hk.ops.commit_kv(kv, torch.zeros(2), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long))


@pytest.mark.backends("native")
def test_commit_kv_native_errors_are_clear(backend):
    ops = torch.ops.hydra_kernels
    with pytest.raises(RuntimeError, match="kv_cache must be contiguous"):
        ops.commit_kv(torch.zeros(1, 2, 2, 8, 2, 4).transpose(4, 5), torch.zeros(2, dtype=torch.int32),
                      torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ops.commit_kv(torch.zeros(1, 2, 2, 8, 1, 4), torch.zeros(2), torch.zeros(2, 1, dtype=torch.long),
                      torch.ones(2, dtype=torch.long))
