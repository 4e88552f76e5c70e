"""The native small-M linear over quantized weights for the CPU (csrc/quantized_linear_cpu.cpp), the only
way Python reaches it.

A weight [N, K] is kept as integers q (4 or 8 bits) with a scale s, and optionally an offset o, per group of G
consecutive inputs: w[n, k] = fma(s[n, k // G], q[n, k], o[n, k // G]) (or s * q). s and o are stored fp16 where
every one of them is an fp16 value (GGUF's Q4_0, Q4_1, Q5_x and Q8_0 store fp16 d and m), else fp32: the same
exact values, and a Q4_1 layer streams 5 bits a weight instead of 6. The
kernel dequantizes in registers and accumulates like the fp32 packed kernel (ops/packed_linear.py): each
output is the in-order FMA chain over K, so its result is bit-identical to `packed_linear` on the
dequantized weight, whatever the number of rows or the ISA (AVX-512, AVX2 + FMA, or a portable loop).
The GGUF formats are decoded into (q, s, o) by hydra_kernels/model/gguf_blocks.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .backend import native_available
from .packed_linear import LazyOp

# ISA codes of the kernel's `isa` argument (tests force each path; 0 lets the kernel pick the fastest)
ISA_AUTO, ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = 0, 1, 2, 3

@functools.cache
def extension_isa(op: str) -> int:
    """The ISA code the extension's op `op` (a kernel's *_isa op) reports for this CPU, once a process; 0 without the
    extension."""
    if not native_available():  # not built, or built from sources of another interface (refused there)
        return 0
    try:
        return int(getattr(torch.ops.hydra_kernels, op)())
    except (AttributeError, RuntimeError):
        return 0


def quantized_linear_isa() -> int:
    """The ISA the kernel runs with on this CPU (ISA_AVX512, ISA_AVX2 or ISA_PORTABLE), or 0 without the
    extension."""
    return extension_isa("quantized_linear_isa")


def quantized_linear_available() -> bool:
    """The extension is built and this CPU has a vector path (AVX2 + FMA or AVX-512) for the kernel."""
    return quantized_linear_isa() in (ISA_AVX2, ISA_AVX512)


def header_bytes(offset: bool, half: bool) -> int:
    """Bytes before a group's integers in the packed layout (csrc/quantized_linear_cpu.cpp's header_bytes): 64 scales,
    and 64 offsets with `offset`, each fp16 (`half`) or fp32."""
    return 64 * (2 if half else 4) * (2 if offset else 1)


@dataclass(frozen=True)
class QuantizedPanels:
    """A weight [n, k] packed for quantized_linear: `packed` uint8 [P, k / G, group bytes] (the layout is
    csrc/quantized_linear_cpu.cpp's), `bits` 4 | 8, `offset` whether groups store an offset, `half` whether the
    scales and offsets are stored fp16."""

    packed: torch.Tensor
    n: int
    k: int
    bits: int
    offset: bool
    half: bool = False

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
             half: bool | None = None) -> "QuantizedPanels":
        """q int8 [N, K] (4 bits: values 0..15), scales fp32 [N, K / G], offsets fp32 [N, K / G] or None. half:
        store the scales and offsets fp16 (each must be an fp16 value); None: where every one is."""
        if half is None:
            half = all(t is None or bool((t.half().float() == t).all()) for t in (scales, offsets))
        packed = torch.ops.hydra_kernels.pack_quantized_weight(q, scales, offsets, bits, half)
        return cls(packed, int(q.shape[0]), int(q.shape[1]), bits, offsets is not None, half)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO) -> torch.Tensor:
        """x fp32 [..., k] -> x W^T + b [..., n]."""
        return _LINEAR(x, self.packed, self.n, self.bits, self.offset, bias, isa, self.half)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ids int64 [m] -> their exact fp32 values [m, k]."""
        return torch.ops.hydra_kernels.quantized_rows(self.packed, ids, self.n, self.bits, self.offset, self.half)

    def select_rows(self, ids: torch.Tensor) -> "QuantizedPanels":
        """The weight's rows ids int64 [m] (any order, repeats allowed) as panels of their own: the same
        stored integers, scales and offsets, so the same exact values (a drafter's LM-head rows of its draft
        vocabulary, read at the head's bytes per weight). Unpacks only those rows."""
        ids = ids.reshape(-1).long().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise ValueError(f"row ids must lie in [0, {self.n})")
        return QuantizedPanels.pack(*self._groups_at(ids), self.bits, self.half)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored weight as (q int8 [n, k], scales fp32 [n, k / G], offsets fp32 or None): pack's arguments."""
        return self._groups_at(torch.arange(self.n))

    def _groups_at(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows ids int64 [m] (checked by the caller) as (q int8 [m, k], scales fp32 [m, k / G], offsets or None),
        read from the layout above: row r is column r % 64 of panel r // 64."""
        P, NG, GB = self.packed.shape
        header = header_bytes(self.offset, self.half)
        p, c = ids // 64, ids % 64
        stored = self.packed[:, :, :header].contiguous().view(torch.float16 if self.half else torch.float32)
        fp = stored.float().view(P, NG, -1, 64)  # [P, NG, 1|2, 64]
        scales = fp[p, :, 0, c]  # [m, NG]
        offsets = fp[p, :, 1, c] if self.offset else None
        qb = self.packed[:, :, header:].view(P, NG, -1, 64)  # [P, NG, G or G / 2, 64] bytes
        q = qb[p, :, :, c]  # [m, NG, G or G / 2]
        if self.bits == 4:  # byte (i, c) = q[2i][c] | q[2i + 1][c] << 4
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2)
        q = q.view(torch.int8) if self.bits == 8 else q.to(torch.int8)
        return (q.reshape(ids.numel(), self.k).contiguous(), scales.contiguous(),
                None if offsets is None else offsets.contiguous())

    @property
    def step_tensor(self) -> torch.Tensor:
        """The tensor a decode step's kernel reads (the decode stack's weight of layout `kind`)."""
        return self.packed

    def dequantize(self) -> torch.Tensor:
        """The whole weight as fp32 [n, k] (exact values)."""
        return self.rows(torch.arange(self.n))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def kind(self) -> int:
        """The layout code of the CPU decode stack (csrc/decode_stack_cpu.cpp): 100 * half + 10 * bits + offset."""
        return 100 * int(self.half) + 10 * self.bits + int(self.offset)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


_LINEAR = LazyOp("quantized_linear")
