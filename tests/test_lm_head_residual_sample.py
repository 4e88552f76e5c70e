"""lm_head_residual_sample (per row: lse of softmax(x W^T / temperature) and a Gumbel-max draw from it with
some tokens removed, the logits never written) on every backend against the reference, which draws the
same counter-based noise (ops/philox.py, bit-identical to tl.rand): the same tokens, not just the same
law. The draw against the renormalised softmax's frequencies; bad input."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from hydra_kernels.ops.philox import philox_uniform
from helpers import DEV, RTOL, assert_close_rel, poison_allocations

pytestmark = pytest.mark.backends("reference", "triton", op="lm_head_residual_sample")


def _seed(s):
    return torch.tensor([s], dtype=torch.int64, device=DEV)


def perturbed(x, w, temp, seed, exclude):
    """The reference's Gumbel-perturbed logits [N, V] (-inf where excluded), for reading near-ties."""
    z = (x.float().reshape(-1, x.shape[-1]) @ w.float().T) / temp
    N, V = z.shape
    u = philox_uniform(seed, torch.arange(N, device=z.device)[:, None] * V + torch.arange(V, device=z.device))
    g = z - torch.log(-torch.log(u.clamp(min=1e-20)))
    ex = exclude.reshape(N, exclude.shape[-1])
    drop = torch.zeros(N, V + 1, dtype=torch.bool, device=z.device).scatter(1, torch.where(ex >= 0, ex, V), True)
    return g.masked_fill(drop[:, :V], float("-inf"))  # column V took the -1 entries


def check_against_reference(backend, lead, V, H, temp, C, dtype, monkeypatch, block_v=None, config=None):
    """Same lse; the same token wherever the two perturbed maxima are not a near-tie (the logits differ
    by rounding); never an excluded token; every output written (allocations poisoned)."""
    gen = torch.Generator().manual_seed(V + C)
    x = torch.randn(*lead, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(V, H, generator=gen) / H**0.25).to(DEV, dtype)
    seed = _seed(1000 + V)
    ex = torch.randint(-1, V, (*lead, C), generator=gen)  # -1: an empty slot; repeats are fine
    if C:  # remove each row's unrestricted draw from some rows: the restricted draw must move
        top = perturbed(x, w, temp, seed, torch.full((*lead, 1), -1).to(DEV)).argmax(-1).view(lead).cpu()
        ex[..., 0] = torch.where(torch.rand(lead, generator=gen) < 0.5, top, ex[..., 0])
    ex = ex.to(DEV)
    poison_allocations(monkeypatch)
    if block_v is None and config is None:
        lse, samp = hk.ops.lm_head_residual_sample(x, w, temp, seed, ex, backend=backend)
    else:  # the Triton launcher with a chosen vocabulary tile / launch config
        from hydra_kernels.ops.triton.lm_head_residual_sample import lm_head_residual_sample

        lse, samp = lm_head_residual_sample(x, w, temp, seed, ex, block_v=block_v, config=config)
    monkeypatch.undo()
    rl, rs = reference.lm_head_residual_sample(x.float(), w.float(), temp, seed, ex)
    assert lse.shape == samp.shape == lead and samp.dtype == torch.int64
    assert_close_rel(lse, rl, RTOL[dtype] * 4, "lse")
    assert not (samp[..., None] == ex).any(), "drew an excluded token"
    g = perturbed(x, w, temp, seed, ex).cpu()
    got, want = samp.reshape(-1).cpu(), rs.reshape(-1).cpu()
    rows = torch.arange(g.shape[0])
    gap = g[rows, want] - g[rows, got]  # >= 0; > 0 only where the two backends rank a near-tie differently
    assert ((got == want) | (gap < 1e-3 * g[rows, want].abs().clamp(min=1))).all(), (got, want, gap)
    assert (got == want).float().mean() > 0.9


