"""hydra_first_layer (a Hydra head's first ResBlock without materialising its concatenated input) on every
backend against the reference: depths 0..3, odd node counts, batch 1 and 3, H not a multiple of the tile,
with and without biases, each dtype; and against the drafter's own block."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, RTOL, assert_close_rel, poison_allocations

pytestmark = pytest.mark.backends("reference", "triton", op="hydra_first_layer")


def _inputs(seed, B, n, d, H, V, dtype, bias=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=gen) / max(1, s[-1]) ** 0.5).to(DEV, dtype)  # noqa: E731
    h, emb = torch.randn(B, H, generator=gen).to(DEV, dtype), torch.randn(V, H, generator=gen).to(DEV, dtype)
    toks = torch.randint(0, V, (B, n, d + 1), generator=gen).to(DEV)
    wl, wr = r(H, (d + 2) * H), r(H, (d + 2) * H)
    bl, br = (r(H), r(H)) if bias else (None, None)
    return h, toks, emb, wl, bl, wr, br


@pytest.mark.parametrize("B,n,d,H,bias", [(1, 1, 0, 64, True), (3, 5, 1, 96, True), (2, 7, 3, 80, False),
                                          (1, 40, 2, 64, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hydra_first_layer_equals_reference(backend, B, n, d, H, bias, dtype):
    args = _inputs(B * 100 + n + d, B, n, d, H, 50, dtype, bias)
    ref = reference.hydra_first_layer(*[a.float() if a is not None and a.is_floating_point() else a for a in args])
    out = hk.ops.hydra_first_layer(*args, backend=backend)  # the op allocates its output
    assert out.shape == (B, n, H) and out.dtype == dtype and torch.isfinite(out).all()
    assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"hydra first layer {backend} {dtype}")


def test_hydra_first_layer_matches_the_drafter_block(backend):
    """The op computes exactly what a trained head's first ResBlock does on the concatenated input."""
    from hydra_kernels.drafters import DrafterConfig, HydraDrafter

    torch.manual_seed(0)
    cfg = DrafterConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=40)
    blk = HydraDrafter(cfg).heads[2].blocks[0]
    torch.nn.init.normal_(blk.linear.weight, std=0.1)
    blk.to(DEV)
    h, emb = torch.randn(2, 32, device=DEV), torch.randn(40, 32, device=DEV)
    toks = torch.randint(0, 40, (2, 4, 3), device=DEV)
    x = torch.cat([h[:, None].expand(2, 4, 32), emb[toks].flatten(2)], -1)
    got = hk.ops.hydra_first_layer(h, toks, emb, blk.linear.weight, blk.linear.bias, blk.res_connection.weight,
                                   blk.res_connection.bias, backend=backend)
    assert_close_rel(got, blk(x).detach(), RTOL[torch.float32], "drafter block")


def test_hydra_first_layer_bad_inputs():
    h, toks, emb, wl, bl, wr, br = _inputs(0, 1, 2, 1, 16, 10, torch.float32)
    with pytest.raises(ValueError, match=r"\[H, \(d\+2\)H\]"):
        hk.ops.hydra_first_layer(h, toks[..., :1], emb, wl, bl, wr, br)
    with pytest.raises(ValueError, match="integer"):
        hk.ops.hydra_first_layer(h, toks.float(), emb, wl, bl, wr, br)


# ---- Triton: split-K (too few output tiles to fill the GPU), launch configs ---------------------------
@pytest.mark.requires("triton", op="hydra_first_layer")
@pytest.mark.parametrize("B,n,d,H", [(1, 1, 0, 75), (2, 3, 2, 130)])  # odd H; batch 1 x one node
@pytest.mark.parametrize("splits", [1, 3, None])  # off, forced on, the launcher's choice
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hydra_first_layer_split_k_equals_reference(B, n, d, H, splits, dtype, monkeypatch):
    """The K-split path (fp32 partials of both products summed in split order, then the h-terms, biases
    and SiLU) and the unsplit one against the reference; every output written (allocations poisoned)."""
    from hydra_kernels.ops.triton.hydra_first_layer import hydra_first_layer

    args = _inputs(H + d, B, n, d, H, 50, dtype)
    poison_allocations(monkeypatch)
    out = hydra_first_layer(*args, splits=splits)
    monkeypatch.undo()
    ref = reference.hydra_first_layer(*[a.float() if a.is_floating_point() else a for a in args])
    assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"hydra first layer splits={splits} {dtype}")


@pytest.mark.requires("triton", op="hydra_first_layer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hydra_first_layer_every_launch_config_equals_reference(dtype, monkeypatch):
    """Each config of the launcher's autotune list (forced; one GPU picks among them) on an odd shape, split."""
    from hydra_kernels.ops.triton import hydra_first_layer as op

    args = _inputs(9, 2, 3, 1, 75, 50, dtype)
    ref = reference.hydra_first_layer(*[a.float() if a.is_floating_point() else a for a in args])
    lists = [op._configs(dtype, 16), op._configs(dtype, 64)]  # 16-row and 64-row tiles (fp32: other warps)
    assert all(2 <= len(c) <= 4 for c in lists)
    for config in dict.fromkeys(lists[0] + lists[1]):
        poison_allocations(monkeypatch)
        out = op.hydra_first_layer(*args, splits=2, config=config)
        monkeypatch.undo()
        assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"hydra first layer {config}")
