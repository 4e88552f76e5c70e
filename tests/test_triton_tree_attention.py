"""Triton tree attention against the fp32 reference (CPU tier: TRITON_INTERPRET=1).

Inputs are fresh random values, the output buffer is poisoned (NaN) before the run, tolerances come
from the dtype (helpers.RTOL). Shapes cover T = 1, odd T, T = 128, GQA ratios 1/3/4/8, head_dim 64 and
128, batch 1 and 3 with different seqlens (0 included), several prefix splits, strided caches.
"""
import os

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import RTOL, assert_close_rel, random_parents, tree_from_parents

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed, B, T, Hq, Hkv, D, seqlens, dtype, S=None, strided=False):
    gen = torch.Generator().manual_seed(seed)
    mask, _ = tree_from_parents(random_parents(T, gen))
    S = S or max(seqlens) + T + 3
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    if strided:  # K and V as row-limited views into one buffer, as the model's KV cache hands them out
        kv = torch.randn(B, 2, S + 7, Hkv, D, generator=gen).to(dtype)
        k, v = kv[:, 0, :S], kv[:, 1, :S]
        q = torch.randn(B, Hq, T, D, generator=gen).to(dtype).transpose(1, 2)  # non-contiguous q too
    else:
        k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    return [x.to(DEV) for x in (q, k, v, sl, mask)]


CASES = [  # seed, B, T, Hq, Hkv, D, seqlens
    (0, 1, 1, 3, 1, 64, [37]),  # plain decode, GQA 3 (SmolLM2's ratio)
    (1, 3, 7, 8, 2, 128, [0, 50, 129]),  # odd T, GQA 4, empty prefix in one sequence
    (2, 2, 33, 8, 1, 64, [5, 70]),  # GQA 8: M = 264 rows, several M tiles
    (3, 1, 128, 4, 4, 64, [20]),  # T = 128, no GQA
    (4, 3, 16, 9, 3, 64, [3, 96, 41]),  # SmolLM2 heads, batch 3
    (5, 2, 3, 6, 2, 40, [9, 1]),  # head_dim not a power of two (padded tiles)
]


@pytest.mark.parametrize("seed,B,T,Hq,Hkv,D,seqlens", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tree_attention_triton_equals_reference(seed, B, T, Hq, Hkv, D, seqlens, dtype):
    q, k, v, sl, mask = _case(seed, B, T, Hq, Hkv, D, seqlens, dtype)
    ref = reference.tree_attention(q.float(), k.float(), v.float(), sl, mask)
    out = hk.ops.tree_attention(q, k, v, sl, mask, backend="triton")
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_rel(out.float(), ref, RTOL[dtype], f"tree_attention {dtype}")


@pytest.mark.parametrize("split_size", [32, 64])
def test_tree_attention_triton_many_splits_and_strided_cache(split_size):
    from hydra_kernels.ops.triton.tree_attention import tree_attention

    q, k, v, sl, mask = _case(7, 3, 5, 6, 2, 64, [0, 31, 200], torch.float32, S=260, strided=True)
    assert not k.is_contiguous() and not q.is_contiguous()
    ref = reference.tree_attention(q, k, v, sl, mask)
    out = tree_attention(q, k, v, sl, mask, split_size=split_size)  # 9 or 5 prefix splits, some empty
    assert_close_rel(out, ref, RTOL[torch.float32], "split tree_attention")


def test_tree_attention_triton_sm_scale_and_ignored_rows():
    """Rows beyond seqlen + T and tree rows outside the mask must not leak in: poison them."""
    q, k, v, sl, mask = _case(8, 2, 6, 4, 2, 64, [10, 3], torch.float32, S=30)
    for b, s in enumerate(sl.tolist()):
        k[b, s + 6:] = float("nan")
        v[b, s + 6:] = float("nan")
    out = hk.ops.tree_attention(q, k, v, sl, mask, sm_scale=0.05, backend="triton")
    k0, v0 = torch.nan_to_num(k), torch.nan_to_num(v)
    ref = reference.tree_attention(q, k0, v0, sl, mask, sm_scale=0.05)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, RTOL[torch.float32], "sm_scale")


def test_pack_tree_mask_bits():
    from hydra_kernels.ops.triton.tree_attention import pack_tree_mask

    gen = torch.Generator().manual_seed(3)
    m = torch.rand(70, 70, generator=gen) < 0.5
    bits = pack_tree_mask(m)
    assert bits.shape == (70, 3) and bits.dtype == torch.int32
    j = torch.arange(70)
    unpacked = ((bits[:, j // 32].long() >> (j % 32)) & 1).bool()
    assert torch.equal(unpacked, m)
