"""A GGUF file's settings and tensor table, read without making an object of every vocabulary string.

gguf's GGUFReader builds numpy views of every value of every key, the tokenizer's ~100k strings
and merges included: 8-9 s of every engine start on the default model (a 2-core Zen 3), though
the weights need only the scalar settings and where each tensor lies. This reader walks the
string arrays by their lengths (the tokenizer is converted once, by transformers, and cached) and
maps the tensors' bytes as GGUFReader does; asked for them, it reads the strings too (the
benchmarks' checkpoint builder copies the default model's vocabulary), as plain Python strings.
Little-endian GGUF versions 2 and 3 (what llama.cpp and gguf-py write)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
# The numeric value types as stored (little-endian); STRING and ARRAY are read by _Cursor.value.
_NUMBERS: dict[int, str] = {GGUFValueType.UINT8: "u1", GGUFValueType.INT8: "i1", GGUFValueType.UINT16: "<u2",
            GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
            GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
            GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
# Tensor types stored as elements (the others as blocks of bytes).
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as GGUF lists them (and ReaderTensor.shape)
    data: np.ndarray  # a read-only view of the file: elements, or each row's block bytes


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # each key's value (arrays as lists); arrays of strings only if asked for
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]  # each key's type and an array's item type
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview, strings: bool) -> None:
        self.buf, self.at, self.strings = buf, 0, strings

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8")

    def value(self, kind: int) -> Any:
        """The value of a type; None for an array of strings unless they are asked for (stepped over)."""
        if kind in _NUMBERS:
            return self.numbers(_NUMBERS[kind], 1)[0]
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"GGUF value type {kind} is not one the format defines")
        item, count = self.take("I"), self.take("Q")
        if item not in _NUMBERS and item not in (GGUFValueType.STRING, GGUFValueType.ARRAY):  # even with no items
            raise ValueError(f"GGUF array item type {item} is not one the format defines")
        if item in _NUMBERS:
            return self.numbers(_NUMBERS[item], count)
        if item == GGUFValueType.STRING and self.strings:
            return [self.string() for _ in range(count)]
        if item == GGUFValueType.STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
            return None
        return [self.value(item) for _ in range(count)]

    def numbers(self, dtype: str, count: int) -> list:
        values: np.ndarray = np.frombuffer(self.buf, dtype, count, self.at)
        self.at += values.nbytes
        return values.tolist()


def read_gguf_header(path: str, strings: bool = False) -> GGUFHeader:
    """The file's settings and tensors; strings: also the arrays of strings (the vocabulary)."""
    file = np.memmap(path, mode="r")
    try:
        return _read(path, file, strings)
    except struct.error as e:  # a length or count pointing past the end
        raise ValueError(f"{path}: the GGUF header ends early ({e})") from e
    except ValueError as e:  # the cursor's refusals (a value or tensor type, a string's bytes) name no file
        if path in str(e):
            raise
        raise ValueError(f"{path}: {e}") from e


def _read(path: str, file: np.memmap, strings: bool) -> GGUFHeader:
    cur = _Cursor(memoryview(file.data), strings)
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with {_MAGIC!r})")
    cur.at = 4
    version = cur.take("I")
    if version & 0xFFFF == 0:
        raise ValueError(f"{path} is a big-endian GGUF file: not supported (llama.cpp's tools write little-endian)")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_keys = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(n_keys):
        key = cur.string()
        kind = cur.take("I")
        item = struct.unpack_from("<I", cur.buf, cur.at)[0] if kind == GGUFValueType.ARRAY else None
        value = cur.value(kind)  # refuses a type the format does not define
        if key in types:
            raise ValueError(f"{path}: the key {key!r} appears twice")
        types[key] = (GGUFValueType(kind), None if item is None else GGUFValueType(item))
        if value is not None:
            metadata[key] = value
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        table.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    if len({name for name, *_ in table}) != len(table):
        raise ValueError(f"{path}: a tensor name appears twice")
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {align!r}")
    start = -(-cur.at // align) * align
    tensors = []
    for name, dims, kind, offset in table:
        block, size = GGML_QUANT_SIZES[kind]
        outer = tuple(reversed(dims))  # outermost first
        if kind not in _ELEMENTS and outer and outer[-1] % block:
            raise ValueError(f"{path}: tensor {name}'s rows of {outer[-1]} values are not whole {kind.name} blocks of {block}")
        count = int(np.prod(dims, dtype=np.int64))
        at = start + offset
        element = _ELEMENTS.get(kind)
        nbytes = count * np.dtype(element).itemsize if element else count // block * size
        if at + nbytes > len(file):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        raw = file[at:at + nbytes]
        data = raw.view(element).reshape(outer) if element else raw.reshape(*outer[:-1], outer[-1] // block * size)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return GGUFHeader(metadata, types, tensors)
