"""Format 4's files and the reader that restores by pieces.

A file (the manifest, or a shard file of process p > 0) is

    [piece bytes, each at a 64-byte aligned offset][msgpack header][u64 header size][MAGIC]

The header lists each piece as `{index: [[start, stop], ...] per dim, offset, nbytes,
crc32}` (offset from the start of the file). Writing the data first lets process 0 write
its own pieces while the other processes write theirs, and append the manifest's header
once it knows their files. A reader reads the header from the end of the file and then
only the byte ranges of the pieces that overlap the region it asks for (`Stored`): a
process restoring its devices' shards never holds a whole array on the host.
"""
from __future__ import annotations

import os
import struct
import zlib

import ml_dtypes
import msgpack
import numpy as np

MAGIC = b"SHWDCKP4"
_TRAILER = struct.Struct("<Q8s")  # header size, MAGIC
ALIGN = 64  # bytes: every piece starts at a multiple
_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype_of(name: str) -> np.dtype:
    return _DTYPES.get(name) or np.dtype(name)


def as_bytes(x: np.ndarray) -> memoryview:
    """The bytes of a host array without a copy (C order)."""
    return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def layout(pieces: dict, start: int = 0) -> tuple[dict, list, int]:
    """{part: {key: [(index, host array)]}} -> (the header's piece table with offsets and
    checksums, the buffers to write in order (padding included), the offset they end at),
    laid out from byte `start` of the file."""
    table, buffers, offset = {}, [], start
    for part, arrays in pieces.items():
        table[part] = {}
        for key, found in arrays.items():
            table[part][key] = []
            for index, x in found:
                data = as_bytes(x)
                if pad := -offset % ALIGN:
                    buffers.append(bytes(pad))
                    offset += pad
                table[part][key].append({"index": index, "offset": offset,
                                         "nbytes": len(data), "crc32": zlib.crc32(data)})
                buffers.append(data)
                offset += len(data)
    return table, buffers, offset


def tail(header: dict) -> tuple[bytes, int]:
    """(the header and trailer bytes that end a file, crc32 of the header)."""
    packed = msgpack.packb(header)
    return packed + _TRAILER.pack(len(packed), MAGIC), zlib.crc32(packed)


def is_format_4(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < _TRAILER.size:
            return False
        f.seek(-_TRAILER.size, os.SEEK_END)
        return _TRAILER.unpack(f.read(_TRAILER.size))[1] == MAGIC


def read_header(path: str) -> tuple[dict, int, int]:
    """(header, crc32 of its bytes, file size) of a format-4 file; ValueError if the file
    is shorter than its header says or its pieces reach past the header."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < _TRAILER.size:
            raise ValueError(f"{os.path.basename(path)} is truncated")
        f.seek(-_TRAILER.size, os.SEEK_END)
        n, magic = _TRAILER.unpack(f.read(_TRAILER.size))
        if magic != MAGIC or n > size - _TRAILER.size:
            raise ValueError(f"{os.path.basename(path)} is truncated")
        f.seek(size - _TRAILER.size - n)
        packed = f.read(n)
    header = msgpack.unpackb(packed)
    data_end = size - _TRAILER.size - n
    for part in header["pieces"].values():
        for found in part.values():
            if any(p["offset"] + p["nbytes"] > data_end for p in found):
                raise ValueError(f"{os.path.basename(path)}: a piece reaches past its data")
    return header, zlib.crc32(packed), size


class PieceFile:
    """Reads whole pieces of one file by byte range, checks their crc32, and keeps the
    last piece read (a region read row by row asks for the same piece again)."""

    def __init__(self, path: str):
        self.path, self._last = path, (None, None)

    def read(self, key: str, piece: dict, dtype: np.dtype) -> np.ndarray:
        where = (key, piece["offset"])
        if self._last[0] == where:
            return self._last[1]
        buf = np.empty(piece["nbytes"], np.uint8)
        with open(self.path, "rb") as f:
            f.seek(piece["offset"])
            got = f.readinto(memoryview(buf))
        if got != piece["nbytes"]:
            raise ValueError(f"{key}: {os.path.basename(self.path)} is truncated")
        if zlib.crc32(buf) != piece["crc32"]:
            raise ValueError(f"{key}: checksum mismatch")
        shape = [stop - start for start, stop in piece["index"]]
        x = buf.view(dtype).reshape(shape)
        self._last = (where, x)
        return x


class Stored:
    """One global array of a format-4 checkpoint, not read yet: `shape`, `dtype`, and
    `x[index]` (a tuple of slices) reads only the pieces that overlap `index` into a new
    host array of the region's shape. `x[order]` (an integer array) is the array with its
    rows taken in `order`, still unread (a circular pipeline's layer order)."""

    def __init__(self, key: str, entry: dict, pieces: list[tuple[PieceFile, dict]],
                 rows: np.ndarray | None = None):
        self.key, self.entry, self.pieces, self.rows = key, entry, pieces, rows
        self.shape = tuple(entry["shape"])
        self.dtype = dtype_of(entry["dtype"])
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        if isinstance(index, (np.ndarray, list)):
            rows = np.asarray(index) if self.rows is None else self.rows[np.asarray(index)]
            return Stored(self.key, self.entry, self.pieces, rows)
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        region = [list(sl.indices(n)[:2]) for sl, n in zip(index, self.shape)]
        if self.rows is None or not self.ndim:
            return self._read(region)
        out = np.empty([stop - start for start, stop in region], self.dtype)
        for i, row in enumerate(self.rows[region[0][0]:region[0][1]]):
            out[i:i + 1] = self._read([[int(row), int(row) + 1]] + region[1:])
        return out

    def read(self) -> np.ndarray:
        """The whole array."""
        return self[()]

    def _read(self, region: list[list[int]]) -> np.ndarray:
        out = np.empty([stop - start for start, stop in region], self.dtype)
        filled = 0
        for file, piece in self.pieces:
            both = [[max(a, c), min(b, d)] for (a, b), (c, d) in zip(region, piece["index"])]
            if any(start >= stop for start, stop in both):
                continue
            data = file.read(self.key, piece, self.dtype)
            src = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(both, piece["index"]))
            dst = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(both, region))
            out[dst] = data[src]
            filled += out[dst].size
        if filled != out.size:
            raise ValueError(f"{self.key}: pieces cover {filled} of {out.size} elements")
        return out
