"""The native small-M linear over quantized weights with int8 activations (csrc/int8_dot_linear_cpu.cpp), the only way
Python reaches it.

The weights are the same (q, s, o) groups as ops/quantized_linear.py's; what changes is the arithmetic: each row's
activations are rounded to int8 per weight group and multiplied with the weights in integers (AVX-512 VNNI, or AVX2's
vpmaddubsw), which is llama.cpp's scheme on the CPU. The result is a slightly different model from the exact kernel's
(ops/reference.py: int8_dot_linear is the definition), so a model runs it only where asked (Llama.use_int8_activations); but a row's
result is fixed by the definition, whatever the number of rows or the ISA, so speculative decoding with it emits
exactly its own plain decoding's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .packed_linear import LazyOp
from .quantized_linear import ISA_AUTO, QuantizedPanels, extension_isa, header_bytes

# ISA codes of the kernel's `isa` argument: tests force each path (the portable loop is the slow reference)
DOT_ISA_AUTO, DOT_ISA_PORTABLE, DOT_ISA_AVX2, DOT_ISA_VNNI = 0, 1, 2, 3

def int8_dot_linear_isa() -> int:
    """DOT_ISA_VNNI where this CPU has AVX-512 VNNI, else DOT_ISA_AVX2 with AVX2 + FMA (HK_CPU_ISA can limit it
    to either below), DOT_ISA_PORTABLE where only the (slow) portable loop runs, 0 without the extension."""
    return extension_isa("int8_dot_linear_isa")


def int8_dot_linear_available() -> bool:
    """The extension is built and this CPU runs a vector path of the kernel (AVX-512 VNNI or AVX2)."""
    return int8_dot_linear_isa() in (DOT_ISA_AVX2, DOT_ISA_VNNI)


def require_int8_dot_linear() -> None:
    """Refuses (ValueError, saying what to do) where int8 activations cannot run here."""
    if not int8_dot_linear_available():
        raise ValueError("activations='int8' needs the extension and a CPU with AVX-512 VNNI or AVX2 (and HK_CPU_ISA "
                         "not limiting the kernels below AVX2); load with activations='fp32'")


@dataclass(frozen=True)
class Int8DotPanels(QuantizedPanels):
    """A quantized weight whose linear runs the int8 dot kernel on `dot` (pack_int8_dot_weight's layout of the same
    integers, scales and offsets). `packed`, the exact kernel's layout, is kept only where asked (an LM head: its rows
    serve the drafters and the tied embedding); without it, rows / dequantize / select_rows rebuild it for the call
    (a state_dict, a move: rare), so a layer keeps one copy of its weight."""

    dot: torch.Tensor | None = None

    @classmethod
    def of(cls, p: QuantizedPanels, *, keep_exact: bool = False) -> "Int8DotPanels":
        """p's weight for the int8 dot kernel (refused for groups that are not a multiple of 4 inputs)."""
        q, scales, offsets = p.groups()
        dot = torch.ops.hydra_kernels.pack_int8_dot_weight(q, scales, offsets, p.bits, p.half)
        return cls(p.packed if keep_exact else None, p.n, p.k, p.bits, p.offset, p.half, dot)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO) -> torch.Tensor:
        """x fp32 [..., k] -> [..., n], int8 activations (the definition: ops/reference.py int8_dot_linear)."""
        return _DOT(x, self.dot, self.n, self.bits, self.offset, bias, isa, self.half)

    def exact(self) -> QuantizedPanels:
        """The same weight in the exact kernel's layout (built for the call where it is not kept)."""
        if self.packed is not None:
            return QuantizedPanels(self.packed, self.n, self.k, self.bits, self.offset, self.half)
        return QuantizedPanels.pack(*self.groups(), self.bits, self.half)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.packed is not None:
            return super().groups()
        # dot: [P, 2, NG, GB], a half's group = [s: 32][o: 32] then quads of 32 columns x 4 inputs
        # (csrc/int8_dot_linear_cpu.cpp's layout)
        P, _, NG, GB = self.dot.shape
        header = header_bytes(self.offset, self.half) // 2
        stored = self.dot[..., :header].contiguous().view(torch.float16 if self.half else torch.float32).float()
        fp = stored.view(P, 2, NG, -1, 32).permute(0, 1, 4, 2, 3).reshape(P * 64, NG, -1)[: self.n]  # [n, NG, 1|2]
        qb = self.dot[..., header:]
        if self.bits == 4:  # a quad: byte 4c + t = q[c][4j + t] | q[16 + c][4j + t] << 4
            qb = qb.reshape(P, 2, NG, -1, 16, 4)
            q = torch.stack([qb & 0x0F, qb >> 4], dim=4)  # [P, 2, NG, QG, 2, 16, 4]: column 16 * v + c
            q = q.to(torch.int8)
        else:  # a quad: 2 lines, line v byte 4c + t = q[16v + c][4j + t] + 128
            q = (qb.reshape(P, 2, NG, -1, 2, 16, 4).to(torch.int16) - 128).to(torch.int8)
        q = q.permute(0, 1, 4, 5, 2, 3, 6).reshape(P * 64, self.k)[: self.n]  # [n, (NG, QG, 4) = k]
        return q.contiguous(), fp[..., 0].contiguous(), fp[..., 1].contiguous() if self.offset else None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.exact().rows(ids)

    def select_rows(self, ids: torch.Tensor) -> QuantizedPanels:
        """The rows ids as exact panels of their own (a drafter's LM-head rows of its draft vocabulary: one row of
        logits streams them, so the int8 kernel would not be faster there: measured, 2026-11-29, EPYC VM)."""
        return self.exact().select_rows(ids)

    @property
    def step_tensor(self) -> torch.Tensor:
        return self.dot

    @property
    def kind(self) -> int:
        """The decode stack's layout code: 1000 + the exact panels' code (csrc/step_kernels.h: QuantizedKind)."""
        return 1000 + super().kind

    @property
    def nbytes(self) -> int:
        """The bytes a step streams: the dot layout's."""
        return self.dot.numel()


_DOT = LazyOp("int8_dot_linear")
