"""The int8 dot kernel (csrc/int8_dot_linear_cpu.cpp, ops/int8_dot_linear.py): on fresh random weights of both widths,
with and without offsets, fp16 and fp32 scales, groups of 4, 16 and 32 inputs, odd N (partial panels and halves) and
M from 1 to 64 rows, its AVX-512 VNNI path, its AVX2 path and its portable loop give ops/reference.py's
int8_dot_linear (the definition) to a few fp32 ulps, and each other bit for bit; a row's output is the same alone and among others (the
property that keeps speculative decoding lossless on it); its error from the exact fp32 linear stays inside the
rounding bound of its int8 activations; the layout round-trips to the weight's integers, scales and offsets; bad input
is refused with a message."""
import pytest
import torch

from hydra_kernels.ops import reference
from hydra_kernels.ops.int8_dot_linear import (DOT_ISA_AVX2, DOT_ISA_PORTABLE, DOT_ISA_VNNI, Int8DotPanels,
                                               int8_dot_linear_isa)
from hydra_kernels.ops.quantized_linear import QuantizedPanels
from test_quantized_linear import FLAGS, poison_then, random_blocks

pytestmark = pytest.mark.skipif(int8_dot_linear_isa() == 0, reason="the extension is not built")

# every path this machine runs (HK_CPU_ISA may limit them): the portable loop, AVX2, AVX-512 VNNI
ISAS = [i for i in (DOT_ISA_PORTABLE, DOT_ISA_AVX2, DOT_ISA_VNNI) if i <= int8_dot_linear_isa()]


def weight(N: int, K: int, G: int, bits: int, offset: bool, gen: torch.Generator):
    """(q, scales, offsets) tensors of test_quantized_linear's random_blocks: q in the format's range, scales and
    offsets fp16 values (as GGUF stores d and m)."""
    bw = random_blocks(N, K, G, bits, offset, gen)
    return torch.from_numpy(bw.q), torch.from_numpy(bw.s), None if bw.o is None else torch.from_numpy(bw.o)


