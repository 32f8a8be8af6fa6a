"""Rows of a safetensors tensor read from the file by offset, not through a memory map.

safetensors' `safe_open` maps the whole file, and every page a read touches stays resident in
the process (and counted in its RSS) until the handle closes: reading a 32000 x 768 fp32
embedding a block of rows at a time still holds its 94 MiB of file pages at the end, beside
the copy being filled. Read with `pread` into one reused buffer, a tensor costs only that
buffer. The header is the format's own (a little-endian u64 length, then JSON naming each
tensor's dtype, shape and byte range after the header); `safe_open` has checked it by the time
the loader reads here, and the range is checked again against the file before any read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

# The float dtypes weights come in; a tensor of another dtype is read through `safe_open`.
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound


class TensorRows:
    """Tensor `name` of the safetensors file `path`: its dtype and shape, and its rows."""

    def __init__(self, path: str, name: str, entry: dict, data_start: int):
        self.path, self.name = path, name
        self.dtype = DTYPES[entry["dtype"]]
        self.shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        size = os.path.getsize(path)
        if (
            not self.shape
            or min(self.shape) < 0
            or begin < 0
            or end - begin != self.shape[0] * self.row_bytes
            or data_start + end > size
        ):
            raise ValueError(f"{path}: tensor {name}'s byte range does not match its shape")
        self.offset = data_start + begin

    def blocks(self, rows_per_block: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) for consecutive blocks of at most `rows_per_block` rows, each in
        the same buffer: a block is valid until the next is read."""
        buffer = np.empty((min(rows_per_block, self.shape[0]), *self.shape[1:]), self.dtype)
        with open(self.path, "rb", buffering=0) as f:
            for first in range(0, self.shape[0], rows_per_block):
                rows = min(rows_per_block, self.shape[0] - first)
                view = buffer[:rows]
                _read_exactly(f.fileno(), view, self.offset + first * self.row_bytes)
                yield first, view


def open_rows(path: str, name: str) -> TensorRows | None:
    """Tensor `name` of `path` for reading by rows; None when its dtype is not one of
    `DTYPES` (the caller reads it otherwise). ValueError for a header that cannot be read."""
    with open(path, "rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", start)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    entry = header.get(name) if isinstance(header, dict) else None
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        return None
    try:
        return TensorRows(path, name, entry, 8 + length)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: tensor {name}'s header entry is malformed ({err!r})") from None


def _read_exactly(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"unexpected end of file at byte {offset + done}")
        done += got
