"""GGUF block formats -> integers, scales and offsets for the quantized CPU kernel (ops/quantized_linear.py).

Each supported format is decoded into BlockWeight(q, s, o): q an integer per weight, s (and o) fp32 per group
of G consecutive inputs of a row, with w = fma(s, q, o) (or s * q without an offset). Every decoder follows
gguf's own numpy `dequantize_blocks` up to its last line, and in each format the product s * q is exact in
fp32 where an offset is added, so fma(s, q, o) rounds once, exactly where gguf's `s * q + o` rounds:

| format | G  | bits stored | s            | q                   | o              | gguf computes          |
| ------ | -- | ----------- | ------------ | ------------------- | -------------- | ---------------------- |
| Q4_0   | 32 | 4           | d            | nibble 0..15        | -8 d           | d * (nibble - 8): exact |
| Q4_1   | 32 | 4           | d            | nibble 0..15        | m              | d * nibble + m          |
| Q8_0   | 32 | 8           | d            | int8                | -              | int8 * d                |
| Q5_0   | 32 | 8           | d            | 5-bit value - 16    | -              | d * (value - 16)        |
| Q5_1   | 32 | 8           | d            | 5-bit value 0..31   | m              | d * value + m           |
| Q2_K   | 16 | 4           | d * sc (4 b) | 2-bit value 0..3    | -(dmin * m)    | (d sc) q - dmin m       |
| Q3_K   | 16 | 4           | d * sc (i6)  | 3-bit value + 4 * mask bit (0..7) | -4 d sc | (d sc) (q - 4 (1 - mask bit)): exact |
| Q4_K   | 32 | 4           | d * sc (6 b) | nibble 0..15        | -(dmin * m)    | (d sc) q - dmin m       |
| Q5_K   | 32 | 8           | d * sc (6 b) | 5-bit value 0..31   | -(dmin * m)    | (d sc) q - dmin m       |
| Q6_K   | 16 | 8           | d * sc (i8)  | 6-bit value - 32    | -              | (d sc) q                |

(d, m, dmin fp16, so d * sc has at most 17 significant bits and d * sc * q at most 23: exact.) A 5-bit format is
stored in the 8-bit layout and Q2_K / Q3_K in the 4-bit one (with groups of 16 the scale and offset take 4 bits a
weight there): ~10 and ~8 bits a weight, against 5.5 / 2.6-3.4 in the file and 32 as fp32. The
dequantized weights are therefore the exact fp32 values the GGUF converter (model/gguf_convert.py) caches,
and a quantized model's logits equal its fp32 twin's bit for bit (csrc/quantized_linear_cpu.cpp keeps the
fp32 kernel's accumulation order). Other GGUF types are not decoded here: their tensors load as fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.quantized_linear import QuantizedPanels

QK_K = 256  # weights per K-quant super-block


@dataclass
class BlockWeight:
    """A weight [N, K] as integers q int8 [N, K] (bits 4: values 0..15), scales s fp32 [N, K / G] and offsets
    o fp32 [N, K / G] or None: w[n, k] = fma(s[n, k // G], q[n, k], o[n, k // G])."""

    q: np.ndarray
    s: np.ndarray
    o: np.ndarray | None
    bits: int

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.s.shape[1]

    def dequantize(self) -> np.ndarray:
        """fp32 [N, K] (the reference: fma done as an exact s * q, then one rounding of the sum)."""
        N, K = self.q.shape
        qf = self.q.astype(np.float32).reshape(N, -1, self.group)
        w = self.s[..., None] * qf
        if self.o is not None:
            w = w + self.o[..., None]
        return w.reshape(N, K)

    def rows(self, index) -> "BlockWeight":
        """The rows `index` (a permutation, a slice)."""
        return BlockWeight(self.q[index], self.s[index], None if self.o is None else self.o[index], self.bits)

    def as_layout(self, bits: int, group: int, offset: bool) -> "BlockWeight":
        """The same values stored wider (4 -> 8 bits), in smaller groups (a divisor of G) or with a zero
        offset: lossless, so parts of a fused weight (q / k / v, gate / up) can share one layout."""
        if bits < self.bits or self.group % group or (self.o is not None and not offset):
            raise ValueError(f"cannot store a {self.bits}-bit, G={self.group} weight as {bits}-bit, G={group}")
        rep = self.group // group
        s = np.repeat(self.s, rep, axis=1)
        o = None if not offset else (np.zeros_like(s) if self.o is None else np.repeat(self.o, rep, axis=1))
        return BlockWeight(self.q, s, o, bits)

    def panels(self) -> QuantizedPanels:
        o = None if self.o is None else torch.from_numpy(np.ascontiguousarray(self.o))
        return QuantizedPanels.pack(torch.from_numpy(np.ascontiguousarray(self.q)),
                                    torch.from_numpy(np.ascontiguousarray(self.s)), o, self.bits)


def concat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Parts stacked along the output rows (HF's q, k, v -> our wqkv), in the widest layout any part needs."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    offset = any(p.o is not None for p in parts)
    parts = [p.as_layout(bits, group, offset) for p in parts]
    o = np.concatenate([p.o for p in parts]) if offset else None
    return BlockWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.s for p in parts]), o, bits)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (last axis) -> their fp16 value as fp32 [n_blocks, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes [n, B] -> values [n, 2 B]: each run of `chunk` bytes gives its low nibbles, then its high ones
    (the order of Q4_0 / Q4_1 (chunk 16) and Q4_K (chunk 32) blocks)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(blocks):
    d, qs = blocks[:, :2], blocks[:, 2:]
    d = _f16(d)
    return _nibbles(qs, 16), d, -8.0 * d, 4  # -8 d: exact (a power-of-two multiple of an fp16 value)


def _q4_1(blocks):
    d, m, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:]
    return _nibbles(qs, 16), d, m, 4


