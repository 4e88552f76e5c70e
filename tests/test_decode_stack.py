"""The native decode stack (csrc/decode_stack_cpu.cpp, model/decode_stack.py): a CPU step's layers in one
native call give the Python layers' hidden states, logits, captured layer inputs and KV cache bit for bit, on
fp32 panels and on quantized panels, for a plain token, a shared tree and per-sequence trees of different
sizes (GQA, biases, batch 1 and 3); layers whose weights take F.linear stay on the Python path; the row norm
against its definition; bad inputs refused before anything is written."""
import numpy as np
import pytest
import torch

from hydra_kernels import Llama, LlamaConfig
from hydra_kernels.ops import reference
from hydra_kernels.model import decode_stack, layers
from hydra_kernels.model.packed_linear import Linear, packed_linear_available
from test_quantized_linear import panels_of, random_blocks
from helpers import random_tree, random_tree_batch

pytestmark = pytest.mark.skipif(not packed_linear_available() or decode_stack.DECODE_STACK is None,
                                reason="the packed CPU kernel (AVX-512) and the extension's decode_stack")


# quantized layouts per projection (group, bits, offset): kinds (+ 100 with fp16 scales) 41 / 80 (the embedded GGUF's Q4_1 / Q8_0 shapes) and
# 40 / 81 (Q4_0-like, and 8 bits with an offset)
LAYOUTS = {"a": {"wqkv": (32, 4, True), "w13": (32, 4, True), "wo": (16, 8, False), "w2": (16, 8, False)},
           "b": {"wqkv": (32, 4, False), "w13": (16, 8, True), "wo": (16, 8, True), "w2": (32, 4, False)}}


