"""The native small-M packed linear (csrc/packed_linear_cpu.cpp: pack_linear_weight / packed_linear, the
CPU model's and draft heads' linears; its panel loop: csrc/panel_loop.h, N not a multiple of the 64-column
panel and M not one of the row tile below) against fp64 matmuls on fresh random inputs with awkward shapes;
the Linear module that uses it; the CPU feature check that decides its AVX-512 path."""
import platform
from pathlib import Path

import pytest
import torch

from hydra_kernels.model.packed_linear import MAX_PACKED_ROWS, Linear, packed_kernel_off
from helpers import RTOL, assert_close_rel

pytestmark = pytest.mark.requires("native")
ops = torch.ops.hydra_kernels


@pytest.mark.parametrize("M,N,K,bias", [(1, 960, 576, False), (7, 100, 37, True), (16, 3072, 576, False),
                                        (13, 576, 1536, True), (33, 65, 64, True), (6, 64, 1, False)])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_linear(M, N, K, bias, storage):
    """fp32 storage computes x W^T + b; bf16 storage (draft heads) computes it for W rounded to bf16
    (round to nearest even), accumulated in fp32: both to fp32 accuracy against fp64."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(K, N, generator=gen).t()  # [N, K] input-major view, as CPU models may hold it
    b = torch.randn(N, generator=gen) if bias else None
    x = torch.randn(M, K, generator=gen)
    packed = ops.pack_linear_weight(w) if storage is torch.float32 else ops.pack_linear_weight(w, storage)
    assert packed.shape == ((N + 63) // 64, K, 64) and packed.dtype == storage
    y = ops.packed_linear(x, packed, N, b)
    ref = x.double() @ w.to(storage).double().T + (b.double() if bias else 0)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_close_rel(y, ref, RTOL[torch.float32], "packed_linear")
    # a row's result does not depend on the rows beside it: bit for bit (1-token step vs tree step)
    assert torch.equal(torch.cat([ops.packed_linear(x[i:i + 1], packed, N, b) for i in range(M)]), y)


def test_packed_linear_checks_its_inputs():
    packed = ops.pack_linear_weight(torch.randn(70, 32))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        ops.packed_linear(torch.randn(2, 31), packed, 70, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.packed_linear(torch.randn(2, 32), packed, 200, None)
    with pytest.raises(RuntimeError, match="weight must be fp32"):
        ops.pack_linear_weight(torch.randn(70, 32).bfloat16())
    with pytest.raises(RuntimeError, match="dtype must be torch.float32 or torch.bfloat16"):
        ops.pack_linear_weight(torch.randn(70, 32), torch.float16)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.packed_linear(torch.randn(2, 32), packed.half(), 70, None)


def test_linear_module_uses_packed_weights_only_for_small_m_inference():
    torch.manual_seed(0)
    lin = Linear(48, 70, bias=True)
    lin.pack_cpu()
    assert lin.packed_on and lin.packed_weight() is not None
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        assert_close_rel(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), RTOL[torch.float32], "module")
        big = torch.randn(MAX_PACKED_ROWS + 1, 48)
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))  # MKL path
        first = lin.packed_weight()
        lin.weight.mul_(2.0)  # weights changed after packing: repacked before use
        assert lin.packed_weight() is not first
        assert_close_rel(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), RTOL[torch.float32], "repack")
    with torch.enable_grad():  # autograd: F.linear
        lin(x).sum().backward()
    assert lin.weight.grad is not None


def test_packed_kernel_off_switches_to_f_linear_and_back():
    torch.manual_seed(1)
    net = torch.nn.Sequential(Linear(48, 70), Linear(70, 33, bias=False))
    for m in net:
        m.pack_cpu()
    saved = [m.packed_weight() for m in net]
    x = torch.randn(5, 48)
    with torch.no_grad():
        with pytest.raises(ValueError, match="inside"):
            with packed_kernel_off(net):
                assert not any(m.packed_on for m in net)
                assert torch.equal(net[0](x), torch.nn.functional.linear(x, net[0].weight, net[0].bias))
                raise ValueError("inside")  # restored even when the block fails
    assert all(m.packed_on and m.packed_weight() is p for m, p in zip(net, saved))


def test_released_linear_keeps_only_its_panels_and_computes_the_same():
    """release_original: the fp32 panels are the weight's only copy; small and large M run the packed kernel
    (each row bit-identical to its M = 1 result), autograd unpacks, state_dict / .to() / packed_kernel_off
    see the real weight."""
    torch.manual_seed(2)
    lin = Linear(48, 70, bias=True)
    w = lin.weight.detach().clone()
    lin.pack_cpu()
    assert lin.release_original() and lin.released and lin.weight.is_meta
    x, big = torch.randn(3, 48), torch.randn(MAX_PACKED_ROWS + 9, 48)
    with torch.no_grad():
        assert torch.equal(lin.unpacked_weight(), w)
        assert torch.equal(lin(x), ops.packed_linear(x, ops.pack_linear_weight(w), 70, lin.bias))
        rows = torch.cat([lin(big[i:i + 1]) for i in range(big.shape[0])])
        assert torch.equal(lin(big), rows)  # prefill rows = decode rows, bit for bit
        assert_close_rel(lin(big), torch.nn.functional.linear(big, w, lin.bias), RTOL[torch.float32], "released")
    with torch.enable_grad():
        x.requires_grad_(True)
        lin(x).sum().backward()  # through the unpacked weight
        assert x.grad is not None
    assert torch.equal(lin.state_dict()["weight"], w)
    with packed_kernel_off(lin):
        assert not lin.released and torch.equal(lin.weight, w)
    assert lin.released and lin.packed_on
    copy = Linear(48, 70, bias=True)
    copy.load_state_dict(lin.state_dict())
    assert torch.equal(copy.weight, w)
    lin.to(torch.float64)  # .to() brings the original back first
    assert not lin.released and torch.equal(lin.weight, w.double())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory maps")
def test_a_loaded_model_keeps_no_view_of_its_checkpoint_file(tmp_path):
    """safetensors hands out views of one mmap of the file: a single tensor kept as is (a norm weight) held
    every page of it resident beside the packed copy (513 MB for SmolLM2). After loading, the file must not
    be mapped any more."""
    import gc

    import hydra_kernels as hk
    from hydra_kernels.model.hf_checkpoint import save_hf_dir
    from test_llama_vs_transformers import make_hf

    save_hf_dir(hk.Llama.from_hf(make_hf("gqa3-tied", seed=4)), tmp_path)
    model, _ = hk.load_model(tmp_path, device="cpu")
    gc.collect()
    assert str(tmp_path / "model.safetensors") not in Path("/proc/self/maps").read_text()
    assert model.norm.weight.isfinite().all()


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads /proc/cpuinfo flags")
def test_cpu_feature_check_matches_the_machine():
    """csrc/cpu_features.h decides whether the AVX-512 paths of both CPU kernels run: it must agree with
    the flags the kernel reports for this machine (else a kernel would fault or silently run slow)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert bool(torch.ops.hydra_kernels.packed_linear_is_fast()) == ("avx512f" in flags)