# lead: the rows' leading dims ([B, T] as verification has them); C: excluded tokens per row
@pytest.mark.parametrize("lead,V,H,temp,C", [((1,), 300, 64, 1.0, 1), ((3, 3), 517, 96, 0.7, 3),
                                             ((33,), 129, 64, 1.5, 0), ((5, 7), 1031, 40, 0.8, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_residual_sample_equals_reference(backend, lead, V, H, temp, C, dtype, monkeypatch):
    check_against_reference(backend, lead, V, H, temp, C, dtype, monkeypatch)


@pytest.mark.requires("triton")
@pytest.mark.parametrize("lead,V,block_v", [((5, 7), 517, 128), ((2, 35), 1031, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_vocabulary_tiles_equal_reference(lead, V, block_v, dtype, monkeypatch):
    """The Triton merge over vocabulary tiles (the interpreter's default tile covers these V at once),
    the last tile partial."""
    check_against_reference("triton", lead, V, 40, 0.9, 4, dtype, monkeypatch, block_v=block_v)


@pytest.mark.requires("triton", op="lm_head_residual_sample")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_launch_config_equals_reference(dtype, monkeypatch):
    """Each config of the launcher's autotune lists (both row-tile lists; forced, one GPU picks among
    them): odd V and H, several vocabulary tiles, excluded tokens."""
    from hydra_kernels.ops.triton import lm_head_residual_sample as op

    configs = op._configs(dtype, 16) + op._configs(dtype, 64)
    assert 2 <= len(op._configs(dtype, 16)) <= 4 and 2 <= len(op._configs(dtype, 64)) <= 4
    for config in dict.fromkeys(configs):
        check_against_reference("triton", (3, 5), 517, 100, 0.9, 3, dtype, monkeypatch, block_v=128, config=config)


def test_residual_sample_follows_renormalised_softmax(backend):
    """4096 rows with the same logits and the same two tokens removed: frequencies within 5 sigma of
    softmax(z) renormalised over the other tokens; the same seed draws the same tokens."""
    V, H, n = 10, 16, 4096
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=gen).to(DEV)
    x = torch.randn(1, H, generator=gen).to(DEV).expand(n, H).contiguous()
    p = torch.softmax((x[0] @ w.T) / 0.8, -1).cpu()
    drop = p.topk(2).indices  # the two likeliest: the biggest change of law
    ex = drop.expand(n, 2).contiguous().to(DEV)
    _, samp = hk.ops.lm_head_residual_sample(x, w, 0.8, _seed(11), ex, backend=backend)
    q = p.clone()
    q[drop] = 0
    q /= q.sum()
    freq = torch.bincount(samp.cpu(), minlength=V).double() / n
    sigma = (q * (1 - q) / n).sqrt()
    assert ((freq - q).abs() <= 5 * sigma + 1e-3).all(), (freq, q)
    _, again = hk.ops.lm_head_residual_sample(x, w, 0.8, _seed(11), ex, backend=backend)
    assert torch.equal(samp, again)
    _, other = hk.ops.lm_head_residual_sample(x, w, 0.8, _seed(12), ex, backend=backend)
    assert not torch.equal(samp, other)


def test_lm_head_residual_sample_bad_inputs():
    x, w, seed = torch.randn(2, 8), torch.randn(10, 8), torch.tensor([0])
    ex = torch.full((2, 3), -1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        hk.ops.lm_head_residual_sample(x, w, 0.0, seed, ex)
    with pytest.raises(ValueError, match="seed must be"):
        hk.ops.lm_head_residual_sample(x, w, 1.0, 0, ex)
    with pytest.raises(ValueError, match=r"exclude must be int64 \[\.\.\., C\]"):
        hk.ops.lm_head_residual_sample(x, w, 1.0, seed, ex[:1])
    with pytest.raises(ValueError, match="C < V = 10"):
        hk.ops.lm_head_residual_sample(x, w, 1.0, seed, torch.full((2, 10), -1))
    with pytest.raises(ValueError, match="exclude must be int64"):
        hk.ops.lm_head_residual_sample(x, w, 1.0, seed, ex.int())
    with pytest.raises(ValueError, match=r"token ids in \[0, V = 10\)"):
        hk.ops.lm_head_residual_sample(x, w, 1.0, seed, torch.full((2, 3), 10))


@pytest.mark.requires("triton")
def test_philox_uniform_is_tl_rand():
    """The reference's noise is Triton's, bit for bit: seeds of every sign and size, offsets past 2^32."""
    import triton
    import triton.language as tl

    @triton.jit
    def _uniforms(seed_ptr, out_ptr, base, stride, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.rand(tl.load(seed_ptr), base + i.to(tl.int64) * stride), mask=i < n)

    for s, base, stride in [(0, 0, 1), (123456789, 5, 7919), (2**62 - 17, 2**33 + 3, 2**20 + 1), (-5, 10**12, 3)]:
        seed, out = _seed(s), torch.empty(1000, device=DEV)
        _uniforms[(1,)](seed, out, base, stride, 1000, BLOCK=1024)
        want = philox_uniform(seed, base + torch.arange(1000, device=DEV) * stride)
        assert torch.equal(out, want), (s, base, (out != want).sum())
        assert 0 <= float(want.min()) and float(want.max()) < 1
