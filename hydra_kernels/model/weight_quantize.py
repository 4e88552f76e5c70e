"""Group-wise weight-only quantization of an fp32 checkpoint for the quantized CPU kernel (opt-in:
hk.load_model(hf_dir, weights="int8" | "int4")), into the same (q, s, o) blocks as a GGUF's (gguf_blocks.py).

Per group of G = 32 consecutive inputs of a weight row:
- int8: symmetric, s = max|w| / 127, q = round(w / s) in [-127, 127], w' = s * q. |w - w'| <= s / 2 (+ one
  rounding of the product): at most max|w| / 254 of the group's largest weight.
- int4: asymmetric, s = (max - min) / 15, o = min, q = round((w - min) / s) in [0, 15], w' = fma(s, q, o).
  |w - w'| <= s / 2 (+ one rounding): at most (max - min) / 30 of the group's range.
(tests/test_weight_quantize.py checks both bounds.) Unlike a GGUF's blocks these weights are not the
checkpoint's values: the model is another model, close to it. Speculative decoding stays exactly plain
decoding of the quantized model (the kernel's rows do not depend on the tree), not of the fp32 one.
"""
from __future__ import annotations

import numpy as np
import torch

from .gguf_blocks import BlockWeight

GROUP = 32
BITS = {"int8": 8, "int4": 4}


def quantize_weight(w: torch.Tensor, bits: int, group: int = GROUP) -> BlockWeight:
    """w fp32 [N, K] (K a multiple of group) -> its blocks: int8 symmetric or int4 asymmetric (module doc)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"a weight of {K} inputs does not split into groups of {group}")
    g = w.detach().float().reshape(N, K // group, group)
    if bits == 8:
        s = g.abs().amax(-1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, q = 0
        q = torch.round(g / s[..., None]).clamp_(-127, 127)
        return BlockWeight(q.to(torch.int8).reshape(N, K).numpy(), s.numpy().astype(np.float32), None, 8)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo) / 15.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round((g - lo[..., None]) / s[..., None]).clamp_(0, 15)
        return BlockWeight(q.to(torch.int8).reshape(N, K).numpy(), s.numpy().astype(np.float32),
                           lo.numpy().astype(np.float32), 4)
    raise ValueError(f"bits must be 8 or 4, got {bits}")


def quantize_model_weights(model, kind: str) -> int:
    """Every layer projection of a packed fp32 CPU model onto kind ("int8" | "int4") panels, the only copy of
    each. The LM head stays fp32: the ops and drafters read its weight, and every path that picks or samples a
    token must see the same values. Returns the number of layers quantized (0 where the kernel has no vector
    path here, or a projection's inputs do not split into groups of 32: the model stays fp32)."""
    from .packed_linear import Linear

    if kind not in BITS:
        raise ValueError(f"weight quantization must be one of {sorted(BITS)}, got {kind!r}")
    lins = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m is not model.output}
    if any(m.in_features % GROUP for m in lins.values()):
        return 0
    panels = {}
    for name, m in lins.items():
        w = m.unpacked_weight() if m.released else m.weight
        panels[name + ".weight"] = quantize_weight(w, BITS[kind]).panels()
    if not model.use_quantized_cpu_weights(panels):
        return 0
    return len(panels)
