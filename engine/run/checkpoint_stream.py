"""Checkpoints written and read one array at a time, for converters that must never hold
the model twice (engine/hf/): format 4 (engine/run/pieces.py), whose pieces come before
the header, so each array is written as soon as it is made and the header follows.

`save_params` writes a step's params with no optimizer state and `optimizer: fresh` in the
manifest: `checkpoint.restore` then starts the optimizer afresh (zero moments, count 0),
as a run's step 0 would. `iter_params` yields a checkpoint's params one global array at
a time, each read from its pieces (`pieces.Stored`); `read_meta` reads the manifest's
fields without any array.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator

import numpy as np

from engine.run import checkpoint as ck
from engine.run import pieces

FRESH = "fresh"  # manifest["optimizer"]: no optimizer state stored; restore starts one


def save_params(directory: str, step: int, arrays: list[tuple[str, tuple, np.dtype]],
                produce: Callable[[str], np.ndarray], meta: dict) -> str:
    """Write checkpoint `step` of params only: `arrays` [(key path, shape, dtype)] in
    order, `produce(key)` making each array when its turn comes (freed after it is
    written). Written to a temporary name, fsynced and renamed into place, as
    `checkpoint.write` does."""
    path = ck.checkpoint_path(directory, step)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    table, offset = {}, 0
    try:
        with open(tmp, "wb") as f:
            for key, shape, dtype in arrays:
                x = np.ascontiguousarray(produce(key), dtype=dtype)
                if x.shape != tuple(shape):
                    raise ValueError(f"{key}: made {x.shape}, the manifest says {shape}")
                piece, offset = _write_piece(f, offset, x)
                table[key] = [piece]
                del x
            record = dict(meta, format=ck.FORMAT, step=step, versions=ck.versions(),
                          processes=1, optimizer=FRESH, shards=[],
                          arrays={"params": {k: {"dtype": str(np.dtype(d)), "shape": list(s)}
                                             for k, s, d in arrays}, "opt_state": {}},
                          pieces={"params": table, "opt_state": {}})
            f.write(pieces.tail(record)[0])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        ck._remove_quietly(tmp)
        raise
    return path


def _write_piece(f, offset: int, x: np.ndarray) -> tuple[dict, int]:
    """Write the whole array x as one piece at the first aligned offset from `offset`
    (its bytes straight from its buffer); (the piece's header entry, the offset after
    it)."""
    data = pieces.as_bytes(x)
    pad = -offset % pieces.ALIGN
    f.write(bytes(pad))
    f.write(data)
    piece = {"index": [[0, n] for n in x.shape], "offset": offset + pad,
             "nbytes": len(data), "crc32": zlib.crc32(data)}
    return piece, offset + pad + len(data)


def read_meta(path: str) -> dict:
    """The manifest's fields but its arrays and pieces (model, train, layout, ...), read
    without touching any array's bytes."""
    return ck.open_checkpoint(path, parts=()).meta


def iter_params(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key path, global host array) of every param of the checkpoint at `path`, one at
    a time, each read from its pieces when its turn comes."""
    for key, x in ck.open_checkpoint(path, parts=("params",)).params.items():
        yield key, x.read() if isinstance(x, pieces.Stored) else x
