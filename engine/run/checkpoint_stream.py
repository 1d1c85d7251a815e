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

from collections.abc import Callable, Iterator

import numpy as np

from engine.run import checkpoint as ck, pieces

FRESH = "fresh"  # manifest["optimizer"]: no optimizer state stored; restore starts one


def save_params(directory: str, step: int, arrays: list[tuple[str, tuple, np.dtype]],
                produce: Callable[[str], np.ndarray], meta: dict) -> str:
    """Write checkpoint `step` of params only: `arrays` [(key path, shape, dtype)] in
    order, `produce(key)` making each array when its turn comes (freed after it is
    written), each laid out as `pieces.layout` lays a piece and written as
    `checkpoint.write` writes a file (`ck._write_atomic`: temporary name, fsync, rename)."""
    table = {}

    def each_array():
        offset = 0
        for key, shape, dtype in arrays:
            x = np.ascontiguousarray(produce(key), dtype=dtype)
            if x.shape != tuple(shape):
                raise ValueError(f"{key}: made {x.shape}, the manifest says {shape}")
            laid, buffers, offset = pieces.layout(
                {"params": {key: [([[0, n] for n in x.shape], x)]}}, start=offset)
            table.update(laid["params"])
            yield from buffers
            del x, buffers

    def header() -> bytes:
        record = dict(meta, format=ck.FORMAT, step=step, versions=ck.versions(), processes=1,
                      optimizer=FRESH, shards=[],
                      arrays={"params": {k: {"dtype": str(np.dtype(d)), "shape": list(s)}
                                         for k, s, d in arrays}, "opt_state": {}},
                      pieces={"params": table, "opt_state": {}})
        return pieces.tail(record)[0]

    path = ck.checkpoint_path(directory, step)
    ck._write_atomic(path, each_array(), step, finish=header)
    return path


def read_meta(path: str) -> dict:
    """The manifest's fields but its arrays and pieces (model, train, layout, ...), read
    without touching any array's bytes."""
    return ck.open_checkpoint(path, parts=()).meta


def iter_params(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key path, global host array) of every param of the checkpoint at `path`, one at
    a time, each read from its pieces when its turn comes."""
    for key, x in ck.open_checkpoint(path, parts=("params",)).params.items():
        yield key, x.read() if isinstance(x, pieces.Stored) else x
