"""Opt-in weight-only quantization of an HF checkpoint (hk.load_model(dir, weights="int8" | "int4"),
model/weight_quantize.py): each weight within its documented bound of the fp32 value, projections held only as
quantized panels, logits near the fp32 model's, and speculative decoding exactly plain decoding of the
quantized model."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.model.packed_linear import Linear
from hydra_kernels.model.weight_quantize import GROUP, quantize_weight
from hydra_kernels.ops.quantized_linear import QuantizedPanels, quantized_linear_available
from test_llama_vs_transformers import make_hf

pytestmark = pytest.mark.skipif(not quantized_linear_available(), reason="the quantized kernel (AVX2 / AVX-512)")


@pytest.mark.parametrize("bits", [8, 4])
def test_each_weight_is_within_the_documented_bound(bits):
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(70, 96, generator=gen) * torch.rand(70, 1, generator=gen) * 3
    w[3, :GROUP] = 0.0  # an all-zero group
    w[5, GROUP:2 * GROUP] = 0.25  # a constant group
    bw = quantize_weight(w, bits)
    deq = bw.panels().dequantize()
    g = w.reshape(70, -1, GROUP)
    ulp = g.abs().amax(-1, keepdim=True) * 2 ** -23 * 2  # the product's (and sum's) own rounding
    if bits == 8:
        bound = g.abs().amax(-1, keepdim=True) / 254
    else:
        bound = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 30
    err = (deq.reshape(70, -1, GROUP) - g).abs()
    assert (err <= bound + ulp).all(), (err - bound).max()
    assert torch.equal(deq[3, :GROUP], torch.zeros(GROUP)) and torch.equal(deq[5, GROUP:2 * GROUP], w[5, GROUP:2 * GROUP])


@pytest.mark.parametrize("kind,rtol", [("int8", 0.02), ("int4", 0.25)])
def test_hf_dir_quantized_at_load_decodes_like_itself(tmp_path, kind, rtol):
    hf = make_hf("mha-untied", seed=3, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    hf.save_pretrained(tmp_path / "hf")
    q, _ = hk.load_model(tmp_path / "hf", device="cpu", weights=kind)
    f, _ = hk.load_model(tmp_path / "hf", device="cpu")
    for n, m in q.named_modules():
        if isinstance(m, Linear) and n != "output":
            assert m.released and isinstance(m._panels, QuantizedPanels) and m._panels.bits == int(kind[3:]), n
    assert not q.output.weight.is_meta and torch.equal(q.output.weight, f.output.weight)  # the LM head stays fp32
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, lf = q(ids), f(ids)
    assert (lq - lf).abs().max() <= rtol * lf.abs().max()
    prompts = [[5, 7, 5, 7, 5, 7, 9], [3, 1, 3, 1]]
    plain = generate(q, prompts, max_new_tokens=16).sequences
    spec = generate(q, prompts, drafter=hk.new_drafter(q, kind="ngram"), max_new_tokens=16).sequences
    assert spec == plain


def test_int_weights_are_refused_for_a_gguf_and_a_bad_kind(tmp_path):
    hf = make_hf("mha-untied", seed=3, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="weights='int4' quantizes an HF directory"):
        hk.load_model(device="cpu", weights="int4")
    with pytest.raises(ValueError, match="weights must be"):
        hk.load_model(tmp_path / "hf", device="cpu", weights="int3")
    with pytest.raises(ValueError, match="needs an HF directory"):
        hk.load_model(tmp_path / "hf", device="cpu", dtype="bf16", weights="int8")
