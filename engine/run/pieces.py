"""Format 4's files and the reader that restores by pieces.

A file (the manifest, or a shard file of process p > 0) is

    [piece bytes, each at a 64-byte aligned offset][msgpack header][u64 header size][MAGIC]

The header lists each piece as `{index: [[start, stop], ...] per dim, offset, nbytes,
crc32}` (offset from the start of the file). Writing the data first lets process 0 write
its own pieces while the other processes write theirs, and append the manifest's header
once it knows their files. A reader reads the header from the end of the file and then
only the byte ranges of the pieces that overlap the regions it asks for (`Stored`), each
piece once and a CHUNK at a time, straight into the regions' arrays: a process restoring
its devices' shards holds those shards and one chunk, never a whole piece or array more.
"""
from __future__ import annotations

import math
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


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-order host array whose data starts at an ALIGN-byte boundary:
    jax's CPU client takes such an array as a device buffer without copying it."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


CHUNK = 8 << 20  # bytes of a piece read at a time (at least one row of its first dim)


class PieceFile:
    """Reads pieces of one file by byte range, a few rows at a time, checking their
    crc32."""

    def __init__(self, path: str):
        self.path = path

    def chunks(self, key: str, piece: dict, dtype: np.dtype):
        """Yield (first row, rows) of the piece in order: blocks of its rows along dim 0
        (a 0-d piece: one block, row 0), each at most CHUNK bytes unless one row is
        larger, read into one reused buffer (copy what you keep before the next). The
        piece's crc32 is checked once the last block is read: a ValueError then."""
        shape = [stop - start for start, stop in piece["index"]]
        rows, inner = (shape[0], shape[1:]) if shape else (1, [])
        row_bytes = dtype.itemsize * math.prod(inner)
        if rows * row_bytes != piece["nbytes"]:
            raise ValueError(f"{key}: a piece of {piece['nbytes']} bytes for {shape}")
        per = max(1, CHUNK // max(row_bytes, 1))
        buf = np.empty(min(per, rows) * row_bytes, np.uint8)
        first = piece["index"][0][0] if shape else 0
        crc = 0
        with open(self.path, "rb") as f:
            f.seek(piece["offset"])
            for r0 in range(0, rows, per):
                view = buf[:min(per, rows - r0) * row_bytes]
                if f.readinto(memoryview(view)) != view.size:
                    raise ValueError(f"{key}: {os.path.basename(self.path)} is truncated")
                crc = zlib.crc32(view, crc)
                yield first + r0, view.view(dtype).reshape([-1, *inner] if shape else [])
        if crc != piece["crc32"]:
            raise ValueError(f"{key}: checksum mismatch")


class Stored:
    """One global array of a format-4 checkpoint, not read yet: `shape`, `dtype`, and
    `x[index]` (a tuple of slices) reads only the pieces that overlap `index` into a new
    host array of the region's shape; `regions` reads several regions at once. `x[order]`
    (an integer array) is the array with its rows taken in `order`, still unread (a
    circular pipeline's layer order)."""

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
        return self.regions([[list(sl.indices(n)[:2]) for sl, n in zip(index, self.shape)]])[0]

    def read(self) -> np.ndarray:
        """The whole array."""
        return self[()]

    def regions(self, regions: list[list[list[int]]]) -> list[np.ndarray]:
        """The host arrays of `regions` ([[start, stop] per dim] each), each new and
        ALIGN-byte aligned. Every piece that overlaps any of them is read once, a CHUNK
        at a time, and its rows copied where they go: the host holds the regions and one
        chunk, never a whole piece or array beyond them."""
        outs = [aligned_empty([stop - start for start, stop in r], self.dtype)
                for r in regions]
        wants = [self._source_rows(r) for r in regions]  # dim 0: the stored row of each
        filled = [0] * len(outs)
        for file, piece in self.pieces:
            span = piece["index"]
            hits = [i for i, r in enumerate(regions) if _overlaps(r, wants[i], span)]
            if not hits:
                continue
            for first, block in file.chunks(self.key, piece, self.dtype):
                for i in hits:
                    filled[i] += _copy(outs[i], regions[i], wants[i], block, first, span)
        for out, n in zip(outs, filled):
            if n != out.size:
                raise ValueError(f"{self.key}: pieces cover {n} of {out.size} elements")
        return outs

    def _source_rows(self, region) -> np.ndarray | None:
        if not self.ndim:
            return None
        start, stop = region[0]
        return np.arange(start, stop) if self.rows is None else self.rows[start:stop]


def _overlaps(region, want, span) -> bool:
    if want is None:  # 0-d
        return True
    rest = all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(region[1:], span[1:]))
    return rest and bool(np.any((want >= span[0][0]) & (want < span[0][1])))


def _copy(out, region, want, block, first, span) -> int:
    """Copy the part of `block` (rows `first`.. of the piece at `span`) that `out` (the
    array of `region`, whose dim-0 rows are the stored rows `want`) holds; the number
    of elements copied."""
    if want is None:
        out[()] = block
        return 1
    at = np.flatnonzero((want >= first) & (want < first + block.shape[0]))
    if not at.size:
        return 0
    both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region[1:], span[1:])]
    src = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(both, span[1:]))
    dst = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(both, region[1:]))
    rows = want[at] - first
    if at[-1] - at[0] + 1 == at.size and np.all(np.diff(rows) == 1):  # a run: views
        out[(slice(at[0], at[-1] + 1), *dst)] = block[(slice(rows[0], rows[-1] + 1), *src)]
    else:
        out[(at, *dst)] = block[(rows, *src)]
    return at.size * math.prod(b - a for a, b in both)
