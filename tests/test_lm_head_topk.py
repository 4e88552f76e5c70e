"""lm_head_topk (LM head with fused top-k / argmax, the logits never written) on every backend against
the reference.

Vocabularies that are not a multiple of the tile, N from 1 to 70, k 1 / 4 / 10, fp32 / bf16 / fp16,
a strided (input-major) weight. Values within the dtype's tolerance; indices must be a valid top-k:
every returned token's logit is within tolerance of the reference's k-th best (exact ties aside, the
sets are equal, checked on fp32 where ties have probability ~0)."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, RTOL, assert_close_rel

pytestmark = pytest.mark.backends("reference", "triton", op="lm_head_topk")


@pytest.mark.parametrize("N,V,H,k", [(1, 1000, 64, 1), (7, 517, 96, 4), (70, 300, 64, 10), (3, 129, 576, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lm_head_topk_equals_reference(backend, N, V, H, k, dtype):
    gen = torch.Generator().manual_seed(N * 7 + V)
    x = torch.randn(N, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(V, H, generator=gen) / H**0.5).to(DEV, dtype)
    rv, ri = reference.lm_head_topk(x.float(), w.float(), k)
    v, i = hk.ops.lm_head_topk(x, w, k, backend=backend)
    assert v.shape == (N, k) and i.shape == (N, k) and i.dtype == torch.int64 and v.dtype == torch.float32
    assert_close_rel(v, rv, RTOL[dtype] * 4, f"top-{k} values {dtype}")  # logits: a length-H dot product
    logits = x.float() @ w.float().T
    assert_close_rel(logits.gather(1, i), v, RTOL[dtype] * 4, "returned ids carry their values")
    if dtype == torch.float32:
        assert torch.equal(i, ri)


def test_lm_head_topk_input_major_weight_and_batch_dims(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=gen).to(DEV)
    w = torch.randn(64, 333, generator=gen).to(DEV).t()  # [V, H] view of an [H, V] buffer (CPU layout)
    assert not w.is_contiguous()
    v, i = hk.ops.lm_head_topk(x, w, 3, backend=backend)
    rv, ri = reference.lm_head_topk(x, w, 3)
    assert v.shape == (2, 5, 3) and torch.equal(i, ri)
    assert_close_rel(v, rv, RTOL[torch.float32], "input-major weight")


def test_lm_head_argmax_ties_pick_the_lowest_id(backend):
    x = torch.ones(2, 64, device=DEV)
    w = torch.zeros(400, 64, device=DEV)
    w[[37, 150, 399]] = 1.0  # three equal maxima in different tiles
    _, i = hk.ops.lm_head_topk(x, w, 1, backend=backend)
    assert i.flatten().tolist() == [37, 37]


def test_lm_head_topk_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="share H"):
        hk.ops.lm_head_topk(x, torch.randn(10, 9), 1)
    with pytest.raises(ValueError, match="k must be"):
        hk.ops.lm_head_topk(x, w, 11)
    with pytest.raises(ValueError, match="dtype"):
        hk.ops.lm_head_topk(x, w.double(), 1)


@pytest.mark.requires("triton", op="lm_head_topk")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lm_head_topk_every_launch_config_equals_reference(dtype, monkeypatch):
    """Each config of the launcher's autotune list (forced; one GPU picks among them): odd N, V and H
    (H not a multiple of any step), several vocabulary tiles, allocations poisoned."""
    from helpers import poison_allocations
    from hydra_kernels.ops.triton import lm_head_topk as op

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 100, generator=gen).to(DEV, dtype)
    w = (torch.randn(517, 100, generator=gen) / 10).to(DEV, dtype)
    rv, _ = reference.lm_head_topk(x.float(), w.float(), 4)
    configs = op._configs(dtype)
    assert 2 <= len(configs) <= 4
    for config in configs:
        poison_allocations(monkeypatch)
        v, i = op.lm_head_topk(x, w, 4, block_v=128, config=config)
        monkeypatch.undo()
        assert_close_rel(v, rv, RTOL[dtype] * 4, f"top-4 values {config}")
        assert_close_rel((x.float() @ w.float().T).gather(1, i), v, RTOL[dtype] * 4, f"ids carry their values {config}")
