"""The native quantized linear (csrc/quantized_linear_cpu.cpp: pack_quantized_weight / quantized_linear /
quantized_rows; its panel loop over threads, row tiles and the padded bias row is csrc/panel_loop.h, shared
with the fp32 kernel, so these shapes test it on every ISA) on fresh random blocks with awkward shapes, on every ISA this machine runs (the AVX2 and
portable paths forced on an AVX-512 machine): bit-identical to the fp32 packed kernel on the dequantized
weight (its definition: the same in-order FMA chain), within fp32 accuracy of an fp64 matmul, each row
independent of the rows beside it; the GGUF block decoders against gguf's own dequantize, bit for bit."""
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_kernels.model.gguf_blocks import DECODERS, BlockWeight, concat_rows, decode_blocks
from hydra_kernels.model.packed_linear import Linear, packed_kernel_off
from hydra_kernels.ops.quantized_linear import (ISA_AVX2, ISA_AVX512, ISA_PORTABLE, QuantizedPanels,
                                                quantized_linear_isa)
from helpers import RTOL, assert_close_rel

pytestmark = pytest.mark.requires("native")
ops = torch.ops.hydra_kernels


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags()
ISAS = [ISA_PORTABLE] + ([ISA_AVX2] if {"avx2", "fma"} <= FLAGS else []) + ([ISA_AVX512] if "avx512f" in FLAGS else [])


