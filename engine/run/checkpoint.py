"""Checkpoints: per saved step, a manifest plus one shard file per process beyond the
first; every process writes only the shards its devices hold; any process count and any
layout reads them back, re-sharded into whatever layout the reader runs.

    DIR/step_00000100.ckpt                     the manifest (msgpack map), written last:
      format, step          "shardwise-checkpoint/3", steps completed
      rng                   {"seed": s}: params init from jax.random.key(s); the batch of
                            step t is drawn from np.random.default_rng([s, t]) (engine.run.data)
      model, train          every ModelConfig and TrainConfig field
      layout, data          the writer's layout string and data source
      versions              python, jax, jaxlib, numpy, optax, ml_dtypes, shardwise
      processes             how many processes wrote it
      arrays                {"params"|"opt_state": {key path: {dtype, shape}}} (global)
      pieces                process 0's pieces: {part: {key path: [piece, ...]}}
      shards                [{file, size, crc32}] of processes 1.. (empty with one process)
    DIR/step_00000100.ckpt.shard-00001-of-00002   {format, step, process, pieces}

A piece is one device shard `{index: [[start, stop], ...] per dim, crc32, chunks}`; only
shards with replica_id 0 are written, so each element is stored exactly once. With one
process a checkpoint is the manifest alone, one file, as in format 1 (whole arrays, which
`read` still accepts). Format 3 stores the down projections [.., D, F]; `read` turns the
[.., F, D] of formats 1 and 2 around (`upgrade`). Key paths are `jax.tree_util.keystr`
of each leaf (`['blocks']['wq']`, `[0].mu['embed']`); the optimizer state is restored
into the structure `Trainer.tx.init` gives, so any structure change fails loudly. bf16
leaves round-trip through ml_dtypes.

Every file is written as `.NAME.tmp-PID`, fsynced, renamed into place, and the
directory fsynced. Shard files first; then a barrier (an all-gather of each shard file's
size and crc32); then process 0 writes the manifest: the checkpoint exists from that
rename on, and a shard file that is not the one its manifest names (size or crc32
differs) is refused. A kill at any instant leaves every complete checkpoint intact and
readers never see a temporary name; process 0 deletes temporary files and shard files
no kept manifest names. One run per directory; a multi-host run needs a directory all
hosts share.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import sys
import zlib
from importlib import metadata

import jax
import ml_dtypes
import msgpack
import numpy as np
from jax.sharding import NamedSharding

from engine.parallel.params import param_shapes

FORMAT = "shardwise-checkpoint/3"
FORMAT_2 = "shardwise-checkpoint/2"  # the down projections stored [F, D]: still read
FORMAT_1 = "shardwise-checkpoint/1"  # one file, whole arrays, as format 2: still read
# params stored [.., F, D] before format 3 and [.., D, F] since (engine/parallel/params.py: wd as
# wg and wu), with their optimizer state
DOWN_PROJECTIONS = ("['wd']", "['ws_d']")
SHARD_FORMAT = "shardwise-checkpoint-shard/2"
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab",
                "experts", "shared_experts", "vocab_multiple", "tie_embed")
_NAME = re.compile(r"step_(\d{8})\.ckpt")
_SHARD_NAME = re.compile(r"step_(\d{8})\.ckpt\.shard-\d{5}-of-\d{5}")
_CHUNK = 1 << 30  # msgpack bin objects hold < 4 GiB; arrays are split into 1 GiB chunks
_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}
KILL_HOOK = "SHARDWISE_TEST_KILL_IN_CHECKPOINT_WRITE"  # tests: SIGKILL before the rename


class CheckpointError(ValueError):
    """An unusable checkpoint or checkpoint directory: one line, exit code 2."""


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint read to host memory: `meta` is everything but the arrays; `params`
    and `opt_state` map key paths to numpy arrays of their global shape."""

    path: str
    step: int
    meta: dict
    params: dict
    opt_state: dict


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.ckpt")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """[(step, path)] of the complete checkpoints in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in os.listdir(directory) if (m := _NAME.fullmatch(name))]
    return sorted(found)


