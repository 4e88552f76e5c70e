"""Triton's counter-based uniforms in PyTorch, bit for bit: philox_uniform(seed, offsets) equals
triton.language.rand(seed, offsets) (Philox4x32-10, the first output word, Triton's int -> float
mapping). The reference ops that define a kernel's random draw (reference.lm_head_residual_sample) use
it, so a kernel and its reference see the same noise and can be compared exactly.

Philox (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) on uint32 words held in
int64 tensors: a 32 x 32 bit product is split in 16-bit halves so that no intermediate leaves int64.
Counter: (offset low word, offset high word, 0, 0); key: (seed low word, seed high word).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers (triton.language.random)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: the largest c with (2^31 - 1) * c < 1 in fp32


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a uint32 constant a and uint32 values b (int64 tensor)."""
    t = a * (b & 0xFFFF)  # < 2^48
    u = a * (b >> 16)  # < 2^48; a * b = u * 2^16 + t
    hi = (u + (t >> 16)) >> 16
    lo = (((u & 0xFFFF) << 16) + t) & _MASK32
    return hi, lo


def philox_uniform(seed: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1), one per offset, equal to tl.rand(seed, offsets) for an int64 seed and
    int64 offsets >= 0. seed: int64 tensor of one element (read on the device: no host sync);
    offsets: int64 tensor of any shape. Returns offsets' shape."""
    s = seed.reshape(()).long()
    k0, k1 = s & _MASK32, (s >> 32) & _MASK32
    c0, c1 = offsets & _MASK32, (offsets >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(offsets)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # the word as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x for negative words: [0, 2^31)
    # a Python float (no tensor built from a host value: a CUDA graph cannot capture that copy); the op
    # multiplies in fp32 by the scale rounded to fp32, as tl.rand does
    return x.to(torch.int32).float() * _UNIFORM_SCALE
