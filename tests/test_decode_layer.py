"""The fused decode layer (csrc/decode_layer_cpu.cpp, TransformerBlock._decode_layer): a CPU step's layers in
one native call each give the Python layers' hidden states, logits and KV cache bit for bit, on fp32 panels
and on quantized panels, for a plain token, a shared tree and per-sequence trees of different sizes (GQA,
biases, batch 1 and 3); layers whose weights take F.linear stay on the Python path."""
import pytest
import torch

from hydra_kernels import Llama, LlamaConfig
from hydra_kernels.model import layers
from hydra_kernels.model.packed_linear import Linear, packed_linear_available
from test_quantized_linear import random_blocks
from helpers import random_tree, random_tree_batch

pytestmark = pytest.mark.skipif(not packed_linear_available() or layers._DECODE_LAYER is None,
                                reason="the packed CPU kernel (AVX-512) and the extension's decode_layer")


def model_of(quantized: bool, bias: bool, seed: int) -> Llama:
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=128, attention_bias=bias)
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
                G, bits, off = (32, 4, True) if "w13" in name or "wqkv" in name else (16, 8, False)
                mod.use_quantized(random_blocks(mod.out_features, mod.in_features, G, bits, off, gen).panels())
    return m


def run_steps(m: Llama, fused: bool, monkeypatch, B: int, trees) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill a ragged batch, then a plain step and the given tree steps; every step's logits and the cache."""
    monkeypatch.setattr(layers, "_DECODE_LAYER", layers._decode_layer_op() if fused else None)
    calls = []
    real = layers._DECODE_LAYER
    if fused:
        def counting(*a):
            calls.append(1)
            return real(*a)
        monkeypatch.setattr(layers, "_DECODE_LAYER", counting)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (B, 9), generator=gen)
    lengths = torch.tensor([9, 5, 7][:B])
    cache = m.new_kv_cache(B, 64)
    outs = []
    with torch.no_grad():
        m.prefill(tokens, lengths, cache)
        cache.seqlens.copy_(lengths.to(cache.seqlens.dtype))
        outs.append(m.output(m.step(torch.randint(0, 97, (B, 1), generator=gen), cache, backends="native")))
        for mask, depths in trees:
            T = mask.shape[-1]
            outs.append(m.output(m.step(torch.randint(0, 97, (B, T), generator=gen), cache, mask, depths,
                                        backends="native")))
    if fused:  # every layer after the step's first took the fused op
        assert len(calls) == (1 + len(trees)) * (m.config.num_layers - 1)
    return outs, cache.kv.clone()


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("B,bias", [(1, False), (3, True)])
def test_fused_decode_layer_is_the_python_layer_bit_for_bit(monkeypatch, quantized, B, bias):
    m = model_of(quantized, bias, seed=B + 2 * quantized)
    gen = torch.Generator().manual_seed(B)
    shared = random_tree(gen, 5)  # one tree for the batch
    ragged = random_tree_batch(gen, [6, 2, 4][:B])[1]  # per-sequence trees of different sizes, padded
    trees = [(shared.mask, shared.depths), (ragged.mask, ragged.depths)]
    want, kv_want = run_steps(m, False, monkeypatch, B, trees)
    got, kv_got = run_steps(m, True, monkeypatch, B, trees)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i}: max |diff| {(g - w).abs().max().item():.3e}"
    assert torch.equal(kv_got, kv_want)


def test_layers_on_f_linear_keep_the_python_path(monkeypatch):
    """Without packed weights (e.g. packed_kernel_off, autograd) the fused op is never called."""
    m = model_of(False, False, seed=0)
    for mod in m.modules():
        if isinstance(mod, Linear):
            mod.restore_original()
            mod.packed_on = False
    monkeypatch.setattr(layers, "_DECODE_LAYER", lambda *a: pytest.fail("fused op called on F.linear weights"))
    cache = m.new_kv_cache(1, 32)
    with torch.no_grad():
        m.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]), cache)
        cache.seqlens.fill_(3)
        m.step(torch.tensor([[4]]), cache, backends="native")
