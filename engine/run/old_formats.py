"""Reading checkpoints of formats 1 to 3, whose pieces (or whole arrays) are msgpack bins
inside the files: each array is assembled whole on the host."""
from __future__ import annotations

import os
import zlib

import msgpack
import numpy as np

from engine.run import pieces

FORMAT_3 = "shardwise-checkpoint/3"  # pieces as msgpack bins inside the files: still read
FORMAT_2 = "shardwise-checkpoint/2"  # the down projections stored [F, D]: still read
FORMAT_1 = "shardwise-checkpoint/1"  # one file, whole arrays, as format 2: still read
# params stored [.., F, D] before format 3 and [.., D, F] since (engine/parallel/params.py: wd as
# wg and wu), with their optimizer state
DOWN_PROJECTIONS = ("['wd']", "['ws_d']")
SHARD_FORMAT_2 = "shardwise-checkpoint-shard/2"  # format 3's shard files
OLD_FORMATS = (FORMAT_3, FORMAT_2, FORMAT_1)
PARTS = ("params", "opt_state")


def _decode(key: str, entry: dict) -> np.ndarray:
    data = b"".join(entry["chunks"])
    if zlib.crc32(data) != entry["crc32"]:
        raise ValueError(f"{key}: checksum mismatch")
    dtype = pieces.dtype_of(entry["dtype"])
    return np.frombuffer(data, dtype).reshape(entry["shape"])


def _assemble(key: str, entry: dict, found: list[dict]) -> np.ndarray:
    """The global array `entry` describes from the pieces every process wrote."""
    dtype = pieces.dtype_of(entry["dtype"])
    out = np.empty(entry["shape"], dtype)
    filled = 0
    for piece in found:
        data = b"".join(piece["chunks"])
        if zlib.crc32(data) != piece["crc32"]:
            raise ValueError(f"{key}: checksum mismatch")
        region = tuple(slice(start, stop) for start, stop in piece["index"])
        out[region] = np.frombuffer(data, dtype).reshape(out[region].shape)
        filled += out[region].size
    if filled != out.size:
        raise ValueError(f"{key}: pieces cover {filled} of {out.size} elements")
    return out


def _read_shard(directory: str, entry: dict, step: int) -> dict:
    """A format-3 shard file's pieces, after checking it is the one the manifest names."""
    path = os.path.join(directory, entry["file"])
    try:
        with open(path, "rb") as f:
            payload = f.read()
    except OSError as e:
        raise ValueError(f"its shard file {path}: {e.strerror or e}") from None
    if len(payload) != entry["size"] or zlib.crc32(payload) != entry["crc32"]:
        raise ValueError(f"shard {entry['file']} is not the one the manifest names "
                         f"(size or checksum differs)")
    shard = msgpack.unpackb(payload)
    if shard.get("format") != SHARD_FORMAT_2 or shard.get("step") != step:
        raise ValueError(f"shard {entry['file']} is not a shard of step {step}")
    return shard["pieces"]


def upgrade(found: dict, fmt: str) -> dict:
    """{part: {key path: array}} of a checkpoint of format `fmt`, in this format's
    layout: before format 3 the down projections' (and their Adam moments') last two
    axes are swapped."""
    if fmt not in (FORMAT_1, FORMAT_2):
        return found
    return {part: {k: np.swapaxes(x, -1, -2) if k.endswith(DOWN_PROJECTIONS) else x
                   for k, x in arrays.items()} for part, arrays in found.items()}


def read_whole(path: str, parts: tuple[str, ...], checkpoint):
    """`checkpoint(path, step, meta, params, opt_state)` of a file of format 1, 2 or 3
    (pieces inside msgpack), every array assembled."""
    with open(path, "rb") as f:
        record = msgpack.unpackb(f.read())
    if not isinstance(record, dict) or record.get("format") not in OLD_FORMATS:
        raise ValueError("not a shardwise checkpoint")
    step = int(record["step"])
    if record["format"] == FORMAT_1:
        whole = {part: record.pop(part) for part in PARTS}
        found = {part: {k: _decode(k, v) for k, v in whole[part].items()} for part in parts}
    else:
        arrays, table = record.pop("arrays"), record.pop("pieces")
        shards = [_read_shard(os.path.dirname(path), e, step) for e in record["shards"]]
        found = {part: {k: _assemble(k, entry, table[part][k] + [
                            piece for s in shards for piece in s[part][k]])
                        for k, entry in arrays[part].items()}
                 for part in parts}
    found = upgrade(found, record["format"])
    return checkpoint(path, step, record, found.get("params"), found.get("opt_state"))


