"""tree_attention on every backend (reference, Triton, native CPU) against a brute-force fp64 loop and the
fp32 reference: one tree for the batch ([T, T] mask) and a tree per sequence ([B, T, T], trees of
different sizes padded to a common T).

Fresh random inputs, tolerances from the dtype (helpers.RTOL). Shapes cover T = 1, odd T, T = 128, GQA
ratios 1/3/4/8, head_dim 40 / 64 / 128, batch 1 to 4 with different seqlens (0 included), K/V as
row-limited strided views of one buffer and non-contiguous q (as the model hands them over), several
prefix splits (Triton).
"""
import math

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import (DEV, RTOL, assert_close_rel, poison_allocations, random_parents, random_tree_batch,
                     tree_from_parents)

pytestmark = pytest.mark.backends("reference", "triton", "native", op="tree_attention")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def brute_force(q, k, v, seqlens, tree_mask, scale):
    """For each (b, node i): softmax over its prefix rows and ancestor rows, gathered one node at a time,
    in fp64 (all heads at once; query head h reads KV head h // G). tree_mask [T, T] (shared) or [B, T, T]."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    q, k, v, tree_mask = q.cpu().double(), k.cpu().double(), v.cpu().double(), tree_mask.cpu().expand(B, T, T)
    out = torch.empty(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(seqlens[b])
        for i in range(T):
            rows = list(range(L)) + [L + j for j in tree_mask[b, i].nonzero()[:, 0].tolist()]
            kk = k[b, rows].repeat_interleave(G, dim=1)  # [rows, Hq, D]
            vv = v[b, rows].repeat_interleave(G, dim=1)
            s = torch.einsum("rhd,hd->hr", kk, q[b, i]) * scale
            out[b, i] = torch.einsum("hr,rhd->hd", torch.softmax(s, -1), vv)
    return out


def qkv(gen, B, T, Hq, Hkv, D, S, dtype, strided=True):
    """Random q [B, T, Hq, D] and K/V caches [B, S, Hkv, D] on the test device. strided: K and V are
    row-limited views into one buffer (as the model's KV cache hands them out) and q is non-contiguous."""
    if strided:
        kv = torch.randn(2, B, S + 4, Hkv, D, generator=gen).to(DEV, dtype)
        k, v = kv[0, :, :S], kv[1, :, :S]
        q = torch.randn(B, Hq, T, D, generator=gen).to(DEV, dtype).transpose(1, 2)
    else:
        q = torch.randn(B, T, Hq, D, generator=gen).to(DEV, dtype)
        k = torch.randn(B, S, Hkv, D, generator=gen).to(DEV, dtype)
        v = torch.randn(B, S, Hkv, D, generator=gen).to(DEV, dtype)
    return q, k, v


# ---- the reference is the definition -------------------------------------------------------------
REFERENCE_CASES = [  # B, T, Hq, Hkv, D, seqlens
    (1, 1, 4, 4, 64, [7]),  # plain decode, MHA
    (3, 5, 9, 3, 64, [1, 13, 6]),  # SmolLM2 heads, ragged
    (2, 17, 8, 2, 128, [0, 9]),  # empty prefix, GQA 4
    (1, 33, 8, 1, 64, [21]),  # GQA 8 (MQA-like)
    (3, 1, 6, 6, 128, [5, 1, 30]),  # T == 1, batch 3
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,seqlens", REFERENCE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_brute_force(B, T, Hq, Hkv, D, seqlens, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + Hkv)
    tree_mask, _ = tree_from_parents(random_parents(T, gen))
    S = max(seqlens) + T + 3  # slack rows after the tree hold garbage that must be ignored
    q, k, v = qkv(gen, B, T, Hq, Hkv, D, S, dtype, strided=False)
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    out = hk.ops.tree_attention(q, k, v, seqlens_t, tree_mask.to(DEV), backend="reference")
    assert out.shape == q.shape and out.dtype == dtype
    ref = brute_force(q, k, v, seqlens_t, tree_mask, 1 / math.sqrt(D))
    assert_close_rel(out, ref, RTOL[dtype], "tree_attention reference")


# ---- every backend against the reference: one tree for the batch --------------------------------
CASES = [  # seed, B, T, Hq, Hkv, D, seqlens
    (0, 1, 1, 3, 1, 64, [37]),  # plain decode, GQA 3 (SmolLM2's ratio)
    (1, 1, 1, 9, 3, 64, [37]),  # plain decode with SmolLM2's 9 / 3 heads
    (2, 3, 7, 8, 2, 128, [0, 50, 129]),  # odd T, GQA 4, empty prefix in one sequence
    (3, 2, 33, 8, 1, 64, [5, 70]),  # GQA 8: M = 264 rows, several M tiles
    (4, 1, 128, 4, 4, 64, [20]),  # T = 128, no GQA
    (5, 3, 16, 9, 3, 64, [3, 96, 41]),  # SmolLM2 heads, batch 3
    (6, 2, 3, 6, 2, 40, [9, 1]),  # head_dim not a power of two (padded tiles)
]


@pytest.mark.parametrize("seed,B,T,Hq,Hkv,D,seqlens", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_equals_reference(backend, seed, B, T, Hq, Hkv, D, seqlens, dtype):
    gen = torch.Generator().manual_seed(seed)
    mask = tree_from_parents(random_parents(T, gen))[0].to(DEV)
    q, k, v = qkv(gen, B, T, Hq, Hkv, D, max(seqlens) + T + 5, dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    out = hk.ops.tree_attention(q, k, v, sl, mask, backend=backend)
    ref = reference.tree_attention(q.float(), k.float(), v.float(), sl, mask)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_rel(out.float(), ref, RTOL[dtype], f"tree_attention {backend} {dtype}")


# ---- a tree per sequence ------------------------------------------------------------------------
PER_SEQUENCE_CASES = [  # seed, node counts of the sequences' trees, Hq, Hkv, D, seqlens
    (10, [5], 4, 4, 64, [9]),  # batch 1 in the per-sequence form
    (11, [1, 7, 4], 9, 3, 64, [0, 21, 6]),  # odd T, a root-only tree beside bigger ones, GQA 3
    (12, [3, 12], 8, 1, 40, [17, 3]),  # GQA 8, head_dim 40
    (13, [1, 1, 1, 1], 2, 2, 64, [4, 0, 9, 2]),  # T = 1: every tree is just its root
    (14, [9, 2, 6], 6, 2, 128, [1, 30, 12]),  # GQA 3, head_dim 128
]


@pytest.mark.parametrize("seed,sizes,Hq,Hkv,D,seqlens", PER_SEQUENCE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_per_sequence_trees_equal_brute_force(backend, seed, sizes, Hq, Hkv, D, seqlens, dtype):
    """Trees of different sizes in one batch, padded to a common T (a padded node attends to the prefix
    and itself): each node of each sequence attends to exactly its own tree's ancestors."""
    gen = torch.Generator().manual_seed(seed)
    _, batch = random_tree_batch(gen, sizes)
    B, T = batch.parents.shape
    q, k, v = qkv(gen, B, T, Hq, Hkv, D, max(seqlens) + T + 3, dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    out = hk.ops.tree_attention(q, k, v, sl, batch.mask.to(DEV), backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_rel(out.float(), brute_force(q, k, v, sl, batch.mask, D**-0.5), RTOL[dtype],
                     f"per-sequence tree_attention {backend} {dtype}")


def test_tree_attention_same_tree_per_sequence_is_the_shared_result(backend):
    """Every sequence given the same tree, as a [B, T, T] copy or as an expanded view (batch stride 0),
    gives exactly (bit for bit) the shared [T, T] tree's result."""
    gen = torch.Generator().manual_seed(20)
    B, T, Hq, Hkv, D = 3, 7, 6, 2, 64
    mask = tree_from_parents(random_parents(T, gen))[0].to(DEV)
    q, k, v = qkv(gen, B, T, Hq, Hkv, D, 40, torch.float32)
    sl = torch.tensor([11, 0, 25], dtype=torch.int32, device=DEV)
    shared = hk.ops.tree_attention(q, k, v, sl, mask, backend=backend)
    for per_seq in (mask.expand(B, T, T).clone(), mask.expand(B, T, T)):
        assert torch.equal(hk.ops.tree_attention(q, k, v, sl, per_seq, backend=backend), shared)


# ---- rows that must not be read, the scale -------------------------------------------------------
def test_rows_outside_prefix_and_tree_are_ignored(backend):
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 4, 2, 64
    mask, _ = tree_from_parents([-1, 0, 0, 1])
    q, k, v = qkv(gen, B, T, H, H, D, 20, torch.float32, strided=False)
    seqlens = torch.tensor([3, 8], dtype=torch.int32, device=DEV)
    mask = mask.to(DEV)
    a = hk.ops.tree_attention(q, k, v, seqlens, mask, backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[0, 7:] = 1e4  # rows after sequence 0's tree
    v2[1, 12:] = -1e4  # rows after sequence 1's tree (stale cache rows are finite: zeros or old K/V)
    b = hk.ops.tree_attention(q, k2, v2, seqlens, mask, backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sm_scale_is_used(backend):
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(gen, 1, 2, 2, 2, 64, 6, torch.float32, strided=False)
    mask = torch.ones(2, 2, dtype=torch.bool).tril().to(DEV)
    s = torch.tensor([4], dtype=torch.int32, device=DEV)
    out = hk.ops.tree_attention(q, k, v, s, mask, sm_scale=0.3, backend=backend)
    assert_close_rel(out, brute_force(q, k, v, s, mask, 0.3), 1e-5, "sm_scale")


@pytest.mark.backends("triton", "native", op="tree_attention")
def test_tree_attention_sm_scale_and_nan_rows_past_the_tree(backend):
    """Rows beyond seqlen + T of each sequence hold NaN: the kernels never read them (the reference
    would, so it gets them zeroed). The native fp32 kernel reads only each row's keys."""
    gen = torch.Generator().manual_seed(8)
    mask = tree_from_parents(random_parents(6, gen))[0].to(DEV)
    q, k, v = qkv(gen, 2, 6, 4, 2, 64, 30, torch.float32, strided=False)
    sl = torch.tensor([10, 3], dtype=torch.int32, device=DEV)
    for b, s in enumerate(sl.tolist()):
        k[b, s + 6:] = float("nan")
        v[b, s + 6:] = float("nan")
    out = hk.ops.tree_attention(q, k, v, sl, mask, sm_scale=0.05, backend=backend)
    ref = reference.tree_attention(q, torch.nan_to_num(k), torch.nan_to_num(v), sl, mask, sm_scale=0.05)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, RTOL[torch.float32], "sm_scale")


# ---- Triton: splits, the bit-packed mask ---------------------------------------------------------
@pytest.mark.backends("triton")
@pytest.mark.parametrize("split_size,per_sequence", [(32, False), (64, True)])
def test_tree_attention_triton_many_splits_and_strided_cache(backend, split_size, per_sequence):
    from hydra_kernels.ops.triton.tree_attention import tree_attention

    gen = torch.Generator().manual_seed(7)
    B, T = 3, 5
    if per_sequence:
        mask = random_tree_batch(gen, [5, 2, 4])[1].mask.to(DEV)
    else:
        mask = tree_from_parents(random_parents(T, gen))[0].to(DEV)
    q, k, v = qkv(gen, B, T, 6, 2, 64, 260, torch.float32)
    assert not k.is_contiguous() and not q.is_contiguous()
    sl = torch.tensor([0, 31, 200], dtype=torch.int32, device=DEV)
    ref = reference.tree_attention(q, k, v, sl, mask)
    out = tree_attention(q, k, v, sl, mask, split_size=split_size)  # 9 or 5 prefix splits, some empty
    assert_close_rel(out, ref, RTOL[torch.float32], "split tree_attention")


@pytest.mark.backends("triton")
@pytest.mark.parametrize("shape", [(70, 70), (3, 33, 33)])
def test_pack_tree_mask_bits(backend, shape):
    from hydra_kernels.ops.triton.tree_mask import pack_tree_mask

    gen = torch.Generator().manual_seed(3)
    m = torch.rand(*shape, generator=gen) < 0.5
    T = shape[-1]
    bits = pack_tree_mask(m)
    assert bits.shape == (*shape[:-1], (T + 31) // 32) and bits.dtype == torch.int32
    j = torch.arange(T)
    unpacked = ((bits[..., j // 32].long() >> (j % 32)) & 1).bool()
    assert torch.equal(unpacked, m)


@pytest.mark.backends("triton")
@pytest.mark.parametrize("shared", [True, False])
def test_prepacked_mask_gives_the_same_output(backend, shared):
    """The Triton kernel reads a mask packed once per step (pack_kernel_mask, what AttentionSite passes to
    every layer) exactly as it reads the bool mask it packs itself; a shared tree stays batch stride 0."""
    from hydra_kernels.ops.triton.tree_attention import tree_attention
    from hydra_kernels.ops.triton.tree_mask import pack_kernel_mask

    gen = torch.Generator().manual_seed(5)
    B, T, H, D, S = 2, 5, 2, 16, 9
    q = torch.randn(B, T, H, D, generator=gen).to(DEV)
    k, v = (torch.randn(B, S + T, H, D, generator=gen).to(DEV) for _ in range(2))
    sl = torch.tensor([S, 3], dtype=torch.int32, device=DEV)
    one = tree_from_parents([-1, 0, 0, 1, 2])[0]
    mask = (one if shared else torch.stack([one, tree_from_parents([-1, 0, 1, 2, 3])[0]])).to(DEV)
    packed = pack_kernel_mask(mask)
    assert (packed.batch_stride == 0) == shared and packed.bits.dtype == torch.int32
    out = tree_attention(q, k, v, sl, packed)
    assert torch.equal(out, tree_attention(q, k, v, sl, mask))
    assert_close_rel(out, reference.tree_attention(q, k, v, sl, mask), RTOL[torch.float32], "pre-packed mask")


# ---- native: the fp32 row kernel -----------------------------------------------------------------
@pytest.mark.backends("native", op="tree_attention")
@pytest.mark.parametrize("Hq,Hkv,D,seqlens", [(9, 3, 64, [41, 0]), (4, 1, 40, [7, 130])])
def test_tree_attention_native_fp32_rows_do_not_depend_on_the_rest_of_the_tree(backend, Hq, Hkv, D, seqlens):
    """fp32 rows are computed one at a time over (prefix, ancestors-or-self): node i's output with the
    whole tree equals, bit for bit, its output when the step holds only nodes 0..i (its ancestors come
    first in BFS order; i = 0 is a 1-token decoding step)."""
    ops = torch.ops.hydra_kernels
    gen = torch.Generator().manual_seed(7)
    T = 9
    mask, _ = tree_from_parents(random_parents(T, gen))
    B = len(seqlens)
    S = max(seqlens) + T + 3
    k, v = torch.randn(2, B, S, Hkv, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    full = ops.tree_attention(q, k, v, sl, mask)
    for i in range(T):
        part = ops.tree_attention(q[:, : i + 1].contiguous(), k, v, sl, mask[: i + 1, : i + 1].contiguous())
        assert torch.equal(part[:, i], full[:, i]), f"node {i}"
    assert_close_rel(full, reference.tree_attention(q, k, v, sl, mask), RTOL[torch.float32], "fp32 rows")


@pytest.mark.backends("native", op="tree_attention")
@pytest.mark.parametrize("per_sequence", [False, True])
def test_tree_attention_native_ignores_rows_past_the_tree_and_checks_inputs(backend, per_sequence):
    gen = torch.Generator().manual_seed(0)
    mask = random_tree_batch(gen, [5, 3])[1].mask if per_sequence else tree_from_parents(random_parents(5, gen))[0]
    k, v = torch.randn(2, 20, 2, 64, generator=gen), torch.randn(2, 20, 2, 64, generator=gen)
    sl = torch.tensor([4, 9], dtype=torch.int32)
    q = torch.randn(2, 5, 4, 64, generator=gen)
    k[:, 14:], v[:, 14:] = float("nan"), float("nan")  # past the longest tree: never read
    k[0, 9:14], v[0, 9:14] = 1e3, -1e3  # past sequence 0's tree, inside sequence 1's: masked, finite
    for dtype in (torch.float32, torch.bfloat16):  # the fp32 row kernel; ATen's flash kernel behind our key mask
        c = lambda t: t.to(dtype)  # noqa: E731
        out = hk.ops.tree_attention(c(q), c(k), c(v), sl, mask, sm_scale=0.07, backend=backend)
        ref = reference.tree_attention(c(q).float(), torch.nan_to_num(c(k).float()), torch.nan_to_num(c(v).float()),
                                       sl, mask, sm_scale=0.07)
        assert torch.isfinite(out).all()
        assert_close_rel(out.float(), ref, RTOL[dtype], f"masked rows {dtype}")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 16"):  # the public op's check (every backend)
        hk.ops.tree_attention(q, k, v, torch.tensor([4, 16], dtype=torch.int32), mask, backend=backend)
    with pytest.raises(RuntimeError, match="exceeds the cache"):  # and the kernel's own
        torch.ops.hydra_kernels.tree_attention(q, k, v, torch.tensor([4, 16], dtype=torch.int32), mask, None)
    wrong_batch = mask[:1] if per_sequence else mask.expand(3, 5, 5)  # [B, T, T] needs B = 2
    with pytest.raises(RuntimeError, match=r"tree_mask must be bool \[T, T\]"):
        torch.ops.hydra_kernels.tree_attention(q, k, v, sl, wrong_batch, None)


# ---- native: the fp32 kernel's GQA tiles ----------------------------------------------------------
# The AVX-512 kernel takes the G * T query rows of a KV head together (K and V read once per tile), but
# each row's arithmetic is the row kernel's: its result must not depend on the tile it sits in.
TILE_CASES = [  # seed, Hq, Hkv, D, node counts of the sequences' trees, seqlens
    (30, 9, 3, 64, [1], [2100]),  # SmolLM2 heads: a decoding step at a long context
    (31, 9, 3, 64, [6], [700]),  # SmolLM2 heads, a 6-node tree
    (32, 4, 4, 40, [5, 1, 9], [0, 700, 33]),  # G = 1, head_dim 40 (masked tail), trees of 5 / 1 / 9 nodes
    (33, 12, 3, 128, [7, 3], [2100, 17]),  # G = 4, head_dim 128
    (34, 16, 2, 64, [9, 9], [1, 300]),  # G = 8: 72 query rows per KV head (several tiles)
    (35, 8, 1, 40, [4, 2], [0, 0]),  # G = 8, no prefix: tree keys only
    (36, 32, 4, 64, [33, 20], [2100, 1500]),  # 264 query rows per KV head: the pairs in several batches
    (37, 80, 80, 16, [3], [30]),  # 80 KV heads (more than one thread's span holds), head_dim 16
    # 3 to 7 rows per KV head around the score passes' row counts (kScoreRows: 4 rows per K pass at
    # head_dim <= 48, 3 at 64, 2 above): 3 + 1, 3 + 2, 3 + 3, 3 + 3 + 1 at 64; 4 + 2, 4 + 1, 4 + 3 below;
    # 2 + 1 at 80; prefixes ending inside a 16-key block (the listed-keys pass) and on a block edge
    (38, 4, 2, 64, [2, 1], [300, 17]),  # G = 2, T = 2: 4 rows
    (39, 5, 1, 64, [1], [700]),  # G = 5 decoding: 5 rows
    (40, 6, 1, 64, [1, 1], [129, 0]),  # G = 6 decoding: 6 rows
    (41, 7, 1, 64, [1], [2100]),  # G = 7 decoding: 7 rows
    (42, 6, 3, 48, [3, 2], [100, 33]),  # G = 2, T = 3, head_dim 48: 6 rows
    (43, 5, 1, 40, [1], [47]),  # G = 5, head_dim 40 (masked tail): 5 rows
    (44, 7, 1, 32, [1], [64]),  # G = 7, head_dim 32: 7 rows
    (45, 9, 3, 80, [1], [515]),  # SmolLM2's GQA at head_dim 80: 3 rows
    # SmolLM2 decoding at the lengths where the score pass splits its keys into 2, 3 or 4 ranges (key_ranges:
    # as many as split evenly over the threads), batch 1 and an odd batch
    (46, 9, 3, 64, [1], [130]),
    (47, 9, 3, 64, [1], [300]),
    (48, 9, 3, 64, [1, 1, 1], [200, 90, 400]),
    (49, 4, 2, 288, [3, 2], [40, 7]),  # head_dim > 256: the portable row kernel (the path of a CPU without AVX-512)
    # ragged batches, whose work the passes split over the threads by keys, not by sequences (balanced_spans): a long
    # sequence beside an empty one (a finished sequence attends over no prefix) is cut into ranges for every thread;
    # several short ones beside a long one; trees of other sizes
    (50, 9, 3, 64, [1, 1], [2100, 0]),
    (51, 9, 3, 64, [2, 1, 1, 3], [700, 3, 0, 45]),
    (52, 8, 2, 64, [4, 2, 1], [0, 1500, 17]),
]


@pytest.mark.backends("native", op="tree_attention")
@pytest.mark.parametrize("seed,Hq,Hkv,D,sizes,seqlens", TILE_CASES)
def test_tree_attention_native_fp32_row_is_its_own_one_token_step(backend, seed, Hq, Hkv, D, sizes, seqlens):
    """Each node i of each sequence b, bit for bit: its output in the full step (every sequence's tree,
    all heads, one thread or several) = the output of a 1-token step of that node alone over a cache
    holding just its keys (prefix rows, then its ancestors-or-self, which end with itself), and each of
    its heads = that head alone over its KV head (1 query row per KV head: no rows grouped with it, so
    the grouping of a KV head's rows into score passes cannot leak into a row's result). Also the fp64
    brute force and ops/reference.py to fp32 tolerance. Rows no query may read are NaN: cache rows past each
    sequence's tree and a KV head beside the real ones (K/V are views of a [.., Hkv + 1, D] buffer)."""
    ops = torch.ops.hydra_kernels
    gen = torch.Generator().manual_seed(seed)
    mask = random_tree_batch(gen, sizes)[1].mask
    B, T = mask.shape[:2]
    kv = torch.randn(2, B, max(seqlens) + T + 4, Hkv + 1, D, generator=gen)
    kv[:, :, :, Hkv] = float("nan")
    for b, s in enumerate(seqlens):
        kv[:, b, s + T:] = float("nan")
    k, v = kv[0, :, :, :Hkv], kv[1, :, :, :Hkv]
    q = torch.randn(B, T, Hq, D, generator=gen)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the parallel split, whatever this process's default (1 under make test's workers)
        full = ops.tree_attention(q, k, v, sl, mask, None)
        assert torch.isfinite(full).all()
        for n in (1, 3, 4):  # other splits of the keys and columns over the threads: the same values
            torch.set_num_threads(n)
            assert torch.equal(ops.tree_attention(q, k, v, sl, mask, None), full), f"{n} thread(s)"
    finally:
        torch.set_num_threads(threads)
    one = torch.ones(1, 1, dtype=torch.bool)
    for b, L in enumerate(seqlens):
        for i in range(T):
            rows = list(range(L)) + [L + n for n in mask[b, i].nonzero()[:, 0].tolist()]
            assert rows[-1] == L + i
            kr, vr, Li = k[b : b + 1, rows], v[b : b + 1, rows], torch.tensor([len(rows) - 1], dtype=torch.int32)
            step = ops.tree_attention(q[b : b + 1, i : i + 1], kr, vr, Li, one, None)
            assert torch.equal(step[0, 0], full[b, i]), f"sequence {b}, node {i}"
            for h in range(Hq):  # each head alone (its KV head's keys: a view)
                g = h // (Hq // Hkv)
                alone = ops.tree_attention(q[b : b + 1, i : i + 1, h : h + 1], kr[:, :, g : g + 1], vr[:, :, g : g + 1],
                                           Li, one, None)
                assert torch.equal(alone[0, 0, 0], full[b, i, h]), f"sequence {b}, node {i}, head {h} alone"
    assert_close_rel(full, brute_force(q, k, v, sl, mask, D**-0.5), RTOL[torch.float32], "fp32 tiles")
    clean = torch.nan_to_num(kv, nan=0.0)  # the rows no query reads, made finite for the reference's masked matmul
    assert_close_rel(full, reference.tree_attention(q, clean[0, :, :, :Hkv], clean[1, :, :, :Hkv], sl, mask),
                     RTOL[torch.float32], "fp32 tiles against the reference")


# ---- inputs are checked by the public op ---------------------------------------------------------
@pytest.mark.parametrize("change,msg", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(tree_mask=a["tree_mask"].int()), "tree_mask must be bool"),
    (lambda a: a.update(tree_mask=a["tree_mask"].expand(3, 3, 3)), r"or \[B, T, T\] = \[2, 3, 3\]"),
    (lambda a: a.update(tree_mask=a["tree_mask"][:2, :2]), r"tree_mask must be bool \[T, T\] = \[3, 3\]"),
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


# ---- Triton: every launch config -----------------------------------------------------------------
@pytest.mark.backends("triton")
@pytest.mark.parametrize("D", [40, 128])  # the two 16-bit lists: head_dim <= 64 and above
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_attention_every_launch_config_equals_reference(backend, D, dtype, monkeypatch):
    """Each config of the split kernel's autotune list (forced; one GPU picks among them): odd T, GQA 3,
    ragged seqlens (0 included), several prefix splits, allocations poisoned."""
    from hydra_kernels.ops.triton import tree_attention as op

    gen = torch.Generator().manual_seed(D)
    mask = tree_from_parents(random_parents(5, gen))[0].to(DEV)
    q, k, v = qkv(gen, 2, 5, 6, 2, D, 80, dtype)
    sl = torch.tensor([0, 70], dtype=torch.int32, device=DEV)
    ref = reference.tree_attention(q.float(), k.float(), v.float(), sl, mask)
    configs = op._configs(dtype, max(16, 1 << (D - 1).bit_length()))
    assert 2 <= len(configs) <= 4
    for config in configs:
        poison_allocations(monkeypatch)
        out = op.tree_attention(q, k, v, sl, mask, split_size=32, config=config)
        monkeypatch.undo()
        assert_close_rel(out.float(), ref, RTOL[dtype], f"tree_attention {config}")
