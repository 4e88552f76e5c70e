"""Op preconditions are the same on every backend (issue 25, defect 10): the public op checks them once,
before dispatch, so reference, Triton and native refuse the same bad calls with the same message."""
import pytest
import torch

import hydra_kernels as hk

B, T, S, Hq, Hkv, D = 2, 3, 8, 4, 2, 16


def attn_inputs(seqlens):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, Hq, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    mask = torch.ones(T, T, dtype=torch.bool).tril_()
    return q, k, v, torch.tensor(seqlens, dtype=torch.int32), mask


@pytest.mark.backends("reference", "triton", "native", op="tree_attention")
@pytest.mark.parametrize("seqlens,msg", [
    ([-1, 2], r"cache_seqlens\[0\] = -1"),  # reference: NaN; Triton: garbage
    ([2, S - T + 1], rf"cache_seqlens\[1\] = {S - T + 1}"),  # the tree's rows run past the buffer
])
def test_tree_attention_refuses_rows_outside_the_cache(backend, seqlens, msg):
    with pytest.raises(ValueError, match=msg):
        hk.ops.tree_attention(*attn_inputs(seqlens), backend=backend)


@pytest.mark.backends("reference", "triton", "native", op="tree_attention")
def test_tree_attention_accepts_the_last_rows(backend):
    out = hk.ops.tree_attention(*attn_inputs([0, S - T]), backend=backend)
    assert out.shape == (B, T, Hq, D) and out.isfinite().all()


def commit_inputs(seqlens, indices, lengths):
    kv = torch.randn(2, 2, B, S, Hkv, D, generator=torch.Generator().manual_seed(1))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return kv, i32(seqlens), i32(indices), i32(lengths)


@pytest.mark.backends("reference", "triton", "native", op="commit_kv")
@pytest.mark.parametrize("seqlens,indices,lengths,msg", [
    ([-1, 0], [[0, 1], [0, 1]], [1, 1], "cache_seqlens \\+ accept_lengths must lie in"),
    ([S - 1, 0], [[0, 1], [0, 1]], [2, 1], "cache_seqlens \\+ accept_lengths must lie in"),  # writes past S_max
    ([0, 0], [[0, 1], [0, 1]], [3, 1], r"accept_lengths must lie in \[0, K\+1 = 2\]"),
    ([0, 0], [[0, 1], [0, 1]], [-1, 1], r"accept_lengths must lie in \[0, K\+1 = 2\]"),
    ([0, 0], [[0, -1], [0, 1]], [2, 1], "accept_indices name a row outside"),
    ([4, 0], [[0, 4], [0, 1]], [2, 1], "accept_indices name a row outside"),  # reads past S_max
])
def test_commit_kv_refuses_rows_outside_the_cache(backend, seqlens, indices, lengths, msg):
    kv, s, i, n = commit_inputs(seqlens, indices, lengths)
    before = kv.clone()
    with pytest.raises(ValueError, match=msg):
        hk.ops.commit_kv(kv, s, i, n, backend=backend)
    assert torch.equal(kv, before)  # refused before anything was written


@pytest.mark.backends("reference", "triton", "native", op="commit_kv")
def test_commit_kv_ignores_indices_past_the_accepted_length(backend):
    kv, s, i, n = commit_inputs([S - 2, 0], [[1, 99], [0, -1]], [1, 1])  # unused entries may hold anything
    expected = kv.clone()
    hk.ops.reference.commit_kv(expected, s, i, n)
    hk.ops.commit_kv(kv, s, i, n, backend=backend)
    assert torch.equal(kv, expected)


@pytest.mark.requires("native", op="commit_kv")
def test_native_commit_kv_row_limit_is_checked_by_the_op():
    kv, s, i, n = commit_inputs([0, 0], [list(range(33))] * 2, [1, 1])
    kv = torch.randn(2, 2, B, 40, Hkv, D)
    with pytest.raises(ValueError, match="native commit_kv moves at most 32 rows"):
        hk.ops.commit_kv(kv, s, i, n, backend="native")
    hk.ops.commit_kv(kv, s, i, n, backend="reference")  # the reference has no such limit


@pytest.mark.backends("reference", "native", op="tree_inputs")
def test_tree_inputs_refuses_a_source_outside_the_candidates(backend):
    root, cand = torch.tensor([1, 2]), torch.tensor([[5, 6, 7], [8, 9, 10]])
    depths, seqlens = torch.tensor([0, 1, 1]), torch.tensor([3, 4], dtype=torch.int32)
    for bad in ([0, 1, 3], [0, -1, 1]):  # reference: an index error, or a silent wrap for -1
        with pytest.raises(ValueError, match="node_source must index candidates"):
            hk.ops.tree_inputs(root, cand, torch.tensor(bad), depths, seqlens, backend=backend)
