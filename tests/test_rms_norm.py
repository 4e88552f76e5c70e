"""RMSNorm's CPU fp32 paths against its definition, y = w * x / sqrt(mean(x^2) + eps) with the statistic in
fp32 (as transformers computes it): the native row norm (csrc/decode_stack_cpu.cpp, which
the CPU decode stack runs too) gives its own fixed summation order's values bit for bit and the definition's
within fp32 rounding, with or without autograd (without the extension torch.rms_norm gives the definition's
bit for bit); other dtypes keep the written-out form."""
import pytest
import torch

from hydra_kernels.model import layers
from hydra_kernels.model.layers import RMSNorm
from test_decode_stack import lane_order_rms_norm


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 40, 37), (1, 5, 4096)])
def test_rms_norm_paths_are_the_definition(shape):
    gen = torch.Generator().manual_seed(shape[-1] + shape[1])
    H = shape[-1]
    norm = RMSNorm(H, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=gen))
        x = torch.randn(*shape, generator=gen) * 3
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        got = norm(x)
        if layers.RMS_NORM_ROWS is not None:
            assert torch.equal(got, lane_order_rms_norm(x, norm.weight, 1e-5))
            torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)
        else:
            assert torch.equal(got, want)
        xb = x.bfloat16()  # other dtypes keep the written-out form: fp32 statistic, cast back
        wb = norm.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        assert torch.equal(norm(xb), wb)
    with torch.enable_grad():  # autograd: the same op (it has a backward), the same values
        assert torch.equal(norm(x), got)
