"""The extension's CPU kernels for the model's hot path: tree_attention (the fp32 row kernel; other
dtypes ATen's flash kernel behind our key mask) and the packed small-M linear, against the reference
definitions on fresh random inputs with awkward shapes, poisoned outputs where the op writes into a
buffer."""
import platform
from pathlib import Path

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.model.packed_linear import MAX_PACKED_ROWS, Linear, packed_kernel_off
from hydra_kernels.ops import reference
from helpers import RTOL, assert_close_rel, random_parents, tree_from_parents

pytestmark = pytest.mark.skipif(not hk.ops.native_available(), reason="hydra_kernels._C is not built")
ops = torch.ops.hydra_kernels


@pytest.mark.parametrize("B,T,Hq,Hkv,D,seqlens", [(1, 1, 9, 3, 64, [37]), (3, 7, 8, 2, 128, [0, 50, 129]),
                                                  (2, 33, 8, 1, 64, [5, 70]), (1, 128, 4, 4, 64, [20]),
                                                  (3, 16, 9, 3, 64, [3, 96, 41]), (2, 3, 6, 2, 40, [9, 1])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_native_equals_reference(B, T, Hq, Hkv, D, seqlens, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + T)
    mask, _ = tree_from_parents(random_parents(T, gen))
    S = max(seqlens) + T + 5
    kv = torch.randn(2, B, S + 4, Hkv, D, generator=gen).to(dtype)  # row-limited views, as the model passes
    k, v = kv[0, :, :S], kv[1, :, :S]
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype).transpose(1, 2)  # non-contiguous q
    sl = torch.tensor(seqlens, dtype=torch.int32)
    out = hk.ops.tree_attention(q, k, v, sl, mask, backend="native")
    ref = reference.tree_attention(q.float(), k.float(), v.float(), sl, mask)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_rel(out.float(), ref, RTOL[dtype], f"native tree_attention {dtype}")


@pytest.mark.parametrize("Hq,Hkv,D,seqlens", [(9, 3, 64, [41, 0]), (4, 1, 40, [7, 130])])
def test_tree_attention_native_fp32_rows_do_not_depend_on_the_rest_of_the_tree(Hq, Hkv, D, seqlens):
    """fp32 rows are computed one at a time over (prefix, ancestors-or-self): node i's output with the
    whole tree equals, bit for bit, its output when the step holds only nodes 0..i (its ancestors come
    first in BFS order; i = 0 is a 1-token decoding step)."""
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


def test_tree_attention_native_ignores_rows_past_the_tree_and_checks_inputs():
    gen = torch.Generator().manual_seed(0)
    mask, _ = tree_from_parents(random_parents(5, gen))
    k, v = torch.randn(2, 20, 2, 64, generator=gen), torch.randn(2, 20, 2, 64, generator=gen)
    sl = torch.tensor([4, 9], dtype=torch.int32)
    q = torch.randn(2, 5, 4, 64, generator=gen)
    k[:, 14:], v[:, 14:] = float("nan"), float("nan")  # past the longest tree: never read
    k[0, 9:14], v[0, 9:14] = 1e3, -1e3  # past sequence 0's tree, inside sequence 1's: masked, finite
    out = hk.ops.tree_attention(q, k, v, sl, mask, sm_scale=0.07, backend="native")
    ref = reference.tree_attention(q, torch.nan_to_num(k), torch.nan_to_num(v), sl, mask, sm_scale=0.07)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, RTOL[torch.float32], "masked rows")
    with pytest.raises(RuntimeError, match="exceeds the cache"):
        hk.ops.tree_attention(q, k, v, torch.tensor([4, 16], dtype=torch.int32), mask, backend="native")


def test_tree_attention_native_is_a_cpu_kernel_only():
    """On other devices "native" has no tree_attention: auto resolution skips it, naming it fails clearly."""
    from hydra_kernels.ops.backend import has_impl, op_backend

    assert has_impl("tree_attention", "native", torch.device("cpu"))
    assert not has_impl("tree_attention", "native", torch.device("cuda"))
    assert op_backend("tree_attention", "native", torch.device("cuda")) == "auto"


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
    assert lin._packed is not None
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        assert_close_rel(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), RTOL[torch.float32], "module")
        big = torch.randn(MAX_PACKED_ROWS + 1, 48)
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))  # MKL path
        lin.weight.mul_(2.0)  # weights changed after packing: repacked before use
        assert_close_rel(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), RTOL[torch.float32], "repack")
    with torch.enable_grad():  # autograd: F.linear
        lin(x).sum().backward()
    assert lin.weight.grad is not None


def test_packed_kernel_off_switches_to_f_linear_and_back():
    torch.manual_seed(1)
    net = torch.nn.Sequential(Linear(48, 70), Linear(70, 33, bias=False))
    for m in net:
        m.pack_cpu()
    saved = [m._packed for m in net]
    x = torch.randn(5, 48)
    with torch.no_grad():
        with pytest.raises(ValueError, match="inside"):
            with packed_kernel_off(net):
                assert all(m._packed is None for m in net)
                assert torch.equal(net[0](x), torch.nn.functional.linear(x, net[0].weight, net[0].bias))
                raise ValueError("inside")  # restored even when the block fails
    assert all(m._packed is p for m, p in zip(net, saved))



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
