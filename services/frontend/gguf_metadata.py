"""Read the key-value metadata of a GGUF file (tokenizer, chat template) in well under a second.

`gguf.GGUFReader` builds numpy views for every string of the vocabulary and every
tensor, which takes seconds on a 49k-token vocabulary; the frontend needs only the
metadata section, so it walks that section with `struct` and stops before the
tensor infos. Value types come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGUF_MAGIC, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data, self.offset = data, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        return self.data[start:self.offset].decode("utf-8", errors="replace")

    def value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if item_kind in _SCALAR_FORMATS:  # one bulk unpack for numeric arrays
                fmt = _SCALAR_FORMATS[item_kind]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.offset)
                self.offset += count * struct.calcsize(fmt)
                return list(values)
            return [self.value(item_kind) for _ in range(count)]
        return self.unpack(_SCALAR_FORMATS[kind])


def read_gguf_metadata(path: str | Path) -> dict:
    """All key-value pairs of a GGUF file's header, as plain Python values."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)  # only the pages of the metadata section are read
        if cursor.unpack("<I") != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic number)")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        cursor.unpack("<Q")  # tensor count
        num_fields = cursor.unpack("<Q")
        metadata = {}
        for _ in range(num_fields):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.unpack("<I")))
        return metadata