def model_of(quantized, bias: bool, seed: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> Llama:
    """quantized: False (fp32 panels), True or "a" / "b" (LAYOUTS; scales stored fp16), "a32" ("a" with fp32 scales)."""
    cfg = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=96, num_layers=3, num_heads=heads,
                      num_kv_heads=kv_heads, max_position_embeddings=128, attention_bias=bias)
    torch.manual_seed(seed)
    m = Llama(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
    m.use_packed_cpu_weights()
    if quantized:
        gen = torch.Generator().manual_seed(seed)
        for name, mod in m.named_modules():
            if isinstance(mod, Linear) and name != "output":
                G, bits, off = LAYOUTS["a" if quantized is True else quantized[:1]][name.rsplit(".", 1)[-1]]
                bw = random_blocks(mod.out_features, mod.in_features, G, bits, off, gen)
                mod.use_quantized(panels_of(bw, half=quantized != "a32"))
    return m


def run_steps(m: Llama, native: bool, monkeypatch, B: int, trees, capture=None, per_block: bool = False):
    """Prefill a ragged batch, then a plain step and the given tree steps (attention over rows [0, kv_len) of a
    larger buffer, as generate() runs them): every step's logits (and captured layer inputs), and the cache.
    native: the whole-stack call; per_block (with native False): each block as a one-layer stack
    (TransformerBlock._native_step, after the first layer); neither: the Python layers."""
    calls = []
    real = torch.ops.hydra_kernels.decode_stack

    def counting(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(decode_stack, "DECODE_STACK", counting if native else None)
    monkeypatch.setattr(layers, "_DECODE_STACK", counting if per_block else None)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (B, 9), generator=gen)
    lengths = torch.tensor([9, 5, 7][:B])
    cache = m.new_kv_cache(B, 64)
    cache.kv.fill_(float("nan"))  # rows a step writes are read back; the others must never be read
    outs = []

    def step(T, *tree):
        kv_len = int(cache.seqlens.max()) + T + 3
        got = m.step(torch.randint(0, 97, (B, T), generator=gen), cache, *tree, backends="native", capture=capture,
                     kv_len=kv_len)
        h, feats = got if capture is not None else (got, None)
        outs.append(m.output(h))
        if feats is not None:
            outs.append(feats)

    with torch.no_grad():
        m.prefill(tokens, lengths, cache)
        cache.seqlens.copy_(lengths.to(cache.seqlens.dtype))
        step(1)
        for mask, depths in trees:
            step(mask.shape[-1], mask, depths)
    steps = 1 + len(trees)
    want_calls = steps if native else (steps * (m.config.num_layers - 1) if per_block else 0)
    assert len(calls) == want_calls
    return outs, cache.kv.clone()


def assert_same(got, want, kv_got, kv_want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(g).all()
        assert torch.equal(g, w), f"output {i}: max |diff| {(g - w).abs().max().item():.3e}"
    assert torch.equal(kv_got.nan_to_num(7.0), kv_want.nan_to_num(7.0))


def trees_for(B: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shared = random_tree(gen, 5)  # one tree for the batch
    ragged = random_tree_batch(gen, [6, 2, 4][:B])[1]  # per-sequence trees of different sizes, padded
    return [(shared.mask, shared.depths), (ragged.mask, ragged.depths)]


@pytest.mark.parametrize("quantized", [False, "a", "b", "a32"])
@pytest.mark.parametrize("B,bias", [(1, False), (3, True)])
def test_decode_stack_is_the_python_layers_bit_for_bit(monkeypatch, quantized, B, bias):
    m = model_of(quantized, bias, seed=B + 2 * bool(quantized))
    kinds = decode_stack.stack_weights(m, 1)[1]  # fp16 scales: kind + 100
    assert kinds == [0] * 12 if not quantized else sorted(set(kinds)) == sorted(
        {100 * (quantized != "a32") + 10 * bits + off for _, bits, off in LAYOUTS[quantized[:1]].values()})
    trees = trees_for(B, B)
    want, kv_want = run_steps(m, False, monkeypatch, B, trees)
    got, kv_got = run_steps(m, True, monkeypatch, B, trees)
    assert_same(got, want, kv_got, kv_want)


@pytest.mark.parametrize("quantized", [False, "b"])
def test_blocks_stepped_one_at_a_time_are_the_python_layers(monkeypatch, quantized):
    """A block stepped alone (a drafter's own layers: Amphista's adaptation stages, EAGLE's layer) runs as a
    one-layer native stack once the step's first layer has checked the site: the Python block's values."""
    m = model_of(quantized, True, seed=11)
    trees = trees_for(3, 7)
    want, kv_want = run_steps(m, False, monkeypatch, 3, trees)
    got, kv_got = run_steps(m, False, monkeypatch, 3, trees, per_block=True)
    assert_same(got, want, kv_got, kv_want)


@pytest.mark.parametrize("capture", [(0,), (2, 0), (1, 2, 0)])
def test_captured_layer_inputs_are_the_python_layers(monkeypatch, capture):
    """EAGLE's verify steps capture layer inputs: the stack returns the same streams in the asked order."""
    m = model_of(True, False, seed=5)
    trees = trees_for(2, 3)
    want, kv_want = run_steps(m, False, monkeypatch, 2, trees, capture=capture)
    got, kv_got = run_steps(m, True, monkeypatch, 2, trees, capture=capture)
    assert got[1].shape[-1] == len(capture) * m.config.hidden_size
    assert_same(got, want, kv_got, kv_want)


def test_a_runs_memo_of_the_stack_weights_follows_every_change():
    """stack_weights keeps a run's result (KVCache.stack_memo) only while it is what a fresh walk would give: a norm's
    weight replaced, the packed kernel switched off and on, a block swapped each give the fresh walk's weights; a
    layer whose fp32 panels are rebuilt from a weight that may change in place is never memoized."""
    from hydra_kernels.model.packed_linear import packed_kernel_off

    m = model_of("a", False, seed=3)
    memo = {}
    first = decode_stack.stack_weights(m, 1, memo)
    assert first is not None and decode_stack.stack_weights(m, 5, memo) is first  # held panels: any row count
    m.layers[1].ffn_norm.weight = torch.nn.Parameter(torch.randn(64) * 0.3 + 1.0)
    second = decode_stack.stack_weights(m, 1, memo)
    assert second is not first and second[3][3] is m.layers[1].ffn_norm.weight
    with packed_kernel_off(m):
        assert decode_stack.stack_weights(m, 1, memo) is None  # the layers take F.linear: no stack
    third = decode_stack.stack_weights(m, 1, memo)
    assert third is not second and [w is v for w, v in zip(third[0], second[0])] == [True] * len(second[0])
    donor = model_of("b", False, seed=4)
    m.layers[2] = donor.layers[2]
    fourth = decode_stack.stack_weights(m, 1, memo)
    assert fourth[0][8:] == decode_stack.stack_weights(donor, 1)[0][8:] and fourth[1] != third[1]
    assert fourth[0][8] is donor.layers[2].attention.wqkv.step_weights(1)[0]
    # each returned spec is what a walk without a memo returns
    fresh = decode_stack.stack_weights(m, 1)
    assert all(all(a is b for a, b in zip(x, y)) for x, y in zip(fourth[:4], fresh[:4])) and fourth[4] == fresh[4]
    fp32 = model_of(False, False, seed=6)
    wo = fp32.layers[0].attention.wo
    wo.restore_original()  # the weight kept, its panels derived from it (rebuilt when it changes)
    memo = {}
    before = decode_stack.stack_weights(fp32, 1, memo)
    assert not wo.holds_panels and "stack" not in memo
    with torch.no_grad():
        wo.weight.add_(1.0)  # changed in place: no attribute assigned
    after = decode_stack.stack_weights(fp32, 1, memo)
    assert torch.equal(after[0][1], before[0][1] + 1.0)  # the panels rebuilt from the changed weight


@pytest.mark.parametrize("hidden,heads,kv_heads", [(40, 5, 1), (60, 6, 3), (28, 2, 2)])
def test_awkward_shapes(monkeypatch, hidden, heads, kv_heads):
    """H not a multiple of the norm's 16 lanes, odd head counts, head_dim 8 / 10 / 14 (the norm's tail, RoPE's
    halves), MQA, and no GQA."""
    m = model_of(False, True, seed=hidden, hidden=hidden, heads=heads, kv_heads=kv_heads)  # panels: any K
    trees = trees_for(3, hidden)
    want, kv_want = run_steps(m, False, monkeypatch, 3, trees)
    got, kv_got = run_steps(m, True, monkeypatch, 3, trees)
    assert_same(got, want, kv_got, kv_want)


def lane_order_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_rows' definition in numpy fp32 (IEEE ops elementwise; torch may divide by a scalar as a product
    with its reciprocal): element i of a row adds x_i * x_i into lane i % 16 in increasing i, the lanes fold
    16 -> 8 -> 4 -> 2 -> 1, then y = (x * r) * w, r = 1 / sqrt(sum / H + eps)."""
    xs, ws = x.numpy(), w.numpy()
    H = xs.shape[-1]
    sq = np.pad(xs * xs, [(0, 0)] * (xs.ndim - 1) + [(0, (-H) % 16)])
    sq = sq.reshape(sq.shape[:-1] + (-1, 16))  # [..., n, 16]
    acc = np.zeros(sq.shape[:-2] + (16,), np.float32)
    for j in range(sq.shape[-2]):
        acc = acc + sq[..., j, :]
    s = 8
    while s:
        acc = acc[..., :s] + acc[..., s:2 * s]
        s //= 2
    r = np.float32(1) / np.sqrt(acc / np.float32(H) + np.float32(eps))
    return torch.from_numpy((xs * r) * ws)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 37), (2, 700, 64), (1, 16), (4, 1)])
def test_rms_norm_rows_is_its_definition_bit_for_bit(shape):
    """The row norm that RMSNorm.forward and the stack share: its lane order exactly, whatever the row count
    (700 rows split across threads), and within fp32 tolerance of the reference norm."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    got = layers.RMS_NORM_ROWS(x, w, 1e-5)
    assert torch.equal(got, lane_order_rms_norm(x, w, 1e-5))
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    one = layers.RMS_NORM_ROWS(x.reshape(-1, shape[-1])[-1:], w, 1e-5)  # a row alone
    assert torch.equal(one[0], got.reshape(-1, shape[-1])[-1])


@pytest.mark.parametrize("shape", [(4, 37), (2, 3, 64)])
def test_rms_norm_module_is_the_native_norm_with_and_without_autograd(shape):
    """The same values whether or not a graph is kept (training sees what decoding computes), and the op's
    backward gives torch.rms_norm's gradients within fp32 rounding."""
    from hydra_kernels.model.layers import RMSNorm
    gen = torch.Generator().manual_seed(shape[-1])
    n = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = torch.randn(shape, generator=gen) * 2
    g = torch.randn(shape, generator=gen)
    with torch.no_grad():
        y0 = n(x)
    assert torch.equal(y0, layers.RMS_NORM_ROWS(x, n.weight, 1e-6))
    with torch.enable_grad():
        xg = x.clone().requires_grad_()
        y = n(xg)
        assert torch.equal(y.detach(), y0)
        y.backward(g)
        w2 = n.weight.detach().clone().requires_grad_()
        x2 = x.clone().requires_grad_()
        torch.rms_norm(x2, (shape[-1],), w2, 1e-6).backward(g)
    torch.testing.assert_close(xg.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(n.weight.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_bad_rows_are_refused_before_anything_is_written(monkeypatch):
    """A cache row outside the buffer, a committed length past kv_len, float rows, a bias of the wrong length or fp32
    panels of the wrong width are refused by the op before any layer runs (the KV buffer unchanged); a seqlens past the buffer by the Python check, with its message,
    before the op is called."""
    m = model_of(True, False, seed=1)
    cache = m.new_kv_cache(1, 16)
    with torch.no_grad():
        m.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]), cache)
        cache.seqlens.fill_(3)
        m.step(torch.tensor([[4]]), cache, backends="native")  # the good case runs
        before = cache.kv.clone()
        a, f = m.layers[0].attention, m.layers[0].feed_forward
        weights, kinds, biases, norms, eps = decode_stack.stack_weights(m, 1)
        x = torch.randn(1, 1, 64)
        cos, sin = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
        with pytest.raises(RuntimeError, match="outside the buffer"):
            decode_stack.DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter, cos, sin,
                                      cache.kv, torch.tensor([[16]]), cache.seqlens, torch.ones(1, 1, dtype=torch.bool),
                                      16, [])
        assert torch.equal(cache.kv.nan_to_num(7.0), before.nan_to_num(7.0))
        with pytest.raises(RuntimeError, match="must lie in"):  # seqlens past kv_len: refused before layer 0 writes
            decode_stack.DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter, cos, sin,
                                      cache.kv, torch.tensor([[5]]), torch.tensor([5], dtype=torch.int32),
                                      torch.ones(1, 1, dtype=torch.bool), 5, [])
        with pytest.raises(RuntimeError, match="int64"):
            decode_stack.DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter, cos, sin,
                                      cache.kv, torch.tensor([[4.0]]), cache.seqlens, torch.ones(1, 1, dtype=torch.bool),
                                      16, [])
        wrong = list(biases)
        wrong[5] = torch.zeros(a.n_heads * a.head_dim + 1)  # layer 1's wo: a bias of the wrong length
        with pytest.raises(RuntimeError, match="bias 5 must be a contiguous fp32 vector of its projection's 64 outputs"):
            decode_stack.DECODE_STACK(x, weights, kinds, wrong, norms, eps, a.n_heads, a.n_kv_heads, f.inter, cos, sin,
                                      cache.kv, torch.tensor([[4]]), cache.seqlens, torch.ones(1, 1, dtype=torch.bool),
                                      16, [])
        assert torch.equal(cache.kv.nan_to_num(7.0), before.nan_to_num(7.0))
        # fp32 panels (kind 0) of the wrong input width where layer 1's w2 goes (its w13: 64 inputs, not 96)
        fp32 = model_of(False, False, seed=1)
        fp32_weights, fp32_kinds, _, _, _ = decode_stack.stack_weights(fp32, 1)
        swapped = list(fp32_weights)
        swapped[7] = fp32_weights[6]
        with pytest.raises(RuntimeError, match="a layer weight must be packed panels"):
            decode_stack.DECODE_STACK(x, swapped, fp32_kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter,
                                      cos, sin, cache.kv, torch.tensor([[4]]), cache.seqlens,
                                      torch.ones(1, 1, dtype=torch.bool), 16, [])
        assert torch.equal(cache.kv.nan_to_num(7.0), before.nan_to_num(7.0))
        monkeypatch.setattr(decode_stack, "DECODE_STACK", lambda *a: pytest.fail("called with bad seqlens"))
        cache.seqlens.fill_(16)
        with pytest.raises(ValueError, match="cache_seqlens"):
            m.step(torch.tensor([[4]]), cache, backends="native")