def check_writable(directory: str) -> None:
    """Create `directory` if needed and prove a file can be written and fsynced there;
    the probe file is removed whether or not the write succeeded."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"cannot write checkpoints to {directory}: it is a file, "
                              f"not a directory")
    probe = os.path.join(directory, f".probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {directory}: "
                              f"{e.strerror or e}") from None
    finally:
        _remove_quietly(probe)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def versions() -> dict:
    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for package in ("jax", "jaxlib", "optax", "ml_dtypes", "shardwise"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


# -- save ------------------------------------------------------------------------------
def _index(index, shape) -> list[list[int]]:
    """A shard's tuple of slices -> [[start, stop], ...] per dimension."""
    return [list(sl.indices(n)[:2]) for sl, n in zip(index, shape)]


def _piece(index: list, x_host: np.ndarray) -> dict:
    data = np.ascontiguousarray(x_host).tobytes()
    return {"index": index, "crc32": zlib.crc32(data),
            "chunks": [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]}


def _pieces(x) -> list[dict]:
    """This process's share of leaf `x`: one piece per addressable shard whose replica_id
    is 0, so across all processes every element is written exactly once. A host value
    (numpy) is one whole-array piece, written by process 0."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
        return [_piece([[0, n] for n in x.shape], x)] if jax.process_index() == 0 else []
    return [_piece(_index(s.index, x.shape), np.asarray(s.data))
            for s in x.addressable_shards if s.replica_id == 0]


def _describe(x) -> dict:
    return {"dtype": str(np.dtype(x.dtype)), "shape": list(x.shape)}


def _flat(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(path), x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shard_path(path: str, process: int, processes: int) -> str:
    return f"{path}.shard-{process:05d}-of-{processes:05d}"


def save(directory: str, step: int, params, opt_state, meta: dict, keep: int) -> str:
    """Write checkpoint `step`; every process calls it. Process p > 0 writes its pieces to
    a shard file; after a barrier process 0 writes the manifest (its own pieces inline,
    the shard files' names, sizes and crc32s) atomically: the checkpoint exists from that
    rename on. Then process 0 deletes all but the newest `keep` checkpoints, shard files
    no manifest names, and temporary files a killed writer left."""
    path = checkpoint_path(directory, step)
    me, n = jax.process_index(), jax.process_count()
    leaves = {part: _flat(tree) for part, tree in (("params", params), ("opt_state", opt_state))}
    pieces = {part: {k: _pieces(x) for k, x in flat} for part, flat in leaves.items()}
    shard = None
    try:
        if me > 0:
            payload = msgpack.packb({"format": SHARD_FORMAT, "step": step, "process": me,
                                     "pieces": pieces})
            shard = shard_path(path, me, n)
            _write_atomic(shard, payload, step)
        sizes = _gather_ints([len(payload), zlib.crc32(payload)] if me > 0 else [0, 0])
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {shard}: {e.strerror or e}") from None
    if me != 0:
        return path
    record = dict(meta, format=FORMAT, step=step, versions=versions(), processes=n,
                  arrays={part: {k: _describe(x) for k, x in flat}
                          for part, flat in leaves.items()},
                  pieces=pieces,
                  shards=[{"file": os.path.basename(shard_path(path, p, n)), "size": size,
                           "crc32": crc} for p, (size, crc) in enumerate(sizes) if p > 0])
    try:
        _write_atomic(path, msgpack.packb(record), step)
        _prune(directory, keep)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    return path


def _gather_ints(values: list[int]) -> list[list[int]]:
    """[[values of process p] for p]; also the barrier after the shard files' renames."""
    if jax.process_count() == 1:
        return [values]
    from jax.experimental import multihost_utils
    mine = np.asarray(values, np.int64).view(np.int32)  # no x64: carry int64 as 2 int32
    out = np.asarray(multihost_utils.process_allgather(mine))
    return [row.view(np.int64).tolist() for row in out.reshape(jax.process_count(), -1)]


def _prune(directory: str, keep: int) -> None:
    complete = list_checkpoints(directory)
    for _, old in complete[:-keep]:
        os.remove(old)
    kept = {os.path.basename(p) for _, p in complete[-keep:]}
    for name in os.listdir(directory):
        stale_tmp = ".ckpt.tmp-" in name or ".ckpt.shard-" in name and ".tmp-" in name
        if stale_tmp and not name.endswith(f"-{os.getpid()}"):
            os.remove(os.path.join(directory, name))
        elif (m := _SHARD_NAME.fullmatch(name)) and f"step_{m.group(1)}.ckpt" not in kept:
            os.remove(os.path.join(directory, name))


def _write_atomic(path: str, payload: bytes, step: int) -> None:
    """Write `payload` to a temporary name, fsync, rename to `path`, fsync the directory.
    A failed write removes its temporary file; out of space, the error says how many
    bytes the file needs and how many are free."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        _remove_quietly(tmp)
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on device: {name} needs "
                          f"{_mib(len(payload))}, {_mib(_free_bytes(directory))} free") from None
        raise
    if os.environ.get(KILL_HOOK) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace(tmp, path)
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory or ".")
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- load ------------------------------------------------------------------------------
def _decode(key: str, entry: dict) -> np.ndarray:
    data = b"".join(entry["chunks"])
    if zlib.crc32(data) != entry["crc32"]:
        raise ValueError(f"{key}: checksum mismatch")
    dtype = _DTYPES.get(entry["dtype"]) or np.dtype(entry["dtype"])
    return np.frombuffer(data, dtype).reshape(entry["shape"])


def _assemble(key: str, entry: dict, pieces: list[dict]) -> np.ndarray:
    """The global array `entry` describes from the pieces every process wrote."""
    dtype = _DTYPES.get(entry["dtype"]) or np.dtype(entry["dtype"])
    out = np.empty(entry["shape"], dtype)
    filled = 0
    for piece in pieces:
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
    """A shard file's pieces, after checking it is the one the manifest names."""
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
    if shard.get("format") != SHARD_FORMAT or shard.get("step") != step:
        raise ValueError(f"shard {entry['file']} is not a shard of step {step}")
    return shard["pieces"]


PARTS = ("params", "opt_state")


def upgrade(found: dict, fmt: str) -> dict:
    """{part: {key path: array}} of a checkpoint of format `fmt`, in this format's
    layout: before format 3 the down projections' (and their Adam moments') last two
    axes are swapped."""
    if fmt == FORMAT:
        return found
    return {part: {k: np.swapaxes(x, -1, -2) if k.endswith(DOWN_PROJECTIONS) else x
                   for k, x in arrays.items()} for part, arrays in found.items()}


def read(path: str, parts: tuple[str, ...] = PARTS) -> Checkpoint:
    """Read and verify one checkpoint (the manifest, every shard file it names, every
    piece's checksum, full coverage of every array) into global host arrays. Each reader
    assembles every whole array: simple, and host memory bounds the model anyway (see
    the CLI's memory check). Reads format 1 (one file, whole arrays) too. `parts` names
    what to decode (a part left out is None and its pieces are not checked: generation
    reads only the params)."""
    try:
        with open(path, "rb") as f:
            record = msgpack.unpackb(f.read())
        if not isinstance(record, dict) or record.get("format") not in (FORMAT, FORMAT_2,
                                                                        FORMAT_1):
            raise ValueError("not a shardwise checkpoint")
        step = int(record["step"])
        if record["format"] == FORMAT_1:
            whole = {part: record.pop(part) for part in PARTS}
            found = {part: {k: _decode(k, v) for k, v in whole[part].items()}
                     for part in parts}
        else:
            arrays, pieces = record.pop("arrays"), record.pop("pieces")
            shards = [_read_shard(os.path.dirname(path), e, step) for e in record["shards"]]
            found = {part: {k: _assemble(k, entry, pieces[part][k] + [
                                piece for s in shards for piece in s[part][k]])
                            for k, entry in arrays[part].items()}
                     for part in parts}
        found = upgrade(found, record["format"])
        return Checkpoint(path, step, record, found.get("params"), found.get("opt_state"))
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or truncated "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"move it aside to resume from an older one") from None


def latest(directory: str, parts: tuple[str, ...] = PARTS) -> Checkpoint | None:
    """The newest complete checkpoint in `directory`, read (`parts` of it) and verified;
    None if none."""
    found = list_checkpoints(directory)
    return read(found[-1][1], parts) if found else None


def check_model(ckpt: Checkpoint, cfg) -> None:
    """Raise unless the checkpoint's model shape equals `cfg`'s (compute dtype, remat and
    attention kernel may differ: they do not change the params)."""
    saved = ckpt.meta.get("model", {})
    default = {f.name: f.default for f in dataclasses.fields(cfg)}  # fields added later
    diff = [f"{f}={saved.get(f, default[f])} (flags give {getattr(cfg, f)})"
            for f in SHAPE_FIELDS if saved.get(f, default[f]) != getattr(cfg, f)]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt.path} holds a different model: "
                              + ", ".join(diff))


