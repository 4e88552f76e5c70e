"""nn.Linear with a CPU fast path for small M (decode steps, tree verification, draft heads).

After `pack_cpu()`, fp32 CPU inference with at most MAX_PACKED_ROWS rows runs the native
`packed_linear` op (hydra_kernels/ops/packed_linear.py): the weight is kept a second time in
contiguous column panels that stream from DRAM, and each output is an in-order FMA chain over K, so a
row's result does not depend on how many rows share the call (a token gives the same logits in a
1-token step and inside a tree). Larger M (prefill, training) and every other case take F.linear.

`release_original()` then drops that second copy the other way round: fp32 panels hold the weight's
exact values, so the layer keeps only them (the base model's projections, ~425 MB less for SmolLM2).
Its `weight` becomes a meta placeholder (shape and dtype only); every fp32 CPU inference, of any M, runs
the packed kernel (prefill rows are then bit-identical to decode rows too); other calls (autograd, other
dtypes) unpack the panels; state_dict holds the unpacked weight; loading, .to() and packed_kernel_off
bring the original back.
`pack_dtype` is the panels' storage: fp32 for the base model (verification decides every token), bf16
for draft heads (half the bytes; a guess's precision cannot change the output).

`use_quantized(panels)` gives a layer quantized panels instead (ops/quantized_linear.py: a GGUF's 4-8-bit
blocks, hydra_kernels/model/gguf_blocks.py), either as the only copy of the weight (like release_original)
or beside a kept fp32 weight holding the same values (the tied LM head, which is also the embedding). Their
kernel's outputs are bit-identical to the fp32 panels' on the dequantized weight, so every rule above holds.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.packed_linear import MAX_PACKED_ROWS, pack_linear_weight, packed_linear, packed_linear_available
from ..ops.int8_dot_linear import Int8DotPanels
from ..ops.quantized_linear import QuantizedPanels, quantized_linear_available
from ..weight_cache import DerivedCache, source_key

__all__ = ["Linear", "MAX_PACKED_ROWS", "packed_linear_available", "packed_kernel_off", "layout_version"]

# Bumped whenever a Linear (or a norm: layers.RMSNorm) is assigned what decides the weights a step runs on (panels,
# packed_on, weight, bias; a norm's weight or eps): what a run memoizes from them (decode_stack.stack_weights) is
# valid while it stays the same.
_LAYOUT = [0]
_LAYOUT_ATTRS = frozenset({"_panels", "packed_on", "weight", "bias"})


def layout_version() -> int:
    return _LAYOUT[0]


def bump_layout() -> None:
    _LAYOUT[0] += 1


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose small-M fp32 CPU inference can use packed weights."""

    def __setattr__(self, name, value):
        if name in _LAYOUT_ATTRS:
            bump_layout()
        super().__setattr__(name, value)

    def __init__(self, *args, pack_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_dtype = pack_dtype
        self.packed_on = False  # set by pack_cpu(); the panels are (re)built from the weight when it changes
        self._packed = DerivedCache()
        self._max_numel = MAX_PACKED_ROWS * self.in_features
        # release_original() / use_quantized(): the only copy of the weight
        self._panels: torch.Tensor | QuantizedPanels | None = None
        # use_quantized(keep_weight=True): quantized panels of the kept weight's values, and that weight's
        # source key (weight_cache.source_key): valid until the weight changes; pack_cpu keeps them
        self._kept_quant: tuple[QuantizedPanels, tuple] | None = None

    @property
    def released(self) -> bool:
        """Only the fp32 panels hold the weight (release_original); `weight` is a meta placeholder."""
        return self._panels is not None

    def release_original(self) -> bool:
        """Keep the weight only as its fp32 panels (exact values), freeing the original's storage. Only for
        a packed fp32 CPU layer with fp32 panels whose weight no one else holds (not a tied LM head).
        Returns whether it released."""
        if self.released or not self.packed_on or self.pack_dtype != torch.float32:
            return False
        with torch.no_grad():
            panels = self.packed_weight()
        if panels is None:
            return False
        self._hold_only(panels)
        return True

    def _hold_only(self, panels: torch.Tensor | QuantizedPanels) -> None:
        """The panels become the only copy of the weight; `weight` a meta placeholder (shape, dtype fp32)."""
        self._panels = panels
        self._packed.clear()
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=torch.float32, device="meta"),
                                   requires_grad=w.requires_grad)

    def unpacked_weight(self) -> torch.Tensor:
        """The weight [N, K] rebuilt from the panels [P, K, 64] (W[64 p + c, k] = panels[p, k, c])."""
        return self.unpacked_weight_of(self._panels)

    def restore_original(self) -> None:
        """Undo release_original: the weight is a real fp32 Parameter again (panels kept as its packed copy)."""
        if not self.released:
            return
        panels, rg = self._panels, self.weight.requires_grad
        self._panels = None
        self.weight = nn.Parameter(self.unpacked_weight_of(panels), requires_grad=rg)
        self._packed.get((self.weight,), lambda: panels)  # the panels stay valid for the restored weight

    def unpacked_weight_of(self, panels: torch.Tensor | QuantizedPanels) -> torch.Tensor:
        """panels [P, K, 64] (or quantized panels) -> [N, K] fp32."""
        if isinstance(panels, QuantizedPanels):
            return panels.dequantize()
        return panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()

    def use_quantized(self, panels: QuantizedPanels, *, keep_weight: bool = False) -> bool:
        """Run this layer's fp32 CPU inference on quantized panels holding its weight's exact values.
        keep_weight=False: they become the only copy (the weight a meta placeholder, as after
        release_original); True: the current fp32 weight stays (its values must be the panels'), the panels
        serve as its packed copy until the weight changes. Returns False (nothing changed) where the kernel
        has no vector path on this CPU."""
        if panels.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized panels of shape {panels.shape} for a Linear of weight "
                             f"{(self.out_features, self.in_features)}")
        if not quantized_linear_available():
            return False
        self.packed_on = True
        self._packed.clear()
        if keep_weight:
            self._kept_quant = (panels, source_key((self.weight,)))
        else:
            self._hold_only(panels)
        return True

    def use_int8_activations(self, *, keep_exact: bool = False) -> bool:
        """Run this layer on the int8 dot kernel (ops/int8_dot_linear.py: its activations rounded to int8 per weight
        group, another model than the exact kernel's) where quantized panels are its only copy, which it then holds
        in the dot layout alone (keep_exact: the exact layout too, for fast row lookups: an LM head). Returns whether
        it now runs int8 activations."""
        p = self._panels
        if not isinstance(p, QuantizedPanels):
            return False
        if not isinstance(p, Int8DotPanels):
            self._panels = Int8DotPanels.of(p, keep_exact=keep_exact)  # (an attribute set: the stack's memo rebuilds)
        return True

    @property
    def holds_panels(self) -> bool:
        """Its panels are its weight (released or quantized) and forward runs them: what step_weights returns then
        is fixed until an attribute changes (layout_version), not rebuilt from a weight changed in place."""
        return self._panels is not None and self.packed_on

    def step_weights(self, rows: int) -> tuple[torch.Tensor, int] | None:
        """(weights, kind) that forward would run `rows` rows of fp32 CPU inference on, for the fused decode
        stack (csrc/decode_stack_cpu.cpp): kind 0 = packed_linear panels, else quantized panels (csrc/step_kernels.h:
        QuantizedKind: 10 * bits + offset, + 100 with fp16 scales, + 1000 on int8 activations); None where forward
        would take F.linear."""
        p = self._panels
        if p is not None and self.packed_on:  # released: the panels are the weight (the path of every step)
            return (p.step_tensor, p.kind) if isinstance(p, QuantizedPanels) else (p, 0)
        if not self.packed_on or (self._panels is None and rows * self.in_features > self._max_numel):
            return None
        p = self.packed_weight()
        if p is None:
            return None
        return (p.step_tensor, p.kind) if isinstance(p, QuantizedPanels) else (p, 0)

    def weight_bytes(self) -> int:
        """Bytes of the weight a step of this layer streams: its panels (fp32, bf16 or quantized blocks), else
        the weight itself."""
        p = self.packed_weight() if self.packed_on or self.released else None
        if isinstance(p, QuantizedPanels):
            return p.nbytes
        t = p if p is not None else self.weight
        return t.numel() * t.element_size()

    def _run_panels(self, x: torch.Tensor, panels: torch.Tensor | QuantizedPanels) -> torch.Tensor:
        if isinstance(panels, QuantizedPanels):
            return panels.linear(x, self.bias)
        return packed_linear(x, panels, self.out_features, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.released:
            destination[prefix + "weight"] = self.unpacked_weight()

    def _load_from_state_dict(self, *args, **kwargs):
        self.restore_original()  # loading writes into (or assigns) a real weight
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        panels = self._panels
        self.restore_original()  # .to() / .cuda() / .half() move the real weight
        out = super()._apply(fn, *args, **kwargs)
        w = self.weight
        if panels is not None and w.device.type == "cpu" and w.dtype == torch.float32 and torch.equal(
                w, self.unpacked_weight_of(panels)):  # still fp32 on the CPU (e.g. .to("cpu")): panels only again
            self._hold_only(panels)
        return out

    def pack_cpu(self, on: bool = True) -> None:
        """Use the packed kernel for this layer's small-M fp32 CPU inference (when the weight is an fp32
        CPU tensor and the kernel is fast here; otherwise F.linear stays)."""
        kernel_here = (quantized_linear_available() if isinstance(self._panels, QuantizedPanels)
                       else packed_linear_available())
        self.packed_on = on and kernel_here
        self._packed.clear()
        if self.packed_on:
            with torch.no_grad():
                self.packed_weight()  # pack now, not inside the first decoding step

    def packed_weight(self) -> torch.Tensor | QuantizedPanels | None:
        """The panels of the current weight, or None where this layer cannot use them."""
        if self._panels is not None:
            return self._panels
        w = self.weight
        if self._kept_quant is not None and not torch.compiler.is_compiling():
            if source_key((w,)) == self._kept_quant[1]:
                return self._kept_quant[0]
            self._kept_quant = None  # the weight changed: its own panels from now on
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.is_meta:
            return None
        return self._packed.get((w,), lambda: pack_linear_weight(w.detach(), self.pack_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the checks are ordered cheapest first: this runs ~120 times per decoding step, and at M = 1
        # a layer's kernel takes ~50-200 us, so microseconds of Python here show up in tokens/s
        if (self.packed_on and x.is_cpu and x.dtype is torch.float32 and x.numel() <= self._max_numel
                and not torch.is_grad_enabled()):
            packed = self.packed_weight()
            if packed is not None:
                return self._run_panels(x, packed)
        if self._panels is not None:  # released: the panels are the weight
            if self.packed_on and x.is_cpu and x.dtype is torch.float32 and not torch.is_grad_enabled():
                return self._run_panels(x, self._panels)  # any M (prefill)
            return F.linear(x, self.unpacked_weight().to(x.dtype), self.bias)
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def packed_kernel_off(model: nn.Module):
    """Inside the block every packed Linear of `model` takes F.linear (MKL on input-major weights, the
    released ones brought back for the block): the A/B switch for timing both paths on one model."""
    mods = [m for m in model.modules() if isinstance(m, Linear) and m.packed_on]
    released = [(m, m._panels) for m in mods if m.released]  # fp32 or quantized panels, put back as they were
    for m, _ in released:
        m.restore_original()
        m.weight.data = m.weight.data.t().contiguous().t()  # the input-major layout load_model gives
    for m in mods:
        m.packed_on = False
    try:
        yield
    finally:
        for m in mods:
            m.packed_on = True
        for m, panels in released:
            m._hold_only(panels)
