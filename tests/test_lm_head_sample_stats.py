"""lm_head_sample_stats (per row: lse and entropy of softmax(x W^T / temperature) and a token drawn from
it, the logits never written) on every backend against the reference; the draw against softmax
frequencies."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, RTOL, assert_close_rel

pytestmark = pytest.mark.backends("reference", "triton", op="lm_head_sample_stats")


def _seed(s):
    return torch.tensor([s], dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("N,V,H,temp", [(1, 300, 64, 1.0), (9, 517, 96, 0.7), (33, 129, 64, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_sample_stats_equals_reference(backend, N, V, H, temp, dtype):
    gen = torch.Generator().manual_seed(N + V)
    x = torch.randn(N, H, generator=gen).to(DEV, dtype)
    w = torch.randn(V, H, generator=gen).to(DEV, dtype) / H**0.25
    lse, ent, samp = hk.ops.lm_head_sample_stats(x, w, temp, _seed(3), backend=backend)
    rl, re, _ = reference.lm_head_sample_stats(x.float(), w.float(), temp, _seed(3))
    assert_close_rel(lse, rl, RTOL[dtype] * 4, "lse")
    assert_close_rel(ent, re, RTOL[dtype] * 4, "entropy")
    assert samp.dtype == torch.int64 and ((samp >= 0) & (samp < V)).all()


def test_sample_follows_softmax(backend):
    """4096 rows with the same logits: token frequencies within 5 sigma of softmax(z); the same seed
    draws the same tokens (Triton: Gumbel-max; the reference: torch.multinomial)."""
    V, H, n = 10, 16, 4096
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=gen).to(DEV)
    x = torch.randn(1, H, generator=gen).to(DEV).expand(n, H).contiguous()
    _, _, samp = hk.ops.lm_head_sample_stats(x, w, 0.8, _seed(11), backend=backend)
    p = torch.softmax((x[0] @ w.T) / 0.8, -1).cpu()
    freq = torch.bincount(samp.cpu(), minlength=V).double() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-3).all(), (freq, p)
    _, _, again = hk.ops.lm_head_sample_stats(x, w, 0.8, _seed(11), backend=backend)
    assert torch.equal(samp, again)  # same seed, same draw


def test_lm_head_sample_stats_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        hk.ops.lm_head_sample_stats(x, w, 0.0, torch.tensor([0]))
    with pytest.raises(ValueError, match="seed must be"):
        hk.ops.lm_head_sample_stats(x, w, 1.0, 0)


@pytest.mark.requires("triton", op="lm_head_sample_stats")
@pytest.mark.parametrize("N", [9, 65])  # the two lists: 16-row tiles at 4 warps, 64-row tiles at 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lm_head_sample_stats_every_launch_config_equals_reference(N, dtype, monkeypatch):
    """Each config of the launcher's autotune list (forced; one GPU picks among them): odd N, V, H,
    allocations poisoned."""
    from helpers import poison_allocations
    from hydra_kernels.ops.triton import lm_head_sample_stats as op
    from hydra_kernels.ops.triton.common import row_block

    gen = torch.Generator().manual_seed(N)
    x = torch.randn(N, 100, generator=gen).to(DEV, dtype)
    w = (torch.randn(517, 100, generator=gen) / 100**0.25).to(DEV, dtype)
    rl, re, _ = reference.lm_head_sample_stats(x.float(), w.float(), 0.7, _seed(3))
    configs = op._configs(dtype, row_block(N))
    assert 2 <= len(configs) <= 4
    for config in configs:
        poison_allocations(monkeypatch)
        lse, ent, samp = op.lm_head_sample_stats(x, w, 0.7, _seed(3), config=config)
        monkeypatch.undo()
        assert_close_rel(lse, rl, RTOL[dtype] * 4, f"lse {config}")
        assert_close_rel(ent, re, RTOL[dtype] * 4, f"entropy {config}")
        assert ((samp >= 0) & (samp < 517)).all()
