"""A GGUF file's metadata and tensor table, read in one pass over the header.

gguf-py's ``GGUFReader`` makes a numpy view for every element of every metadata array: a file with
a 49,152-token vocabulary and its merges (SmolLM2's) costs about 250,000 views, 4-7 s of CPU on
each open, which every server start, every simulator shape and every engine built from the file
paid. This reads the same header with ``struct`` over the bytes (a few tens of milliseconds) and
gives the tensors' data as views of one read-only memory map, in the shapes and dtypes
``GGUFReader`` gives them, so gguf-py's ``quants.dequantize`` reads them as before. Little-endian
files of GGUF versions 2 and 3 (what llama.cpp writes); anything else is handed to ``GGUFReader``.

``read_gguf(path)`` returns ``(metadata, tensors)``: metadata as ``ReaderField.contents()`` gives it
(strings, Python numbers and bools, lists), the file's own bookkeeping (``GGUF.*``) left out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFTensor", "read_gguf"]

_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType): struct format and numpy dtype of the scalar ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` in the file's order (fastest-varying dimension first, as
    ``ReaderTensor.shape``), ``data`` a read-only view of its bytes shaped as ``ReaderTensor.data``."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        s = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return s

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_scalar(item)[1])
            values = np.frombuffer(self.buf, dtype, count, self.pos)  # ValueError past the end
            self.pos += dtype.itemsize * count
            return values.tolist()
        fmt = _scalar(kind)[0]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v


def _scalar(kind: int) -> tuple[str, str]:
    got = _SCALARS.get(kind)
    if got is None:
        raise ValueError(f"unknown GGUF value type {kind}")
    return got


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The metadata and tensors of the GGUF file at ``path``. ValueError (or struct.error for a file
    cut short) when it is not a GGUF file this can read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    buf = memoryview(data).cast("B")
    cur = _Cursor(buf)
    if len(buf) < 24 or cur.u32() != _MAGIC:
        raise ValueError("GGUF magic invalid")
    version = cur.u32()
    if version not in _VERSIONS:
        return _with_gguf_reader(path) if version & 0xFFFF == 0 else _unsupported(version)
    tensor_count, kv_count = cur.u64(), cur.u64()
    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        if key in meta:
            raise ValueError(f"duplicate metadata key {key!r}")
        meta[key] = cur.value(cur.u32())
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.u64() for _ in range(cur.u32()))
        infos.append((name, dims, cur.u32(), cur.u64()))
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid alignment {alignment!r}: must be a power of two")
    start = -(-cur.pos // alignment) * alignment
    typed = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}  # fmt: skip
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        qtype = GGMLQuantizationType(raw_type)
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        nbytes = count * size // block
        shape = tuple(reversed(dims))
        begin = start + offset
        if begin + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        dtype = typed.get(qtype.name)
        if dtype is None:
            array = data[begin : begin + nbytes].reshape(quant_shape_to_byte_shape(shape, qtype))
        else:
            array = data[begin : begin + nbytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, qtype, dims, array))
    return meta, tensors


def _unsupported(version: int):
    raise ValueError(f"GGUF version {version} is not supported (2 or 3)")


def _with_gguf_reader(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A file of the other byte order: gguf-py's reader, which swaps (slowly, but such files are rare)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, [
        GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors
    ]
