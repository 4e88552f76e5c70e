"""RMSNorm's one-op CPU path (torch.rms_norm, fp32) gives its definition's values bit for bit: the
statistic in fp32, y = w * x / sqrt(mean(x^2) + eps) (as transformers computes it)."""
import pytest
import torch

from hydra_kernels.model.layers import RMSNorm


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 40, 37), (1, 5, 4096)])
def test_rms_norm_fast_path_is_the_definition(shape):
    gen = torch.Generator().manual_seed(shape[-1] + shape[1])
    H = shape[-1]
    norm = RMSNorm(H, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=gen))
        x = torch.randn(*shape, generator=gen) * 3
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(norm(x), want)
        xb = x.bfloat16()  # other dtypes keep the written-out form: fp32 statistic, cast back
        wb = norm.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        assert torch.equal(norm(xb), wb)
