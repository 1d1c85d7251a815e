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


def read_meta(path: str) -> dict:
    """The manifest's fields up to its arrays (model, train, layout, ...), read without
    decoding any array: the first keys of a streamed map, or the whole map otherwise."""
    try:
        with open(path, "rb") as f:
            up = msgpack.Unpacker(f, max_buffer_size=2**31 - 1)
            meta = {}
            for _ in range(up.read_map_header()):
                key = up.unpack()
                if key in ("pieces", "arrays"):
                    up.skip()
                    continue
                meta[key] = up.unpack()
            return meta
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise ck.CheckpointError(f"cannot read checkpoint {path} ({e})") from None


def iter_params(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key path, global array) of a checkpoint's params, one at a time."""
    meta = read_meta(path)
    if meta.get("shards") or meta.get("format") != ck.FORMAT:
        ckpt = ck.read(path, parts=("params",))
        yield from ckpt.params.items()
        return
    with open(path, "rb") as f:
        up = msgpack.Unpacker(f, max_buffer_size=2**31 - 1)
        arrays = None
        for _ in range(up.read_map_header()):
            key = up.unpack()
            if key == "arrays":
                arrays = up.unpack()["params"]
            elif key == "pieces":
                for _ in range(up.read_map_header()):
                    part = up.unpack()
                    for _ in range(up.read_map_header()):
                        name = up.unpack()
                        pieces = up.unpack()
                        if part == "params":
                            try:
                                yield name, ck._assemble(name, arrays[name], pieces)
                            except ValueError as e:
                                raise ck.CheckpointError(f"checkpoint {path}: {e}") from None
                return
            else:
                up.skip()
