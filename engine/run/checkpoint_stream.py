"""Checkpoints written and read one array at a time, for converters that must never hold
the model twice (engine/hf/): the same one-process format `engine.run.checkpoint` writes
and reads (its docstring), with the msgpack map streamed key by key.

`save_params` writes a step's params with no optimizer state and `optimizer: fresh` in the
manifest: `checkpoint.restore` then starts the optimizer afresh (zero moments, count 0),
as a run's step 0 would. `iter_params` yields a checkpoint's params one global array at
a time (a one-process checkpoint; one written by several processes is read whole).
"""
from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator

import msgpack
import numpy as np

from engine.run import checkpoint as ck

FRESH = "fresh"  # manifest["optimizer"]: no optimizer state stored; restore starts one
_BIN32 = b"\xc6"  # msgpack bin 32: the marker, then a 4-byte big-endian length


def save_params(directory: str, step: int, arrays: list[tuple[str, tuple, np.dtype]],
                produce: Callable[[str], np.ndarray], meta: dict) -> str:
    """Write checkpoint `step` of params only: `arrays` [(key path, shape, dtype)] in
    order, `produce(key)` making each array when its turn comes (freed after). The
    manifest is written to a temporary name and renamed into place, as `ck.save` does."""
    path = ck.checkpoint_path(directory, step)
    name = os.path.basename(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    pk = msgpack.Packer()
    head = dict(meta, format=ck.FORMAT, step=step, versions=ck.versions(), processes=1,
                optimizer=FRESH, shards=[],
                arrays={"params": {k: {"dtype": str(np.dtype(d)), "shape": list(s)}
                                   for k, s, d in arrays}, "opt_state": {}})
    try:
        with open(tmp, "wb") as f:
            f.write(pk.pack_map_header(len(head) + 1))
            f.writelines(pk.pack(key) + pk.pack(value) for key, value in head.items())
            f.write(pk.pack("pieces") + pk.pack_map_header(2) + pk.pack("params")
                    + pk.pack_map_header(len(arrays)))
            for key, shape, dtype in arrays:
                x = np.ascontiguousarray(produce(key), dtype=dtype)
                if x.shape != tuple(shape):
                    raise ValueError(f"{key}: made {x.shape}, the manifest says {shape}")
                _write_piece(f, pk, key, x)
                del x
            f.write(pk.pack("opt_state") + pk.pack_map_header(0))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        ck._remove_quietly(tmp)
        raise
    return path


def _write_piece(f, pk: msgpack.Packer, key: str, x: np.ndarray) -> None:
    """`key: [{index, chunks, crc32}]`, the array's bytes written straight from its buffer
    in `ck._CHUNK` pieces (no copy of the array is made)."""
    data = memoryview(x.reshape(-1).view(np.uint8))
    chunks = [data[i:i + ck._CHUNK] for i in range(0, len(data), ck._CHUNK)] or [data]
    f.write(pk.pack(key) + pk.pack_array_header(1) + pk.pack_map_header(3)
            + pk.pack("index") + pk.pack([[0, n] for n in x.shape])
            + pk.pack("chunks") + pk.pack_array_header(len(chunks)))
    crc = 0
    for chunk in chunks:
        f.write(_BIN32 + len(chunk).to_bytes(4, "big"))
        f.write(chunk)
        crc = zlib.crc32(chunk, crc)
    f.write(pk.pack("crc32") + pk.pack(crc))


# -- reading: a small msgpack walker over the file, so that arrays are read straight into
# their numpy buffers and whatever is not wanted is skipped by seeking past it (msgpack's
# Unpacker would have to buffer a whole object, the pieces map being the whole model)
def _take(f, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise ValueError("truncated")
    return b


def _uint(f, n: int) -> int:
    return int.from_bytes(_take(f, n), "big")


def _head(f) -> tuple[str, object]:
    """The next object's kind (map, array, str, bin, value) and its length or value."""
    t = _take(f, 1)[0]
    if t <= 0x7F or t >= 0xE0:
        return "value", t if t <= 0x7F else t - 0x100
    if 0x80 <= t <= 0x8F:
        return "map", t & 0x0F
    if 0x90 <= t <= 0x9F:
        return "array", t & 0x0F
    if 0xA0 <= t <= 0xBF:
        return "str", t & 0x1F
    sized = {0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xD9: ("str", 1),
             0xDA: ("str", 2), 0xDB: ("str", 4), 0xDC: ("array", 2), 0xDD: ("array", 4),
             0xDE: ("map", 2), 0xDF: ("map", 4)}
    if t in sized:
        kind, n = sized[t]
        return kind, _uint(f, n)
    if t in (0xC0, 0xC2, 0xC3):
        return "value", {0xC0: None, 0xC2: False, 0xC3: True}[t]
    if t in (0xCA, 0xCB):
        return "value", struct.unpack(">f" if t == 0xCA else ">d", _take(f, 4 if t == 0xCA else 8))[0]
    if 0xCC <= t <= 0xCF:
        return "value", _uint(f, 1 << (t - 0xCC))
    if 0xD0 <= t <= 0xD3:
        n = 1 << (t - 0xD0)
        return "value", int.from_bytes(_take(f, n), "big", signed=True)
    raise ValueError(f"unsupported msgpack type 0x{t:02x}")


def _value(f):
    """The next object, decoded."""
    kind, n = _head(f)
    if kind == "map":
        return {_value(f): _value(f) for _ in range(n)}
    if kind == "array":
        return [_value(f) for _ in range(n)]
    if kind == "str":
        return _take(f, n).decode()
    if kind == "bin":
        return _take(f, n)
    return n


def _skip(f) -> None:
    """Step over the next object without reading its strings' or bins' bytes."""
    kind, n = _head(f)
    if kind in ("str", "bin"):
        f.seek(n, os.SEEK_CUR)
    elif kind in ("map", "array"):
        for _ in range(2 * n if kind == "map" else n):
            _skip(f)


def _map(f) -> int:
    kind, n = _head(f)
    if kind != "map":
        raise ValueError(f"expected a map, found {kind}")
    return n


def read_meta(path: str) -> dict:
    """The manifest's fields but its arrays and pieces (model, train, layout, ...), read
    without touching any array's bytes."""
    try:
        with open(path, "rb") as f:
            meta = {}
            for _ in range(_map(f)):
                key = _value(f)
                if key in ("pieces", "arrays"):
                    _skip(f)
                else:
                    meta[key] = _value(f)
            return meta
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ck.CheckpointError(f"cannot read checkpoint {path} ({e})") from None


def _read_array(f, key: str, entry: dict) -> np.ndarray:
    """An array's pieces ([{index, chunks, crc32}]) read into one global array; chunk
    bytes go straight into it when a piece covers the whole array."""
    dtype = ck._DTYPES.get(entry["dtype"]) or np.dtype(entry["dtype"])
    out = np.empty(entry["shape"], dtype)
    flat = memoryview(out.reshape(-1).view(np.uint8))
    _, n_pieces = _head(f)
    filled = 0
    for _ in range(n_pieces):
        index, crc, got, data = None, None, 0, []
        for _ in range(_map(f)):
            field = _value(f)
            if field != "chunks":
                value = _value(f)
                index, crc = (value, crc) if field == "index" else (index, value)
                continue
            whole = index == [[0, n] for n in out.shape]
            _, n_chunks = _head(f)
            pos = 0
            for _ in range(n_chunks):
                _, n = _head(f)
                if whole:
                    view = flat[pos:pos + n]
                    if f.readinto(view) != n:
                        raise ValueError("truncated")
                    got = zlib.crc32(view, got)
                else:
                    data.append(_take(f, n))
                    got = zlib.crc32(data[-1], got)
                pos += n
        if got != crc:
            raise ValueError(f"{key}: checksum mismatch")
        region = tuple(slice(a, b) for a, b in index)
        if data:
            out[region] = np.frombuffer(b"".join(data), dtype).reshape(out[region].shape)
        filled += out[region].size
    if filled != out.size:
        raise ValueError(f"{key}: pieces cover {filled} of {out.size} elements")
    return out


def iter_params(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key path, global array) of a checkpoint's params, one at a time; a checkpoint
    written by several processes (shard files) or in an older format is read whole."""
    meta = read_meta(path)
    if meta.get("shards") or meta.get("format") != ck.FORMAT:
        yield from ck.read(path, parts=("params",)).params.items()
        return
    try:
        with open(path, "rb") as f:
            arrays = None
            for _ in range(_map(f)):
                key = _value(f)
                if key == "arrays":
                    arrays = _value(f)["params"]
                elif key != "pieces":
                    _skip(f)
                    continue
                else:
                    for _ in range(_map(f)):
                        part = _value(f)
                        for _ in range(_map(f)):
                            name = _value(f)
                            if part != "params":
                                _skip(f)
                                continue
                            yield name, _read_array(f, name, arrays[name])
                    return
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ck.CheckpointError(f"checkpoint {path} is unreadable or truncated ({e})") from None