def activations(M: int, K: int, G: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows with the awkward groups a model gives: an all-zero group (a = 0) and one with a single non-zero
    input; a group whose scaled inputs tie at .5 (max 127: 127 / a = 1 exactly, so 0.5, 1.5, 2.5, -2.5 round half to
    even); a group below the smallest finite scale (127 / a overflows: all 0); a row of tiny values and one of large."""
    x = torch.randn(M, K, generator=gen) * 2.0
    x[0, :G] = 0.0
    if K >= 2 * G:
        x[0, G:2 * G] = 0.0
        x[0, G + 1] = -3.5
    if K >= 3 * G:
        x[0, 2 * G:3 * G] = 1e-38 * torch.randn(G, generator=gen)  # a ~ 1e-38: 127 / a is inf
    if M > 1:
        x[1] *= 1e-6
        ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5])[:G]
        x[1, :len(ties)] = ties
    if M > 2:
        x[2] *= 1e4
    return x


def dequantized(q, s, o):
    G = q.shape[1] // s.shape[1]
    w = s.repeat_interleave(G, 1) * q.float()
    return w if o is None else w + o.repeat_interleave(G, 1)


# N: last panels of 6, 8, 64, 31, 1, 2, 36 and 63 columns (a second half partly filled); G: 4 to 32 (8 and 24: the
# VNNI path's rows quantized by the portable loop, the AVX2 path's by its own)
@pytest.mark.parametrize("N,K,G", [(70, 96, 32), (200, 64, 16), (64, 128, 32), (31, 40, 4), (1, 32, 32), (130, 576, 32),
                                   (100, 48, 8), (127, 72, 24)])
@pytest.mark.parametrize("bits,offset", [(4, True), (4, False), (8, False), (8, True)])
@pytest.mark.parametrize("half", [True, False])
def test_every_path_computes_the_definition(N, K, G, bits, offset, half):
    gen = torch.Generator().manual_seed(N * 1000 + K + bits + offset + half)
    q, s, o = weight(N, K, G, bits, offset, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, bits, half))
    b = torch.randn(N, generator=gen)
    for M in (1, 2, 5, 6, 7, 13, 64):  # tiles of 6 (VNNI) and 4 (AVX2) rows, full and partial
        x = activations(M, K, G, gen)
        want = reference.int8_dot_linear(x, q, s, o, b)
        outs = [poison_then(lambda x, isa=isa: d.linear(x, b, isa=isa))(x) for isa in ISAS]
        torch.testing.assert_close(outs[0], want, rtol=4 * 2.0 ** -23, atol=1e-6)  # fp32: a few ulps (docstring)
        for y in outs[1:]:
            assert torch.equal(y, outs[0]), "a vector path and the portable loop differ"
        alone = torch.cat([d.linear(x[i:i + 1], b) for i in range(M)])
        assert torch.equal(outs[-1], alone), f"a row's output depends on the other rows (M={M})"


@pytest.mark.parametrize("bits,offset", [(4, True), (8, False)])
def test_its_error_from_the_exact_linear_is_the_int8_rounding_and_no_more(bits, offset):
    """|x - d xq| <= d / 2 per input (round to nearest), so |y - x W^T| <= sum over groups of d / 2 * sum |w| (+ fp32
    rounding): a bound from the activation format, not a tolerance picked to pass."""
    gen = torch.Generator().manual_seed(7)
    N, K, G = 96, 256, 32
    q, s, o = weight(N, K, G, bits, offset, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, bits, True))
    x = torch.randn(5, K, generator=gen)
    w = dequantized(q, s, o)
    exact = (x.double() @ w.double().T)
    dq = x.reshape(5, K // G, G).abs().amax(-1) / 127  # [M, NG]
    bound = (dq[:, None, :].double() / 2 * w.abs().reshape(N, K // G, G).sum(-1).double()).sum(-1)  # [M, N]
    err = (d.linear(x).double() - exact).abs()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0  # it is not the exact kernel


@pytest.mark.parametrize("N", [1, 150, 9 * 64, 15 * 64])  # odd panel counts; last panels of <= 32 and > 32 columns
def test_the_threads_half_panel_split_changes_no_value(N):
    gen = torch.Generator().manual_seed(N)
    q, s, o = weight(N, 64, 32, 4, True, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, 4, True))
    x = activations(7, 64, 32, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = d.linear(x)
        torch.set_num_threads(2)
        assert torch.equal(d.linear(x), one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, reference.int8_dot_linear(x, q, s, o)) or torch.allclose(
        one, reference.int8_dot_linear(x, q, s, o), rtol=4 * 2.0 ** -23, atol=1e-6)


@pytest.mark.parametrize("bits,offset", [(4, False), (4, True), (8, False), (8, True)])
@pytest.mark.parametrize("half", [False, True])
def test_the_layout_holds_the_weights_integers_scales_and_offsets(bits, offset, half):
    """A layer keeps only the dot layout: its groups, rows, dequantized weight and selected rows come back exactly."""
    gen = torch.Generator().manual_seed(bits + 2 * offset + 4 * half)
    q, s, o = weight(131, 64, 16, bits, offset, gen)
    p = QuantizedPanels.pack(q, s, o, bits, half)
    d = Int8DotPanels.of(p)
    assert d.packed is None and d.nbytes == d.dot.numel()
    q2, s2, o2 = d.groups()
    assert torch.equal(q2, q) and torch.equal(s2, s) and (o is None or torch.equal(o2, o))
    ids = torch.tensor([0, 130, 64, 5, 5])
    assert torch.equal(d.rows(ids), p.rows(ids))
    assert torch.equal(d.dequantize(), dequantized(q, s, o)) or torch.equal(d.dequantize(), p.dequantize())
    assert torch.equal(d.select_rows(ids).dequantize(), p.select_rows(ids).dequantize())
    kept = Int8DotPanels.of(p, keep_exact=True)
    assert kept.packed is p.packed and kept.kind == 1000 + p.kind


def test_bad_input_is_refused_with_a_message():
    ops = torch.ops.hydra_kernels
    gen = torch.Generator().manual_seed(0)
    q, s, o = weight(8, 12, 6, 4, True, gen)
    with pytest.raises(RuntimeError, match="groups must hold a multiple of 4 inputs here, got 6"):
        ops.pack_int8_dot_weight(q, s, o, 4, True)
    q, s, o = weight(8, 64, 32, 4, True, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, 4, True))
    with pytest.raises(RuntimeError, match=r"x must be fp32 \[..., K=64\]"):
        d.linear(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        d.linear(torch.randn(2, 64), torch.randn(9))
    with pytest.raises(RuntimeError, match="isa must be"):
        d.linear(torch.randn(2, 64), isa=4)
    with pytest.raises(RuntimeError, match="4-bit q must hold values 0..15"):
        ops.pack_int8_dot_weight(q - 1, s, o, 4, True)
    with pytest.raises(RuntimeError, match="N=200 does not match 1 panels"):
        ops.int8_dot_linear(torch.randn(2, 64), d.dot, 200, 4, True, None, 0, True)
    with pytest.raises(RuntimeError, match="uint8 \\[P, 2, K/G, group bytes\\]"):
        ops.int8_dot_linear(torch.randn(2, 64), d.dot[0], 8, 4, True, None, 0, True)
    if int8_dot_linear_isa() < DOT_ISA_VNNI:
        with pytest.raises(RuntimeError, match="no AVX-512 VNNI"):
            d.linear(torch.randn(2, 64), isa=DOT_ISA_VNNI)


def test_isa_report_matches_the_machine():
    import os

    limit = os.environ.get("HK_CPU_ISA", "avx512")
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= FLAGS and limit == "avx512"
    avx2 = {"avx2", "fma", "f16c"} <= FLAGS and limit != "portable"
    assert int8_dot_linear_isa() == (DOT_ISA_VNNI if vnni else DOT_ISA_AVX2 if avx2 else DOT_ISA_PORTABLE)


def test_op_passes_torch_library_opcheck():
    """The schema, the fake (meta) kernel of ops/native.py and the CPU kernel agree (torch.compile traces it)."""
    gen = torch.Generator().manual_seed(3)
    q, s, o = weight(70, 64, 32, 4, True, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, 4, True))
    torch.library.opcheck(torch.ops.hydra_kernels.int8_dot_linear.default,
                          (torch.randn(2, 3, 64, generator=gen), d.dot, 70, 4, True, torch.randn(70, generator=gen), 0,
                           True), test_utils=("test_schema", "test_faketensor"))



@pytest.mark.parametrize("bits,offset", [(4, True), (8, False)])
def test_a_group_with_an_inf_or_a_nan_makes_its_row_nan_on_every_path(bits, offset):
    """The definition's non-finite case: such a group has no scale (d = NaN), so its row's outputs are NaN, as the
    exact kernel's are; the other rows keep their values."""
    gen = torch.Generator().manual_seed(11)
    q, s, o = weight(70, 96, 32, bits, offset, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, bits, True))
    x = torch.randn(4, 96, generator=gen)
    x[1, 40] = float("inf")
    x[2, 70] = float("nan")
    want = reference.int8_dot_linear(x, q, s, o)
    assert want[1:3].isnan().all() and not want[[0, 3]].isnan().any()
    for isa in ISAS:
        y = d.linear(x, isa=isa)
        torch.testing.assert_close(y, want, rtol=4 * 2.0 ** -23, atol=1e-6, equal_nan=True)
        assert torch.equal(y[[0, 3]], d.linear(x[[0, 3]], isa=isa))


def test_many_rows_quantized_over_the_threads_are_each_rows_own():
    """A prefill chunk's rows (more than one thread's share of the quantization) give each row's 1-row values."""
    gen = torch.Generator().manual_seed(12)
    q, s, o = weight(96, 64, 32, 4, True, gen)
    d = Int8DotPanels.of(QuantizedPanels.pack(q, s, o, 4, True))
    x = torch.randn(1100, 64, generator=gen)
    y = d.linear(x)
    for i in (0, 1023, 1024, 1099):
        assert torch.equal(y[i], d.linear(x[i:i + 1])[0])
    torch.testing.assert_close(y, reference.int8_dot_linear(x, q, s, o), rtol=4 * 2.0 ** -23, atol=1e-6)
