"""A GGUF file's header read in one pass with ``struct`` (torch- and numpy-free): the scalar
metadata and the tensor table, without decoding the tokenizer's arrays.

``gguf.GGUFReader`` builds a numpy view for every element of every array (SmolLM2's 49k tokens
and 49k merges take it 2-7 s); the config needs a dozen scalars and the loader the tensor table,
so both read them here (``tests/models/test_gguf.py`` checks the result against GGUFReader's).
``models/gguf_loader.py`` dequantizes the tensors with ``gguf.quants``.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUFValueType -> struct format of one scalar (8 = string, 9 = array are read by hand).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFMetadata:
    fields: dict[str, Any]  # scalars and strings; arrays are their length only (an ``ArrayLen``)
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int


class ArrayLen(int):
    """Stands for an array value: its element count (the elements are skipped)."""


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self._skip_array()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self.pos}")
        return self.unpack(_SCALARS[vtype])

    def _skip_array(self) -> ArrayLen:
        etype, count = self.unpack("I"), self.unpack("Q")
        if etype in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[etype])
        elif etype == _STRING:  # the tokenizer's vocabulary and merges: only their lengths are read
            length, buf = struct.Struct("<Q").unpack_from, self.buf
            for _ in range(count):
                self.pos += 8 + length(buf, self.pos)[0]
        else:
            for _ in range(count):
                self.value(etype)
        if self.pos > len(self.buf):
            raise ValueError(f"an array of {count} elements runs past the end of the file")
        return ArrayLen(count)


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """The header of the GGUF file at ``path``; ``ValueError``/``struct.error`` on bad bytes."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(_Cursor(buf), len(buf))


def _parse(cur: _Cursor, size: int) -> GGUFMetadata:
    magic = bytes(cur.buf[:4])
    cur.pos = 4
    if magic != GGUF_MAGIC:
        raise ValueError(f"it does not start with the GGUF magic (found {magic!r})")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_fields = cur.unpack("Q"), cur.unpack("Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("I"))
    tensors = {}
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        tensors[name] = TensorInfo(shape, cur.unpack("I"), cur.unpack("Q"))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    return GGUFMetadata(fields, tensors, -(-cur.pos // align) * align, size)
