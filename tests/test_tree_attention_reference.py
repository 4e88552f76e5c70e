"""ops.tree_attention (reference) against a brute-force loop over nodes, heads and allowed keys."""
import math

import pytest
import torch

import hydra_kernels as hk
from helpers import RTOL, assert_close_rel, random_parents, tree_from_parents


def brute_force(q, k, v, seqlens, tree_mask, scale):
    """For each (b, node i, head h): softmax over prefix rows and ancestor rows, computed one by one."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = torch.empty(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(seqlens[b])
        for i in range(T):
            rows = list(range(L)) + [L + j for j in range(T) if tree_mask[i, j]]
            for h in range(Hq):
                kk = k[b, rows, h // G].double()
                vv = v[b, rows, h // G].double()
                s = (kk @ q[b, i, h].double()) * scale
                out[b, i, h] = torch.softmax(s, 0) @ vv
    return out


CASES = [  # B, T, Hq, Hkv, D, seqlens
    (1, 1, 4, 4, 64, [7]),  # plain decode, MHA
    (3, 5, 9, 3, 64, [1, 13, 6]),  # SmolLM2 heads, ragged
    (2, 17, 8, 2, 128, [0, 9]),  # empty prefix, GQA 4
    (1, 33, 8, 1, 64, [21]),  # GQA 8 (MQA-like)
    (3, 1, 6, 6, 128, [5, 1, 30]),  # T == 1, batch 3
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,seqlens", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_brute_force(B, T, Hq, Hkv, D, seqlens, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + Hkv)
    tree_mask, _ = tree_from_parents(random_parents(T, gen))
    S = max(seqlens) + T + 3  # slack rows after the tree hold garbage that must be ignored
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32)
    out = hk.ops.tree_attention(q, k, v, seqlens_t, tree_mask, backend="reference")
    assert out.shape == q.shape and out.dtype == dtype
    ref = brute_force(q, k, v, seqlens_t, tree_mask, 1 / math.sqrt(D))
    assert_close_rel(out, ref, RTOL[dtype], "tree_attention reference")


def test_rows_outside_prefix_and_tree_are_ignored():
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 4, 2, 64
    mask, _ = tree_from_parents([-1, 0, 0, 1])
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, 20, H, D, generator=gen)
    v = torch.randn(B, 20, H, D, generator=gen)
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    a = hk.ops.tree_attention(q, k, v, seqlens, mask)
    k2, v2 = k.clone(), v.clone()
    k2[0, 7:] = 1e4  # rows after sequence 0's tree
    v2[1, 12:] = -1e4  # rows after sequence 1's tree (stale cache rows are finite: zeros or old K/V)
    b = hk.ops.tree_attention(q, k2, v2, seqlens, mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sm_scale_is_used():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 2, 64, generator=gen)
    k = torch.randn(1, 6, 2, 64, generator=gen)
    v = torch.randn(1, 6, 2, 64, generator=gen)
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    s = torch.tensor([4], dtype=torch.int32)
    out = hk.ops.tree_attention(q, k, v, s, mask, sm_scale=0.3)
    assert_close_rel(out, brute_force(q, k, v, s, mask, 0.3), 1e-5, "sm_scale")


@pytest.mark.parametrize("change,msg", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(tree_mask=a["tree_mask"].int()), "tree_mask must be bool"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :2]), "must both be"),
    (lambda a: a.update(q=a["q"][..., :3, :].contiguous(), k_cache=a["k_cache"][:, :, :2].contiguous(),
                        v_cache=a["v_cache"][:, :, :2].contiguous()), "not a multiple"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].float()), "cache_seqlens must be"),
    (lambda a: a.update(q=a["q"].double()), "share a dtype"),
])
def test_bad_inputs_are_named(change, msg):
    gen = torch.Generator().manual_seed(2)
    args = dict(q=torch.randn(2, 3, 4, 64, generator=gen), k_cache=torch.randn(2, 10, 4, 64, generator=gen),
                v_cache=torch.randn(2, 10, 4, 64, generator=gen), cache_seqlens=torch.tensor([2, 5], dtype=torch.int32),
                tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())
    change(args)
    with pytest.raises(ValueError, match=msg):
        hk.ops.tree_attention(**args)


def test_unknown_or_unusable_backend_is_a_clear_error(monkeypatch):
    args = (torch.randn(1, 1, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64),
            torch.tensor([2], dtype=torch.int32), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of"):
        hk.ops.tree_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="no 'native' implementation"):  # resblock: reference and Triton only
        hk.ops.resblock(torch.randn(2, 8), torch.randn(8, 8), torch.randn(8), backend="native")
    monkeypatch.setenv("HYDRA_KERNELS_BACKEND", "reference")
    assert hk.ops.tree_attention(*args).shape == (1, 1, 2, 64)
