"""Triton fused Hydra first layer against the reference (CPU tier: TRITON_INTERPRET=1): depths 0..3,
odd node counts, batch 1 and 3, H not a multiple of the tile, with and without biases, each dtype."""
import os

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import RTOL, assert_close_rel

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed, B, n, d, H, V, dtype, bias=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=gen) / max(1, s[-1]) ** 0.5).to(DEV, dtype)
    h, emb = torch.randn(B, H, generator=gen).to(DEV, dtype), torch.randn(V, H, generator=gen).to(DEV, dtype)
    toks = torch.randint(0, V, (B, n, d + 1), generator=gen).to(DEV)
    wl, wr = r(H, (d + 2) * H), r(H, (d + 2) * H)
    bl, br = (r(H), r(H)) if bias else (None, None)
    return h, toks, emb, wl, bl, wr, br


@pytest.mark.parametrize("B,n,d,H,bias", [(1, 1, 0, 64, True), (3, 5, 1, 96, True), (2, 7, 3, 80, False),
                                          (1, 40, 2, 64, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hydra_first_layer_triton_equals_reference(B, n, d, H, bias, dtype):
    args = _inputs(B * 100 + n + d, B, n, d, H, 50, dtype, bias)
    ref = reference.hydra_first_layer(*[a.float() if a is not None and a.is_floating_point() else a for a in args])
    out = torch.full((B, n, H), float("nan"), dtype=dtype, device=DEV)  # poisoned; the op allocates its own
    out = hk.ops.hydra_first_layer(*args, backend="triton")
    assert out.shape == (B, n, H) and out.dtype == dtype
    assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"hydra first layer {dtype}")


def test_hydra_first_layer_matches_the_drafter_block():
    """The op computes exactly what a trained head's first ResBlock does on the concatenated input."""
    from hydra_kernels.drafters import Drafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=40)
    blk = Drafter(cfg).heads[2].blocks[0]
    torch.nn.init.normal_(blk.linear.weight, std=0.1)
    h, emb = torch.randn(2, 32), torch.randn(40, 32)
    toks = torch.randint(0, 40, (2, 4, 3))
    x = torch.cat([h[:, None].expand(2, 4, 32), emb[toks].flatten(2)], -1)
    got = hk.ops.hydra_first_layer(h, toks, emb, blk.linear.weight, blk.linear.bias, blk.res_connection.weight,
                                   blk.res_connection.bias, backend="triton")
    assert_close_rel(got, blk(x).detach(), RTOL[torch.float32], "drafter block")


def test_hydra_first_layer_bad_inputs():
    h, toks, emb, wl, bl, wr, br = _inputs(0, 1, 2, 1, 16, 10, torch.float32)
    with pytest.raises(ValueError, match=r"\[H, \(d\+2\)H\]"):
        hk.ops.hydra_first_layer(h, toks[..., :1], emb, wl, bl, wr, br)
    with pytest.raises(ValueError, match="integer"):
        hk.ops.hydra_first_layer(h, toks.float(), emb, wl, bl, wr, br)


@pytest.mark.parametrize("shape,H,bias", [((1, 1), 64, True), ((3, 5), 96, True), ((2, 7), 80, False),
                                          ((1, 70), 64, True), ((40,), 576, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_resblock_triton_equals_reference(shape, H, bias, dtype):
    gen = torch.Generator().manual_seed(H + sum(shape))
    x = torch.randn(*shape, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(H, H, generator=gen) / H**0.5).to(DEV, dtype)
    b = (torch.randn(H, generator=gen) / H**0.5).to(DEV, dtype) if bias else None
    ref = reference.resblock(x.float(), w.float(), b.float() if bias else None)
    out = hk.ops.resblock(x, w, b, backend="triton")
    assert out.shape == x.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"resblock {dtype}")


def test_resblock_triton_strided_weight_and_input():
    """The CPU layout hands weights over as transposed views; inputs may be non-contiguous too."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 48, generator=gen).to(DEV).t()  # [H, H] view of an input-major buffer
    x = torch.randn(48, 6, generator=gen).to(DEV).t()  # [6, 48], last-dim stride 6
    assert not w.is_contiguous() and not x.is_contiguous()
    assert_close_rel(hk.ops.resblock(x, w, None, backend="triton"), reference.resblock(x, w, None),
                     RTOL[torch.float32], "strided resblock")


def test_deep_hydra_and_medusa_heads_draft_the_same_tokens_on_triton():
    """Heads with further ResBlocks (Hydra++ shape: 3 blocks; Medusa) draft the same tree with the
    fused Triton blocks as with the reference ops (random, non-zero block weights)."""
    from hydra_kernels.model import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=128)
    model = Llama(cfg).to(DEV).eval()
    tree = hk.Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    for kind in ("hydra", "medusa"):
        d = hk.new_drafter(model, kind, num_heads=3, num_layers=3)
        for p in d.parameters():
            torch.nn.init.normal_(p, std=0.2)
        h, root = torch.randn(2, 64, device=DEV), torch.randint(0, 300, (2,), device=DEV)
        if kind == "hydra":
            got = d.draft(model, h, root, tree, backend="triton")
            ref = d.draft(model, h, root, tree, backend="reference")
        else:
            got = d.medusa_candidates(model, h, tree, backend="triton")
            ref = d.medusa_candidates(model, h, tree, backend="reference")
        assert torch.equal(got, ref), kind