def test_layers_on_f_linear_keep_the_python_path(monkeypatch):
    """Without packed weights (e.g. packed_kernel_off) the stack is never called."""
    m = model_of(False, False, seed=0)
    monkeypatch.setattr(decode_stack, "DECODE_STACK", lambda *a: pytest.fail("stack called"))
    cache = m.new_kv_cache(1, 32)
    m.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]), cache)
    for mod in m.modules():
        if isinstance(mod, Linear):
            mod.restore_original()
            mod.packed_on = False
    with torch.no_grad():
        cache.seqlens.fill_(3)
        m.step(torch.tensor([[4]]), cache, backends="native")


def test_ops_pass_torch_library_opcheck():
    """Schemas (kv written in place, nothing else), fake kernels (torch.compile traces Llama.step through them)
    and the row norm's autograd registration, checked by torch.library.opcheck."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 5, 37, generator=gen, requires_grad=True), torch.randn(37, generator=gen, requires_grad=True)
    torch.library.opcheck(torch.ops.hydra_kernels.rms_norm_rows.default, (x, w, 1e-5))
    m = model_of("a", True, seed=2)
    weights, kinds, biases, norms, eps = decode_stack.stack_weights(m, 2)
    a, f = m.layers[0].attention, m.layers[0].feed_forward
    kv = torch.randn(3, 2, 2, 16, 2, 16, generator=gen)
    cos, sin = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    mask = torch.ones(2, 2, dtype=torch.bool).tril_()
    args = (torch.randn(2, 2, 64, generator=gen), weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter,
            cos, sin, kv, torch.tensor([[4, 5], [9, 10]]), torch.tensor([4, 9], dtype=torch.int32), mask, 12, [0, 2])
    torch.library.opcheck(torch.ops.hydra_kernels.decode_stack.default, args)
    torch.library.opcheck(torch.ops.hydra_kernels.decode_stack.default, (*args, torch.tensor([0, 1])))  # attend