def _q8_0(blocks):
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    return np.ascontiguousarray(qs).view(np.int8), d, None, 8


def _bits(b: np.ndarray, count: int) -> np.ndarray:
    """Bytes [n, B] -> bit j of each byte, for j < count, as [n, count, B] uint8 (the high bits of Q5 / Q3_K
    blocks: sub-block j of a K-quant takes bit j of every byte)."""
    return (b[:, None, :] >> np.arange(count, dtype=np.uint8).reshape(1, count, 1)) & np.uint8(1)


def _q5_high(blocks, at: int) -> np.ndarray:
    """Q5_0 / Q5_1: the 32 fifth bits (a little-endian uint32 at byte `at`) -> [n, 32] uint8: weight j takes bit
    j % 8 of byte j // 8."""
    return _bits(blocks[:, at:at + 4], 8).transpose(0, 2, 1).reshape(-1, 32)


def _q5_0(blocks):
    d = _f16(blocks[:, :2])
    q = (_nibbles(blocks[:, 6:], 16) | (_q5_high(blocks, 2) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return q, d, None, 8


def _q5_1(blocks):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 8:], 16) | (_q5_high(blocks, 4) << np.uint8(4)), d, m, 8


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _q4_k(blocks):
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    s = d * sc.astype(np.float32)  # [n, 8]: one per 32 weights
    o = -(dmin * mn.astype(np.float32))
    return _nibbles(blocks[:, 16:], 32), s, o, 4


def _q5_k(blocks):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    s = d * sc.astype(np.float32)  # [n, 8]: one per 32 weights
    o = -(dmin * mn.astype(np.float32))
    high = _bits(blocks[:, 16:48], 8)  # [n, 8, 32]: sub-block j takes bit j of the 32 bytes
    q = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32) | (high << np.uint8(4))
    return q.reshape(n, QK_K), s, o, 8


def _q3_k(blocks):
    n = blocks.shape[0]
    hmask, qs, sc, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    low = (sc[:, None, :8] >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16) & np.uint8(0x0F)
    high = (sc[:, None, 8:] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16) & np.uint8(3)
    s = d * ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)  # [n, 16]
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    # gguf: q = ql - 4 where the mask bit is 0; stored as ql + 4 * bit (0..7) with the offset -4 s (exact)
    q = ql.reshape(n, 16, 16) + (_bits(hmask, 8).reshape(n, 16, 16) << np.uint8(2))
    return q.reshape(n, QK_K), s, -4.0 * s, 4


def _q2_k(blocks):
    n = blocks.shape[0]
    sc, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    s = d * (sc & np.uint8(0x0F)).astype(np.float32)  # [n, 16]: one per 16 weights
    o = -(dmin * (sc >> np.uint8(4)).astype(np.float32))
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return q.reshape(n, QK_K), s, o, 4


def _q6_k(blocks):
    n = blocks.shape[0]
    ql, qh = blocks[:, :QK_K // 2], blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    scales = np.ascontiguousarray(blocks[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16])
    d = _f16(blocks[:, -2:])
    s = d * scales.view(np.int8).astype(np.float32)  # [n, 16]: one per 16 weights
    ql = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, -1, 32)
    qh = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), s, None, 8


# GGML type name -> (bytes per block, weights per block, decoder)
DECODERS = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q8_0": (34, 32, _q8_0),
    "Q5_0": (22, 32, _q5_0),
    "Q5_1": (24, 32, _q5_1),
    "Q2_K": (84, QK_K, _q2_k),
    "Q3_K": (110, QK_K, _q3_k),
    "Q4_K": (144, QK_K, _q4_k),
    "Q5_K": (176, QK_K, _q5_k),
    "Q6_K": (210, QK_K, _q6_k),
}


def decode_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockWeight:
    """A GGUF tensor's raw bytes (uint8 [N, row bytes]) of type `type_name` -> BlockWeight [N, K]."""
    if type_name not in DECODERS:
        raise ValueError(f"GGML type {type_name} is not decoded by the quantized kernel ({', '.join(DECODERS)})")
    block_bytes, block_size, decode = DECODERS[type_name]
    N, K = shape
    if K % block_size or data.size != N * (K // block_size) * block_bytes:
        raise ValueError(f"{type_name} tensor of shape {shape} holds {data.size} bytes, not "
                         f"{N * (K // block_size) * block_bytes}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    q, s, o, bits = decode(blocks)
    groups_per_block = s.shape[1]
    return BlockWeight(np.ascontiguousarray(q.reshape(N, K).astype(np.int8, copy=False)),
                       np.ascontiguousarray(s.reshape(N, (K // block_size) * groups_per_block), dtype=np.float32),
                       None if o is None else np.array(np.broadcast_to(o, s.shape).reshape(N, -1),
                                                       dtype=np.float32, order="C"), bits)
