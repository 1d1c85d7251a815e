"""Checkpoints: one msgpack file per saved step, every array in its global shape, written
atomically, re-sharded on load into whatever layout the reader runs.

    DIR/step_00000100.ckpt   msgpack map:
      format, step          "shardwise-checkpoint/1", steps completed
      rng                   {"seed": s}: params init from jax.random.key(s); the batch of
                            step t is drawn from np.random.default_rng([s, t]) (engine.data)
      model, train          every ModelConfig and TrainConfig field
      layout, data          the writer's layout string and data source
      versions              python, jax, jaxlib, numpy, optax, ml_dtypes, shardwise
      params, opt_state     {key path: {dtype, shape, crc32, chunks: [bytes, ...]}}

Key paths are `jax.tree_util.keystr` of each leaf (`['blocks']['wq']`, `[0].mu['embed']`);
the optimizer state is restored into the structure `Trainer.tx.init` gives, so any
structure change fails loudly. bf16 leaves round-trip through ml_dtypes.

A save writes `.step_XXXXXXXX.ckpt.tmp-PID`, fsyncs it, renames it into place and fsyncs
the directory: a kill at any instant leaves every complete checkpoint intact, and
readers never see the temporary name. One writer per directory.
"""
from __future__ import annotations

import dataclasses
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

from engine.params import param_shapes

FORMAT = "shardwise-checkpoint/1"
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab")
_NAME = re.compile(r"step_(\d{8})\.ckpt")
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
    """Create `directory` if needed and prove a file can be written and fsynced there."""
    probe = os.path.join(directory, f".probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {directory}: "
                              f"{e.strerror or e}") from None


def versions() -> dict:
    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for package in ("jax", "jaxlib", "optax", "ml_dtypes", "shardwise"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


# -- save ------------------------------------------------------------------------------
def _to_host(x) -> np.ndarray:
    """The global value of a (possibly sharded) array on this host. With several
    processes every process takes part in the gather; only process 0 writes."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _encode(x_host: np.ndarray) -> dict:
    data = np.ascontiguousarray(x_host).tobytes()
    return {"dtype": str(x_host.dtype), "shape": list(x_host.shape), "crc32": zlib.crc32(data),
            "chunks": [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]}


def _encode_tree(tree) -> dict:
    return {jax.tree_util.keystr(path): _encode(_to_host(x))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save(directory: str, step: int, params, opt_state, meta: dict, keep: int) -> str:
    """Write checkpoint `step` atomically, then delete all but the newest `keep` and any
    temporary file a killed writer left. `meta` holds model/train/layout/data/rng."""
    record = dict(meta, format=FORMAT, step=step, versions=versions(),
                  params=_encode_tree(params), opt_state=_encode_tree(opt_state))
    path = checkpoint_path(directory, step)
    if jax.process_index() != 0:
        return path
    try:
        _write_atomic(path, msgpack.packb(record), step)
        for _, old in list_checkpoints(directory)[:-keep]:
            os.remove(old)
        for name in os.listdir(directory):
            if ".ckpt.tmp-" in name and not name.endswith(f"-{os.getpid()}"):
                os.remove(os.path.join(directory, name))
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    return path


def _write_atomic(path: str, payload: bytes, step: int) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    if os.environ.get(KILL_HOOK) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace(tmp, path)
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- load ------------------------------------------------------------------------------
def _decode(key: str, entry: dict) -> np.ndarray:
    data = b"".join(entry["chunks"])
    if zlib.crc32(data) != entry["crc32"]:
        raise ValueError(f"{key}: checksum mismatch")
    dtype = _DTYPES.get(entry["dtype"]) or np.dtype(entry["dtype"])
    return np.frombuffer(data, dtype).reshape(entry["shape"])


def read(path: str) -> Checkpoint:
    """Read and verify one checkpoint file (format, every array's checksum and size)."""
    try:
        with open(path, "rb") as f:
            record = msgpack.unpackb(f.read())
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError("not a shardwise checkpoint")
        params, opt_state = ({k: _decode(k, v) for k, v in record.pop(part).items()}
                             for part in ("params", "opt_state"))
        return Checkpoint(path, int(record["step"]), record, params, opt_state)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or truncated "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"move it aside to resume from an older one") from None


def latest(directory: str) -> Checkpoint | None:
    """The newest complete checkpoint in `directory`, read and verified; None if none."""
    found = list_checkpoints(directory)
    return read(found[-1][1]) if found else None


def check_model(ckpt: Checkpoint, cfg) -> None:
    """Raise unless the checkpoint's model shape equals `cfg`'s (compute dtype, remat and
    attention kernel may differ: they do not change the params)."""
    saved = ckpt.meta.get("model", {})
    diff = [f"{f}={saved.get(f)} (flags give {getattr(cfg, f)})" for f in SHAPE_FIELDS
            if saved.get(f) != getattr(cfg, f)]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt.path} holds a different model: "
                              + ", ".join(diff))


def restore(ckpt: Checkpoint, trainer) -> tuple:
    """(params, opt_state) from `ckpt`, placed as `trainer`'s layout stores them."""
    check_model(ckpt, trainer.cfg)
    shapes = param_shapes(trainer.cfg)
    opt_shapes = jax.eval_shape(trainer.tx.init, shapes)
    return (_place(ckpt.params, shapes, trainer.specs, trainer.mesh, ckpt.path, "params"),
            _place(ckpt.opt_state, opt_shapes, trainer.opt_specs, trainer.mesh, ckpt.path,
                   "opt_state"))


def _place(saved: dict, shapes, specs, mesh, path: str, part: str):
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
        out.append(jax.device_put(x, NamedSharding(mesh, spec)))
    return jax.tree.unflatten(treedef, out)
