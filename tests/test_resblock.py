"""resblock (a draft head's H -> H block x + SiLU(x W^T + b), fused) on every backend against the
reference: odd shapes, with and without bias, each dtype, strided weights and inputs; and deep Hydra /
Medusa heads drafting the same tree with the fused blocks as with the reference ops."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, RTOL, assert_close_rel, poison_allocations

pytestmark = pytest.mark.backends("reference", "triton", op="resblock")


@pytest.mark.parametrize("shape,H,bias", [((1, 1), 64, True), ((3, 5), 96, True), ((2, 7), 80, False),
                                          ((1, 70), 64, True), ((40,), 576, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_resblock_equals_reference(backend, shape, H, bias, dtype):
    gen = torch.Generator().manual_seed(H + sum(shape))
    x = torch.randn(*shape, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(H, H, generator=gen) / H**0.5).to(DEV, dtype)
    b = (torch.randn(H, generator=gen) / H**0.5).to(DEV, dtype) if bias else None
    ref = reference.resblock(x.float(), w.float(), b.float() if bias else None)
    out = hk.ops.resblock(x, w, b, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"resblock {backend} {dtype}")


def test_resblock_strided_weight_and_input(backend):
    """The CPU layout hands weights over as transposed views; inputs may be non-contiguous too."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 48, generator=gen).to(DEV).t()  # [H, H] view of an input-major buffer
    x = torch.randn(48, 6, generator=gen).to(DEV).t()  # [6, 48], last-dim stride 6
    assert not w.is_contiguous() and not x.is_contiguous()
    assert_close_rel(hk.ops.resblock(x, w, None, backend=backend), reference.resblock(x, w, None),
                     RTOL[torch.float32], "strided resblock")


@pytest.mark.backends("triton", op="resblock")
def test_deep_hydra_and_medusa_heads_draft_the_same_tokens_on_triton(backend):
    """Heads with further ResBlocks (Hydra++ shape: 3 blocks; Medusa) draft the same tree with the
    fused Triton blocks (and first layer) as with the reference ops (random, non-zero block weights)."""
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
        got = d.draft(model, h, root, tree, "triton")
        ref = d.draft(model, h, root, tree, "reference")
        assert torch.equal(got, ref), kind


def test_resblock_bad_inputs():
    with pytest.raises(ValueError, match=r"weight must be \[H, H\]"):
        hk.ops.resblock(torch.randn(2, 8), torch.randn(8, 9))
    with pytest.raises(ValueError, match="share a dtype"):
        hk.ops.resblock(torch.randn(2, 8), torch.randn(8, 8).double())


# ---- Triton: split-K (too few output tiles to fill the GPU), launch configs ---------------------------
@pytest.mark.requires("triton", op="resblock")
@pytest.mark.parametrize("shape,H", [((1, 1), 75), ((3, 5), 130)])  # odd H; batch 1 x T = 1
@pytest.mark.parametrize("splits", [1, 3, None])  # off, forced on, the launcher's choice
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_resblock_split_k_equals_reference(shape, H, splits, dtype, monkeypatch):
    """The K-split path (fp32 partials summed in split order, then bias / SiLU / residual) and the
    unsplit one against the reference; every output written (allocations poisoned)."""
    from hydra_kernels.ops.triton.resblock import resblock

    gen = torch.Generator().manual_seed(H + len(shape))
    x = torch.randn(*shape, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(H, H, generator=gen) / H**0.5).to(DEV, dtype)
    b = (torch.randn(H, generator=gen) / H**0.5).to(DEV, dtype)
    poison_allocations(monkeypatch)
    out = resblock(x, w, b, splits=splits)
    monkeypatch.undo()
    assert_close_rel(out.float(), reference.resblock(x.float(), w.float(), b.float()), RTOL[dtype] * 2,
                     f"resblock splits={splits} {dtype}")


def test_k_splits_fill_the_gpu(monkeypatch):
    """The split choice at real sizes: SmolLM2's 9 output tiles on an H100's 132 SMs -> 9 splits of one
    64-column step; Llama-3-8B's 64 tiles -> 3; a grid as large as the GPU is not split; forced counts
    are kept (slices of 16: fewer when K is short)."""
    from hydra_kernels.ops.triton import common

    monkeypatch.setattr(common, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert common.k_splits(576, 9, cuda) == (9, 64)
    assert common.k_splits(4096, 64, cuda) == (3, 1408)
    assert common.k_splits(4096, 512, cuda) == (1, 4096)
    assert common.k_splits(75, 2, cuda, splits=3) == (3, 32)
    assert common.k_splits(40, 1, cuda, splits=5) == (3, 16)
    assert common.k_splits(75, 2, cuda, splits=1) == (1, 75)


@pytest.mark.requires("triton", op="resblock")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resblock_every_launch_config_equals_reference(dtype, monkeypatch):
    """Each config of the launcher's autotune list (forced; one GPU picks among them) on an odd shape, split."""
    from hydra_kernels.ops.triton import resblock as op

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 75, generator=gen).to(DEV, dtype)
    w = (torch.randn(75, 75, generator=gen) / 75**0.5).to(DEV, dtype)
    b = (torch.randn(75, generator=gen) / 75**0.5).to(DEV, dtype)
    ref = reference.resblock(x.float(), w.float(), b.float())
    configs = op._configs(dtype)
    assert 2 <= len(configs) <= 4
    for config in configs:
        poison_allocations(monkeypatch)
        out = op.resblock(x, w, b, splits=2, config=config)
        monkeypatch.undo()
        assert_close_rel(out.float(), ref, RTOL[dtype] * 2, f"resblock {config}")