def random_blocks(N: int, K: int, G: int, bits: int, offset: bool, gen: torch.Generator) -> BlockWeight:
    """Random integers in the format's range; scales and offsets fp16 values (as GGUF stores d and m), so
    s * q is exact and w = fma(s, q, o) rounds once, as in every format with an offset."""
    if bits == 4:
        q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    s = (torch.randn(N, K // G, generator=gen) * 0.02).half().float()
    o = (torch.randn(N, K // G, generator=gen) * 0.1).half().float() if offset else None
    return BlockWeight(q.numpy(), s.numpy(), None if o is None else o.numpy(), bits)


def poison_then(fn):
    """Free a NaN-filled block the size of the output just before the kernel allocates its own, so an output
    element it never writes is likely to show garbage (the allocator hands freed blocks out again)."""
    def run(*args):
        y = fn(*args)
        junk = torch.full_like(y, float("nan"))
        del junk
        return fn(*args)
    return run


def panels_of(bw: BlockWeight, half: bool) -> QuantizedPanels:
    """bw's panels with fp16 (half) or fp32 scales and offsets (random_blocks' scales are fp16 values: either holds them)."""
    o = None if bw.o is None else torch.from_numpy(bw.o)
    return QuantizedPanels.pack(torch.from_numpy(bw.q), torch.from_numpy(bw.s), o, bw.bits, half=half)


@pytest.mark.parametrize("N,K,G,bits,offset", [
    (130, 96, 32, 4, True),     # Q4_1 / Q4_K-like, N not a multiple of the 64-row panel
    (960, 576, 32, 4, True),    # SmolLM2's wqkv
    (65, 64, 16, 4, False),     # 4 bits, no offset, small groups
    (96, 272, 16, 4, True),     # Q2_K / Q3_K-like: 4 bits, groups of 16 with an offset
    (100, 160, 32, 8, False),   # Q8_0-like
    (1, 48, 16, 8, False),      # Q6_K-like groups of 16, one output row
    (70, 80, 16, 8, True),      # 8 bits with an offset (a fused weight of mixed parts)
])
@pytest.mark.parametrize("M", [1, 2, 6, 7, 13, 64])
@pytest.mark.parametrize("half", [False, True])  # scales and offsets stored fp32 / fp16
def test_quantized_linear_is_the_fp32_kernel_on_the_dequantized_weight(N, K, G, bits, offset, M, half):
    gen = torch.Generator().manual_seed(N * K + M + bits)
    bw = random_blocks(N, K, G, bits, offset, gen)
    panels = panels_of(bw, half)
    assert panels.nbytes == (panels.packed.shape[0] * (K // G) * (64 * (2 if half else 4) * (2 if offset else 1)
                                                                    + G * 64 * bits // 8))
    w = torch.from_numpy(bw.dequantize())
    assert torch.equal(panels.dequantize(), w)
    x = torch.randn(M, K, generator=gen)
    b = torch.randn(N, generator=gen) if M % 2 else None
    ref = ops.packed_linear(x, ops.pack_linear_weight(w), N, b)  # the same FMA chain on fp32 panels
    for isa in ISAS:
        y = poison_then(lambda: panels.linear(x, b, isa))()
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert torch.equal(y, ref), f"isa {isa}: max |diff| {(y - ref).abs().max().item():.3e}"
        # a row's result does not depend on the rows beside it (a token alone or inside a tree)
        assert torch.equal(torch.cat([panels.linear(x[i:i + 1], b, isa) for i in range(M)]), y)
    f64 = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert_close_rel(ref, f64, RTOL[torch.float32], "quantized_linear vs fp64")


@pytest.mark.parametrize("N", [1, 150, 300, 9 * 64, 15 * 64])  # odd panel counts; last panels of <= 32 and > 32 columns
@pytest.mark.parametrize("M", [1, 7])
@pytest.mark.parametrize("half", [False, True])
def test_quantized_linear_splits_half_panels_over_the_threads_without_changing_a_value(N, M, half):
    """The threads split half panels (csrc/panel_loop.h), so an odd panel count divides evenly: at 2, 3 and 4
    threads every ISA's output equals one thread's bit for bit (a lone half panel at a thread's ends runs the
    half-panel kernels: AVX-512 J = 2, AVX2 one half call, the portable column range)."""
    gen = torch.Generator().manual_seed(N + M)
    panels = panels_of(random_blocks(N, 96, 32, 4, True, gen), half)
    x, b = torch.randn(M, 96, generator=gen), torch.randn(N, generator=gen)
    threads = torch.get_num_threads()
    try:
        for isa in ISAS:
            torch.set_num_threads(1)
            one = panels.linear(x, b, isa)
            for n in (2, 3, 4):
                torch.set_num_threads(n)
                assert torch.equal(poison_then(lambda: panels.linear(x, b, isa))(), one), f"isa {isa}, {n} threads"
    finally:
        torch.set_num_threads(threads)


def test_quantized_linear_takes_any_leading_shape_and_the_rows_op_gathers():
    gen = torch.Generator().manual_seed(1)
    bw = random_blocks(70, 64, 32, 4, True, gen)
    panels = bw.panels()
    x = torch.randn(2, 3, 64, generator=gen)
    assert torch.equal(panels.linear(x), panels.linear(x.reshape(6, 64)).reshape(2, 3, 70))
    ids = torch.tensor([69, 0, 64, 5, 5])
    assert torch.equal(panels.rows(ids), torch.from_numpy(bw.dequantize())[ids])
    assert panels.linear(x[:0]).shape == (0, 3, 70)


@pytest.mark.parametrize("bits,offset", [(4, False), (4, True), (8, False), (8, True)])
@pytest.mark.parametrize("half", [False, True])
def test_selected_rows_are_panels_of_the_same_values(bits, offset, half):
    """QuantizedPanels.select_rows (a drafter's draft-vocabulary rows of a quantized LM head): the same exact
    values as the rows op, and its linear is the whole weight's columns bit for bit (rows across panel edges,
    the last padded panel, repeats, any order), scales stored as the source's; ids out of range are refused."""
    gen = torch.Generator().manual_seed(2)
    panels = panels_of(random_blocks(200, 96, 32, bits, offset, gen), half)
    ids = torch.tensor([5, 199, 0, 64, 63, 128, 5, 77, 191])
    sub = panels.select_rows(ids)
    assert (sub.n, sub.k, sub.bits, sub.offset, sub.half) == (9, 96, bits, offset, half)
    assert torch.equal(sub.dequantize(), panels.rows(ids))
    x = torch.randn(3, 96, generator=gen)
    assert torch.equal(sub.linear(x), panels.linear(x)[:, ids])
    with pytest.raises(ValueError, match="row ids"):
        panels.select_rows(torch.tensor([200]))


def test_quantized_ops_check_their_inputs():
    gen = torch.Generator().manual_seed(2)
    bw = random_blocks(70, 64, 32, 4, True, gen)
    assert bw.panels().half  # fp16-valued scales are stored fp16 by default
    p = panels_of(bw, False)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        p.linear(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.quantized_linear(torch.randn(2, 64), p.packed, 200, 4, True, None, 0)
    with pytest.raises(RuntimeError, match=r"x must be fp32 \[..., K=40\]"):  # read as 8-bit: 20-input groups
        ops.quantized_linear(torch.randn(2, 64), p.packed, 70, 8, False, None, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quantized_linear(torch.randn(2, 64), p.packed[:, :, :1000].contiguous(), 70, 4, True, None, 0)
    with pytest.raises(RuntimeError, match="isa must be"):
        p.linear(torch.randn(2, 64), None, 7)
    with pytest.raises(RuntimeError, match="does not fit bits=8, offset=1, half_scales=1"):  # fp32 headers read as fp16
        ops.quantized_linear(torch.randn(2, 64), p.packed[:, :, :1000 + 256].contiguous(), 70, 8, True, None, 0, True)
    with pytest.raises(RuntimeError, match="half_scales needs every scale and offset to be an fp16 value, got 0.1"):
        ops.pack_quantized_weight(torch.zeros(4, 32, dtype=torch.int8), torch.full((4, 1), 0.1), None, 4, True)
    with pytest.raises(RuntimeError, match="4-bit q must hold values 0..15"):
        ops.pack_quantized_weight(torch.full((4, 32), 16, dtype=torch.int8), torch.ones(4, 1), None, 4)
    with pytest.raises(RuntimeError, match="G dividing K"):
        ops.pack_quantized_weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 3), None, 8)
    with pytest.raises(RuntimeError, match="outside"):
        p.rows(torch.tensor([70]))


def test_isa_report_matches_the_machine():
    """csrc/cpu_features.h decides the kernel's path: AVX-512 where the CPU has it, else AVX2 + FMA."""
    want = ISA_AVX512 if "avx512f" in FLAGS else (ISA_AVX2 if {"avx2", "fma"} <= FLAGS else ISA_PORTABLE)
    assert quantized_linear_isa() == want


# ---- GGUF block formats --------------------------------------------------------------------------------------
def gguf_random_blocks(name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of n_blocks blocks of GGML type `name`, with finite fp16 scale fields (d, m, dmin)."""
    block_bytes = DECODERS[name][0]
    b = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    f16 = lambda k: rng.normal(0, 0.05, (n_blocks, k)).astype(np.float16).view(np.uint8)  # noqa: E731
    if name in ("Q4_0", "Q8_0", "Q5_0"):
        b[:, :2] = f16(1)
    elif name in ("Q4_1", "Q4_K", "Q5_1", "Q5_K"):
        b[:, :4] = f16(2)
    elif name in ("Q6_K", "Q3_K"):
        b[:, -2:] = f16(1)
    elif name == "Q2_K":
        b[:, -4:] = f16(2)
    return b


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_gguf_blocks_decode_to_ggufs_own_values(name):
    """(q, s, o) of every supported format dequantize, in the kernel too, to gguf's fp32 values bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(len(name))
    block_size = DECODERS[name][1]
    N, K = 5, 3 * block_size
    data = gguf_random_blocks(name, N * K // block_size, rng).reshape(N, -1)
    want = dequantize(data, GGMLQuantizationType[name]).reshape(N, K).astype(np.float32)
    bw = decode_blocks(data, name, (N, K))
    assert np.array_equal(bw.dequantize(), want)
    panels = bw.panels()
    assert torch.equal(panels.dequantize(), torch.from_numpy(want))
    x = torch.randn(3, K)
    assert torch.equal(panels.linear(x), ops.packed_linear(x, ops.pack_linear_weight(torch.from_numpy(want)), N))


def test_gguf_blocks_refuse_a_wrong_size_and_an_unknown_type():
    with pytest.raises(ValueError, match="holds 10 bytes"):
        decode_blocks(np.zeros((1, 10), np.uint8), "Q8_0", (1, 32))
    with pytest.raises(ValueError, match="not decoded"):
        decode_blocks(np.zeros((1, 18), np.uint8), "IQ4_NL", (1, 32))


def test_fused_parts_of_different_formats_share_the_widest_layout_losslessly():
    """q / k / v in Q4_K, Q6_K and Q8_0 (as a Q4_K_M file mixes them) -> one 8-bit, G = 16 weight with offsets."""
    rng = np.random.default_rng(3)
    N, K = 2, 512  # two rows of each part
    parts = [decode_blocks(gguf_random_blocks(n, N * K // DECODERS[n][1], rng).reshape(N, -1), n, (N, K))
             for n in ("Q4_K", "Q6_K", "Q8_0")]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group, fused.o is not None) == (8, 16, True)
    assert np.array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    assert torch.equal(fused.panels().dequantize(), torch.from_numpy(fused.dequantize()))


def test_linear_on_quantized_panels_holds_only_them_and_switches_off_and_back():
    gen = torch.Generator().manual_seed(4)
    bw = random_blocks(70, 64, 32, 4, True, gen)
    lin = Linear(64, 70, bias=True)
    assert lin.use_quantized(bw.panels())
    assert lin.released and lin.weight.is_meta and lin.packed_on
    x = torch.randn(5, 64, generator=gen)
    w = torch.from_numpy(bw.dequantize())
    with torch.no_grad():
        y = lin(x)
        assert torch.equal(y, ops.packed_linear(x, ops.pack_linear_weight(w), 70, lin.bias))
        assert torch.equal(lin(torch.randn(100, 64)).isnan().any(), torch.tensor(False))  # any M (prefill)
        with packed_kernel_off(lin):
            assert not lin.released and torch.equal(lin.weight, w)
            assert_close_rel(lin(x), y, RTOL[torch.float32], "F.linear")
        assert isinstance(lin._panels, QuantizedPanels) and torch.equal(lin(x), y)  # the same panels back
    assert torch.equal(lin.state_dict()["weight"], w)
    with pytest.raises(ValueError, match="quantized panels of shape"):
        Linear(64, 71).use_quantized(bw.panels())
