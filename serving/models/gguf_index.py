"""A GGUF file's tensor index over one memory map, without parsing its metadata values.

`gguf.GGUFReader` turns every metadata value into numpy objects — for a tokenizer's vocabulary
and merges that is ~100k small arrays, 160 MiB at peak and ~65 MiB the allocator keeps after
they are freed, in a process that needs two strings of it.  This index walks the metadata only
to skip it (keeping the scalar and string values it meets, never the arrays) and gives each
tensor the same `name`, `tensor_type`, `shape` (GGUF order) and `data` (a view of the map shaped
as gguf-py shapes it) that `gguf.ReaderTensor` has.  Little-endian GGUF v2/v3 only; anything else
is read by gguf-py's reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# GGUF metadata value types -> struct format of a fixed-size value
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass
class IndexedTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the row length first
    data: np.ndarray  # a view of the map


class GGUFIndex:
    """`fields` holds the scalar and string metadata; `tensors` the index; `mmap` the shared map."""

    def __init__(self, path: Path) -> None:
        self.data = np.memmap(path, mode="c")
        self.mmap = getattr(self.data, "_mmap", None)
        buf, self._pos = memoryview(self.data), 0
        self._buf = buf
        magic, version = self._read("<II")
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path.name}: not a little-endian GGUF v2/v3 file")
        n_tensors, n_kv = self._read("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            value = self._value(self._read("<I")[0])
            if value is not None:
                self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")[0]
            dims = self._read(f"<{n_dims}Q")
            ttype, offset = self._read("<IQ")
            infos.append((name, dims, gguf.GGMLQuantizationType(ttype), offset))
        align = int(self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, ttype, start + offset) for name, dims, ttype, offset in infos]
        self._buf = None
        buf.release()

    def _read(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        n = self._read("<Q")[0]
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        """A scalar or string value; an array is skipped (None)."""
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._read("<IQ")
            if item == _STRING:
                for _ in range(count):
                    n = self._read("<Q")[0]  # read first: `_pos +=` would load _pos before the read moves it
                    self._pos += n
            elif item == _ARRAY:
                for _ in range(count):
                    self._value(_ARRAY)
            else:
                self._pos += count * struct.calcsize("<" + _FIXED[item])
            return None
        return self._read("<" + _FIXED[vtype])[0]

    def _tensor(self, name: str, dims: tuple, ttype: gguf.GGMLQuantizationType, offset: int) -> IndexedTensor:
        np_dims = tuple(int(d) for d in reversed(dims))
        n = int(np.prod(np_dims)) if np_dims else 1
        if ttype in _FLOAT_TYPES:
            dtype = np.dtype(_FLOAT_TYPES[ttype])
            data = self.data[offset : offset + n * dtype.itemsize].view(dtype).reshape(np_dims)
        else:
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            shape = (*np_dims[:-1], np_dims[-1] // block * size)
            data = self.data[offset : offset + n // block * size].reshape(shape)
        return IndexedTensor(name, ttype, np.array(dims, dtype=np.uint64), data)
