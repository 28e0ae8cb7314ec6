"""The header of a GGUF file (key-value metadata and tensor infos), read with `struct`; torch-free.

One reader for both sides: the frontend takes the tokenizer and chat template from the
metadata (`read_gguf_metadata`), the engine's loader the architecture and where each tensor
lies (`read_gguf_header`). `gguf.GGUFReader` would build a numpy view per vocabulary string
and per tensor, seconds on SmolLM2's 49k tokens; this walks the header once over an mmap,
touching only its pages. The `gguf` package supplies the type tables.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT32: "f",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}


class GGUFTensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # GGUF order: the innermost (contiguous) dimension first
    qtype: GGMLQuantizationType
    offset: int  # bytes from the start of the tensor data section


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_start: int  # file offset of the (aligned) tensor data section


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.offset = data, 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.data, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.offset = self.offset, self.offset + length
        return self.data[start:self.offset].decode("utf-8", errors="replace")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[kind])
        item_kind, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if item_kind in _SCALAR_FORMATS:  # one bulk unpack for numeric arrays
            code = f"<{count}{_SCALAR_FORMATS[item_kind]}"
            values = struct.unpack_from(code, self.data, self.offset)
            self.offset += struct.calcsize(code)
            return list(values)
        return [self.value(item_kind) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key-value pairs of a GGUF file's header, as plain Python values."""
    return _read(path, with_tensors=False).metadata


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata, the tensor infos and where the tensor data starts (v2 and v3, little-endian)."""
    return _read(path, with_tensors=True)


def _read(path: str | Path, with_tensors: bool) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if len(data) < 24 or cursor.scalar("I") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic number)")
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        metadata = {}
        for _ in range(num_fields):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.scalar("I")))
        if not with_tensors:
            return GGUFHeader(metadata, [], 0)
        tensors = []
        for _ in range(num_tensors):
            name, num_dims = cursor.string(), cursor.scalar("I")
            dims = tuple(cursor.scalar("Q") for _ in range(num_dims))
            tensors.append(GGUFTensorInfo(name, dims, GGMLQuantizationType(cursor.scalar("I")), cursor.scalar("Q")))
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        return GGUFHeader(metadata, tensors, -(-cursor.offset // alignment) * alignment)