def restore_params(ckpt: Checkpoint, trainer):
    """The params of `ckpt`, placed as `trainer`'s layout stores them."""
    check_model(ckpt, trainer.cfg)
    return _place(ckpt.params, param_shapes(trainer.cfg), trainer.specs, trainer.mesh,
                  ckpt.path, "params", getattr(trainer, "layer_order", None))


def restore(ckpt: Checkpoint, trainer) -> tuple:
    """(params, opt_state) from `ckpt`, placed as `trainer`'s layout stores them; a
    checkpoint without optimizer state (`optimizer: fresh`, an imported model:
    engine/run/checkpoint_stream.py) gets a fresh one."""
    if ckpt.meta.get("optimizer") == "fresh":
        params = restore_params(ckpt, trainer)
        return params, trainer.init_opt(params)
    opt_shapes = jax.eval_shape(trainer.tx.init, param_shapes(trainer.cfg))
    return (restore_params(ckpt, trainer),
            _place(ckpt.opt_state, opt_shapes, trainer.opt_specs, trainer.mesh, ckpt.path,
                   "opt_state", getattr(trainer, "layer_order", None)))


def _place(saved: dict, shapes, specs, mesh, path: str, part: str, layer_order=None):
    """`saved` (the model's layer order) placed on `mesh` as `specs`; with a
    `layer_order` (a circular pipeline's, `Trainer.layer_order`) the stacked blocks'
    rows are taken in that order."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    spec_leaves = treedef.flatten_up_to(specs)
    keys = [jax.tree_util.keystr(p) for p, _ in leaves]
    if sorted(keys) != sorted(saved):
        missing, extra = sorted(set(keys) - set(saved)), sorted(set(saved) - set(keys))
        raise CheckpointError(f"checkpoint {path}: {part} structure differs "
                              f"(missing {missing or 'none'}, unexpected {extra or 'none'})")
    out = []
    for key, (_, want), spec in zip(keys, leaves, spec_leaves):
        x = saved[key]
        if x.shape != want.shape or x.dtype != want.dtype:
            raise CheckpointError(f"checkpoint {path}: {part}{key} is {x.dtype}{list(x.shape)}, "
                                  f"the model needs {want.dtype}{list(want.shape)}")
        if layer_order is not None and "['blocks']" in key:
            x = x[layer_order]
        out.append(jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                                lambda index, x=x: x[index]))
    return jax.tree.unflatten(treedef, out)
