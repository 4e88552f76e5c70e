"""A GGUF file's header read without materialising its big arrays: the scalar fields and the tensors' data.

gguf's GGUFReader parses every field into numpy parts, so the tokenizer's arrays (49k token strings and 49k
merges for SmolLM2) become ~200k small arrays, ~160 MB of resident objects for the whole load, which is more
than the model's quantized weights. Loading the weights (model/gguf_quantized.py) needs only the config
scalars, how long the token array is, and each tensor's type, shape and bytes. GGUFIndex walks the header
once (a string array's items are skipped by their lengths), keeps scalars and strings as Python values, an
array as its length (numeric arrays of up to 64 items also as a list), and reads each tensor's bytes when
asked, typed and shaped as GGUFReader's `data` (F32 / F16 typed, quantized types uint8 [rows, bytes]).

It offers the part of GGUFReader's interface gguf_convert.gguf_config and the loader use: `fields[key]`
(`.contents()`, `.data` whose len() is the array's length) and `tensors` (`.name`, `.tensor_type`, `.shape`
in GGUF's innermost-first order, `.data`). A file whose header runs off its end, whose tensor types are
unknown or whose tensors end past its end is a ValueError naming it, with gguf_convert.open_gguf's messages.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian, versions 2 and 3).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 64  # numeric arrays up to this many items keep their values
_ALIGNMENT = 32  # general.alignment's default


@dataclass
class IndexField:
    """A field's value (a scalar, a string, a small numeric array as a list; None for other arrays) and, for an
    array, its length (`data` is a range of it, as GGUFReader's field.data has one index per item)."""

    value: Any
    length: int = 1

    def contents(self):
        return self.value

    @property
    def data(self) -> range:
        return range(self.length)


@dataclass
class IndexTensor:
    """A tensor's name, type (gguf.GGMLQuantizationType), dims (innermost first, as GGUFReader's
    ReaderTensor.shape) and `data`: its bytes read from the file on each access, typed and shaped as
    GGUFReader's memory map of them. Read, not mapped: a mapping's touched pages stay resident until the
    whole file is unmapped (72 MB for SmolLM2 at the end of a load), a read's buffer is freed after use."""

    name: str
    tensor_type: Any
    shape: np.ndarray
    path: str | os.PathLike
    offset: int  # of the first byte in the file
    dtype: Any
    np_shape: tuple

    @property
    def data(self) -> np.ndarray:
        count = math.prod(self.np_shape)
        out = np.fromfile(self.path, dtype=self.dtype, count=count, offset=self.offset)
        if out.size != count:
            raise ValueError(f"{self.path} is truncated: tensor {self.name!r} could not be read whole")
        return out.reshape(self.np_shape)


class _Header:
    """A cursor over the file's bytes: each read checks it stays inside the file."""

    def __init__(self, buf: np.ndarray, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ValueError(f"{self.path} is not a readable GGUF file (corrupt or truncated): the header runs past "
                             f"byte {len(self.buf)}")
        out = self.buf[self.pos:end].tobytes()
        self.pos = end
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is not a readable GGUF file (corrupt or truncated): a string is not "
                             "UTF-8") from None

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path} is not a readable GGUF file (corrupt or truncated): a string runs past "
                             f"byte {len(self.buf)}")
        self.pos += n

    def value(self, vtype: int) -> IndexField:
        if vtype in _SCALARS:
            return IndexField(self.unpack(_SCALARS[vtype]))
        if vtype == _STRING:
            return IndexField(self.string())
        if vtype != _ARRAY:
            raise ValueError(f"{self.path} is not a readable GGUF file (corrupt or truncated): unknown field type "
                             f"{vtype}")
        itype, n = self.unpack("<I"), self.unpack("<Q")
        if itype == _STRING:
            for _ in range(n):
                self.skip_string()
            return IndexField(None, n)
        if itype == _ARRAY:  # an array of arrays: each skipped (the loader reads none)
            for _ in range(n):
                self.value(_ARRAY)
            return IndexField(None, n)
        if itype not in _SCALARS:
            raise ValueError(f"{self.path} is not a readable GGUF file (corrupt or truncated): an array of field "
                             f"type {itype}")
        size = struct.calcsize(_SCALARS[itype])
        raw = self.take(size * n)
        small = [struct.unpack_from(_SCALARS[itype], raw, i * size)[0] for i in range(n)] if n <= _SMALL_ARRAY else None
        return IndexField(small, n)


class GGUFIndex:
    """`fields` (key -> IndexField) and `tensors` (IndexTensor, in file order) of a GGUF file; see the module doc."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        if os.path.getsize(path) < 24:  # magic, version and the two counts
            raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): {os.path.getsize(path)} "
                             "bytes")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        h = _Header(buf, path)
        if h.take(4) != _MAGIC:
            raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): no GGUF magic")
        version = h.unpack("<I")
        if version in (2 << 24, 3 << 24):
            raise ValueError(f"{path} is a big-endian GGUF file; hydra_kernels reads little-endian ones")
        if version not in (2, 3):
            raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): GGUF version {version} "
                             "(versions 2 and 3 are read)")
        n_tensors, n_fields = h.unpack("<Q"), h.unpack("<Q")
        # GGUFReader's own entries for the header's counts first, then the file's fields
        self.fields: dict[str, IndexField] = {"GGUF.version": IndexField(version), "GGUF.tensor_count":
                                              IndexField(n_tensors), "GGUF.kv_count": IndexField(n_fields)}
        for _ in range(n_fields):
            key = h.string()
            if key in self.fields:
                raise ValueError(f"{path}: field {key!r} appears twice; the file is corrupt")
            self.fields[key] = h.value(h.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.unpack("<Q") for _ in range(h.unpack("<I"))]
            infos.append((name, dims, h.unpack("<I"), h.unpack("<Q")))
        align = self.fields.get("general.alignment", IndexField(_ALIGNMENT)).value
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
            raise ValueError(f"{path}: general.alignment is {align!r}, not a positive integer; the file is corrupt")
        start = -(-h.pos // align) * align
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        self.tensors: list[IndexTensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: tensor {name!r} has unknown type {raw_type}; the file is corrupt") from None
            if name in seen:
                raise ValueError(f"{path}: tensor {name!r} appears twice; the file is corrupt")
            seen.add(name)
            n_bytes = math.prod(dims) * type_size // block  # Python ints: corrupt dims cannot wrap around
            begin = start + offset
            if begin + n_bytes > len(buf):
                raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {begin + n_bytes} but the file has "
                                 f"{len(buf)} bytes; download or copy it again")
            np_dims = tuple(reversed(dims))
            if qtype.name in typed:
                dtype, np_shape = typed[qtype.name], np_dims
            else:
                dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_dims, qtype)
            self.tensors.append(IndexTensor(name, qtype, np.array(dims, dtype=np.uint64), path, begin, dtype,
                                            tuple(np_shape)))
        del h, buf  # the header's mapping: tensors read their bytes when asked
