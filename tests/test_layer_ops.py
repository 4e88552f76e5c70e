"""The base model's fused layer ops (ops/layer_ops.py: rms_norm with the residual add, rope_write_kv, silu_mul)
against their definitions (ops/reference.py) on fresh random inputs: odd sizes, batch 1, T = 1, GQA ratios,
every dtype, outputs poisoned before the run; then a Llama step through them against the module path
(token for token in fp32 on a random model, the hidden states within the dtype's tolerance)."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, RTOL, assert_close_rel, poison_allocations

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.backends("reference", "triton", op="rms_norm")
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (2, 7, 37), (1, 2, 4096), (5, 1000)])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_reference(backend, shape, with_add, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(shape[-1] + len(shape) + with_add)
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype)
    add = (torch.randn(*shape, generator=gen) * 2).to(DEV, dtype) if with_add else None
    w = (1 + torch.randn(shape[-1], generator=gen) / 4).to(DEV, dtype)
    want = reference.rms_norm(x, w, 1e-5, add)
    poison_allocations(monkeypatch)
    got = hk.ops.rms_norm(x, w, 1e-5, add=add, backend=backend)
    if with_add:
        assert torch.equal(got[0], want[0]), "the residual sum rounds once in the dtype: exact"
        got, want = got[1], want[1]
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert_close_rel(got.float(), want.float(), RTOL[dtype], f"rms_norm {backend} {dtype}")


@pytest.mark.backends("reference", "triton", op="rope_write_kv")
@pytest.mark.parametrize("B,T,NQ,NKV,D", [(1, 1, 4, 2, 64), (3, 5, 6, 2, 32), (2, 7, 9, 3, 16), (1, 3, 8, 8, 128),
                                          (2, 1, 32, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_equals_reference(backend, B, T, NQ, NKV, D, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + NQ + D)
    S = 40
    qkv = torch.randn(B, T, NQ + 2 * NKV, D, generator=gen).to(DEV, dtype)
    ang = torch.rand(B, T, D, generator=gen) * 6.3
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    # each sequence its own rows (a ragged batch: different committed lengths)
    starts = torch.randint(0, S - T, (B, 1), generator=gen)
    rows = (starts + torch.arange(T)).to(DEV)
    kv = torch.randn(2, B, S, NKV, D, generator=gen).to(DEV, dtype)
    kv_want = kv.clone()
    q_want = reference.rope_write_kv(qkv, cos, sin, kv_want, rows, NQ, NKV)
    poison_allocations(monkeypatch)
    q = hk.ops.rope_write_kv(qkv, cos, sin, kv, rows, NQ, NKV, backend=backend)
    assert q.shape == (B, T, NQ, D) and q.dtype == dtype
    # the products and the sum round as torch's separate ops do: equal bit for bit
    assert torch.equal(q, q_want), f"q differs by {(q.float() - q_want.float()).abs().max()}"
    assert torch.equal(kv, kv_want), "the cache rows (and only they) hold rope(k) and v"


@pytest.mark.backends("reference", "triton", op="silu_mul")
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (3, 5, 2 * 96), (2, 7, 2 * 37), (4, 2 * 2500)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_reference(backend, shape, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(shape[-1] + len(shape))
    gu = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype)
    want = reference.silu_mul(gu)
    poison_allocations(monkeypatch)
    got = hk.ops.silu_mul(gu, backend=backend)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype and torch.isfinite(got).all()
    assert_close_rel(got.float(), want.float(), RTOL[dtype], f"silu_mul {backend} {dtype}")


@pytest.mark.backends("reference", "triton", op="rope_write_kv")
def test_rope_write_kv_strided_views(backend):
    """qkv as a strided view (a slice of a wider projection) and kv as one layer of a [L, 2, B, S, H, D] cache:
    the same values and cache rows as the reference, the other layers untouched."""
    gen = torch.Generator().manual_seed(11)
    B, T, NQ, NKV, D, S = 2, 3, 4, 2, 16, 12
    wide = torch.randn(B, T, NQ + 2 * NKV + 3, D, generator=gen).to(DEV, torch.bfloat16)
    qkv = wide[:, :, 3:]  # not contiguous over heads
    ang = torch.rand(B, T, D, generator=gen) * 6
    cos, sin = ang.cos().to(DEV, torch.bfloat16), ang.sin().to(DEV, torch.bfloat16)
    rows = torch.tensor([[4, 5, 6], [0, 1, 2]], device=DEV)
    cache = torch.randn(3, 2, B, S, NKV, D, generator=gen).to(DEV, torch.bfloat16)
    want_cache = cache.clone()
    q_want = reference.rope_write_kv(qkv, cos, sin, want_cache[1], rows, NQ, NKV)
    q = hk.ops.rope_write_kv(qkv, cos, sin, cache[1], rows, NQ, NKV, backend=backend)
    assert torch.equal(q, q_want) and torch.equal(cache, want_cache)


@pytest.mark.requires("triton", op="rope_write_kv")
def test_triton_rope_write_kv_never_writes_past_the_buffer():
    """A row outside [0, S) (nothing reads rows on the host in a GPU step) is dropped, not written into the
    memory after the sequence's rows; the other tokens' rows are written."""
    B, T, NQ, NKV, D, S = 2, 2, 2, 1, 8, 4
    qkv = torch.randn(B, T, NQ + 2 * NKV, D).to(DEV)
    cs = torch.ones(B, T, D, device=DEV)
    cache = torch.zeros(2, 2, B, S, NKV, D, device=DEV)  # two layers: layer 0's rows must stay zero
    rows = torch.tensor([[3, 4], [-1, 0]], device=DEV)
    hk.ops.rope_write_kv(qkv, cs, cs * 0, cache[1], rows, NQ, NKV, backend="triton")
    assert cache[0].eq(0).all(), "another layer's rows were written"
    assert torch.equal(cache[1, 1, 0, 3], qkv[0, 0, NQ + NKV:]) and torch.equal(cache[1, 1, 1, 0], qkv[1, 1, NQ + NKV:])
    written = cache[1].ne(0).any(-1).any(-1)  # [2, B, S]: rows holding a token
    assert written.sum() == 4, "exactly the two in-range tokens' K and V rows"


def test_cpu_steps_keep_the_module_path():
    """On the CPU "auto" resolves the layer ops to the reference, so a step runs the modules (and the fused
    native CPU layer where weights are packed): the fused GPU path never changes CPU numerics."""
    from hydra_kernels.model import Llama, LlamaConfig
    from hydra_kernels.ops.backend import plan_backends

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2)
    model = Llama(cfg)
    assert model._layer_ops_backend(plan_backends("auto", torch.device("cpu"))) == "reference"


@pytest.mark.backends("reference", "triton", op="rms_norm")
def test_layer_ops_keep_nan_and_inf(backend):
    """A NaN or inf in the stream stays one through the fused ops (bf16's rounding by bits must not turn NaN into
    a zero that hides a blow-up)."""
    x = torch.randn(2, 64).to(DEV, torch.bfloat16)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    h, y = hk.ops.rms_norm(x, torch.ones(64, device=DEV, dtype=torch.bfloat16), 1e-5, add=torch.ones_like(x),
                           backend=backend)
    assert h[0, 3].isnan() and h[1, 5].isinf() and y[0].isnan().all() and y[1].isnan().any()
    gu = torch.randn(2, 2 * 32).to(DEV, torch.bfloat16)
    gu[0, 40] = float("nan")
    assert hk.ops.silu_mul(gu, backend=backend)[0, 8].isnan()


def test_layer_ops_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[H=8\]"):
        hk.ops.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="add must have x's shape"):
        hk.ops.rms_norm(x, torch.ones(8), 1e-5, add=torch.randn(2, 7))
    with pytest.raises(ValueError, match="last dim must be 2I"):
        hk.ops.silu_mul(torch.randn(2, 7))
    qkv, cs = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match=r"qkv must be \[B, T, 4 \+ 2 \* 2"):
        hk.ops.rope_write_kv(torch.randn(1, 2, 7, 4), cs, cs, torch.zeros(2, 1, 5, 2, 4), torch.zeros(1, 2).long(), 4, 2)
    with pytest.raises(ValueError, match="rows must be int64"):
        hk.ops.rope_write_kv(qkv, cs, cs, torch.zeros(2, 1, 5, 2, 4), torch.zeros(1, 2, dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="must be a multiple of n_kv_heads"):
        hk.ops.rope_write_kv(torch.randn(1, 2, 9, 4), cs, cs, torch.zeros(2, 1, 5, 2, 4), torch.zeros(1, 2).long(), 5, 2)
    with pytest.raises(ValueError, match=r"kv must be \[2, 1, S, 2, 4\]"):
        hk.ops.rope_write_kv(qkv, cs, cs, torch.zeros(2, 1, 5, 3, 4), torch.zeros(1, 2).long(), 4, 2)


@pytest.mark.requires("triton", op="rms_norm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_step_through_fused_layer_ops(dtype, monkeypatch):
    """A tree step of a random GQA model on the "triton" plan (the fused layer ops, Triton attention) against
    the same step with the layer ops on "reference" (the modules): hidden states within the dtype's
    tolerance, the same KV rows written, and in fp32 the same argmax tokens."""
    from dataclasses import replace

    from hydra_kernels.model import Llama, LlamaConfig
    from hydra_kernels.ops.backend import plan_backends

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=2, num_heads=6,
                      num_kv_heads=2, max_position_embeddings=128)
    model = Llama(cfg).to(DEV, dtype).eval()
    tokens = torch.randint(0, 300, (2, 9), device=DEV)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=DEV)
    fused = plan_backends("triton", torch.device(DEV))
    unfused = replace(fused, ops={**fused.ops, "rms_norm": "reference"})
    from hydra_kernels.model.layers import TransformerBlock

    from hydra_kernels.model import attention

    fused_calls, resolved = [], []
    real, real_resolve = TransformerBlock._fused_step, attention.resolve
    monkeypatch.setattr(TransformerBlock, "_fused_step", lambda *a: fused_calls.append(1) or real(*a))
    monkeypatch.setattr(attention, "resolve", lambda op, *a: resolved.append(op) or real_resolve(op, *a))
    out, kvs = {}, {}
    for name, plan in (("fused", fused), ("modules", unfused)):
        cache = model.new_kv_cache(2, 32)
        with torch.no_grad():
            model.prefill(tokens, torch.tensor([9, 6], device=DEV), cache)
            out[name] = model.step(tokens[:, :4], cache, tree, torch.tensor([0, 1, 1, 2], device=DEV),
                                   kv_len=16, backends=plan)
        kvs[name] = torch.stack([kv[:, :, :16] for kv in cache.layers])
        assert len(fused_calls) == (cfg.num_layers if name == "fused" else 0), "the plan picks the path"
        if name == "fused":  # the kernels are resolved once a step, not once a layer
            assert sorted(resolved) == ["rms_norm", "rope_write_kv", "silu_mul", "tree_attention"]
        fused_calls.clear()
        resolved.clear()
    assert_close_rel(out["fused"].float(), out["modules"].float(), RTOL[dtype] * 4, f"step hidden {dtype}")
    assert_close_rel(kvs["fused"].float(), kvs["modules"].float(), RTOL[dtype] * 4, f"kv rows {dtype}")
    if dtype is torch.float32:
        lm = model.output.weight
        assert torch.equal((out["fused"] @ lm.T).argmax(-1), (out["modules"] @ lm.T).argmax(-1))
