"""Checkpoints: per saved step, a manifest plus one shard file per process beyond the
first; every process writes only the shards its devices hold; any process count and any
layout reads them back, each process reading only the pieces its own devices need.

    DIR/step_00000100.ckpt       process 0's pieces, then the manifest header (msgpack):
      format, step          "shardwise-checkpoint/4", steps completed
      rng                   {"seed": s}: params init from jax.random.key(s); the batch of
                            step t is drawn from np.random.default_rng([s, t]) (engine.run.data)
      model, train          every ModelConfig and TrainConfig field
      config                the resolved command-line settings (engine/cli/config_file.py)
      layout, data          the writer's layout string and data source
      versions              python, jax, jaxlib, numpy, optax, ml_dtypes, shardwise
      processes             how many processes wrote it
      arrays                {"params"|"opt_state": {key path: {dtype, shape}}} (global)
      pieces                process 0's pieces: {part: {key path: [piece, ...]}}
      shards                [{file, size, crc32 of its header}] of processes 1..
    DIR/step_00000100.ckpt.shard-00001-of-00002   pieces, then {format, step, process, pieces}

A piece is one device shard `{index: [[start, stop], ...] per dim, offset, nbytes,
crc32}`, its bytes raw in the same file (engine/run/pieces.py has the file layout); only
shards with replica_id 0 are written, so each element is stored exactly once. With one
process a checkpoint is one file. Restoring (`open_checkpoint`, `restore`) reads the
headers, then for each device shard of the target layout only the pieces that overlap
it, checked against their crc32: no whole array is built on the host, and on CPU the
host arrays read become the device buffers (`_regions`), so a process's restore peaks at
its share of the state plus one chunk (bench/checkpoint.py). `read` gives
whole host arrays, and still reads formats 1 to 3 (engine/run/old_formats.py: msgpack
bins inside the file; formats 1 and 2 stored the down projections [.., F, D], which
`upgrade` turns around). Key paths are `jax.tree_util.keystr` of each leaf
(`['blocks']['wq']`, `[0].mu['embed']`); the optimizer state is restored into the
structure `Trainer.tx.init` gives, so any structure change fails loudly. bf16 leaves
round-trip through ml_dtypes.

A save is `snapshot` (this process's pieces copied to host memory, between steps) then
`write` (which may run in a background thread, engine/run/writer.py). Every file is
written as `.NAME.tmp-PID`, fsynced, renamed into place, and the directory fsynced.
Processes p > 0 write their shard files and post each file's size and header crc32 to
jax's coordination service; process 0 writes its pieces, waits for every post, appends
the manifest header and renames: the checkpoint exists from that rename on, and a shard
file that is not the one its manifest names (size or header crc32 differs) is refused.
A kill at any instant leaves every complete checkpoint intact and readers never see a
temporary name; process 0 deletes temporary files and shard files no kept manifest
names. One run per directory; a multi-host run needs a directory all hosts share.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import sys
from importlib import metadata

import jax
import msgpack
import numpy as np
from jax.sharding import NamedSharding

from engine.parallel.params import param_shapes
from engine.run import old_formats, optim, pieces

FORMAT = "shardwise-checkpoint/4"
FORMAT_2 = old_formats.FORMAT_2
SHARD_FORMAT = "shardwise-checkpoint-shard/3"
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab",
                "experts", "shared_experts", "vocab_multiple", "tie_embed")
_NAME = re.compile(r"step_(\d{8})\.ckpt")
_ANY_NAME = re.compile(r"\.?step_(\d{8})\.ckpt")  # a checkpoint's files, temporary ones too
_SHARD_NAME = re.compile(r"step_(\d{8})\.ckpt\.shard-\d{5}-of-\d{5}")
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


def _host_pieces(x) -> list[tuple[list, np.ndarray]]:
    """This process's share of leaf `x` as (index, host copy): one piece per addressable
    shard whose replica_id is 0, so across all processes every element is written exactly
    once. A host value (numpy) is one whole-array piece, written by process 0."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
        return [([[0, n] for n in x.shape], np.array(x))] if jax.process_index() == 0 else []
    return [(_index(s.index, x.shape), np.array(s.data))
            for s in x.addressable_shards if s.replica_id == 0]


def _describe(x) -> dict:
    return {"dtype": str(np.dtype(x.dtype)), "shape": list(x.shape)}


def _flat(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(path), x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def shard_path(path: str, process: int, processes: int) -> str:
    return f"{path}.shard-{process:05d}-of-{processes:05d}"


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """This process's pieces of (params, opt_state), copied to host memory: what a save
    writes, taken between steps so that training may go on while it is written.
    `arrays` describes every global array; `pieces` is {part: {key path: [(index,
    array)]}}."""

    arrays: dict
    pieces: dict


def snapshot(params, opt_state) -> Snapshot:
    """Copy this process's pieces of the state to host memory (every process calls it)."""
    leaves = {part: _flat(tree) for part, tree in (("params", params), ("opt_state", opt_state))}
    return Snapshot({part: {k: _describe(x) for k, x in flat} for part, flat in leaves.items()},
                    {part: {k: _host_pieces(x) for k, x in flat}
                     for part, flat in leaves.items()})


def save(directory: str, step: int, params, opt_state, meta: dict, keep: int) -> str:
    """Write checkpoint `step` of the state (every process calls it): `write` of its
    `snapshot`."""
    return write(directory, step, snapshot(params, opt_state), meta, keep)


_SAVES = [0]  # saves this process has begun: every process counts the same


def write(directory: str, step: int, snap: Snapshot, meta: dict, keep: int) -> str:
    """Write checkpoint `step` from `snap`; every process calls it, from any thread (it
    runs no device collective). Process p > 0 writes its pieces to a shard file and
    posts its size and header checksum to the coordination service; process 0 writes its
    own pieces, waits for every post, appends the manifest's header and renames it into
    place: the checkpoint exists from that rename on. Then process 0 deletes all but
    the newest `keep` checkpoints, shard files no manifest names, and temporary files a
    killed writer left."""
    path = checkpoint_path(directory, step)
    me, n = jax.process_index(), jax.process_count()
    _SAVES[0] += 1
    table, buffers, _ = pieces.layout(snap.pieces)
    target = path if me == 0 else shard_path(path, me, n)
    if me > 0:
        try:
            tail, crc = pieces.tail({"format": SHARD_FORMAT, "step": step, "process": me,
                                     "pieces": table})
            _write_atomic(target, [*buffers, tail], step)
        except OSError as e:
            _post(_SAVES[0], f"error {os.path.basename(target)}: {e.strerror or e}")
            raise CheckpointError(f"cannot write checkpoint {target}: {e.strerror or e}") \
                from None
        _post(_SAVES[0], f"{sum(map(len, buffers)) + len(tail)} {crc}")
        return path
    try:
        def manifest_tail():
            shards = [{"file": os.path.basename(shard_path(path, p, n)), "size": size,
                       "crc32": crc} for p, (size, crc) in enumerate(_collect(_SAVES[0]), 1)]
            record = dict(meta, format=FORMAT, step=step, versions=versions(), processes=n,
                          arrays=snap.arrays, pieces=table, shards=shards)
            return pieces.tail(record)[0]

        _write_atomic(path, buffers, step, finish=manifest_tail)
        _prune(directory, keep, step)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    return path


def _client():
    from jax._src import distributed  # the coordination service jax.distributed started
    return distributed.global_state.client


_WAIT_MS = 3_600_000  # the slowest process's write of its shard file


def _post(save: int, value: str) -> None:
    """Tell process 0 how this process's shard file of save number `save` went."""
    _client().key_value_set(f"shardwise/checkpoint/{save}/{jax.process_index()}", value)


def _collect(save: int) -> list[tuple[int, int]]:
    """[(size, header crc32)] of the shard files of processes 1.. for save `save`, once
    each has posted; OSError naming the first that failed."""
    out = []
    for p in range(1, jax.process_count()):
        value = _client().blocking_key_value_get(f"shardwise/checkpoint/{save}/{p}", _WAIT_MS)
        if value.startswith("error"):
            raise OSError(errno.EIO, f"process {p} could not write {value[6:]}")
        out.append(tuple(int(v) for v in value.split()))
    return out


def _prune(directory: str, keep: int, step: int) -> None:
    """Delete all but the newest `keep` checkpoints, and, up to `step` (the one just
    written), shard files no kept manifest names and temporary files of killed writers.
    Files of later steps are left alone: another process may be writing the next save
    already."""
    complete = list_checkpoints(directory)
    for _, old in complete[:-keep]:
        os.remove(old)
    kept = {os.path.basename(p) for _, p in complete[-keep:]}
    for name in os.listdir(directory):
        if not (m := _ANY_NAME.match(name)) or int(m.group(1)) > step:
            continue
        stale_tmp = ".ckpt.tmp-" in name or ".ckpt.shard-" in name and ".tmp-" in name
        if stale_tmp and not name.endswith(f"-{os.getpid()}"):
            os.remove(os.path.join(directory, name))
        elif (m := _SHARD_NAME.fullmatch(name)) and f"step_{m.group(1)}.ckpt" not in kept:
            os.remove(os.path.join(directory, name))


def _write_atomic(path: str, buffers, step: int, finish=None) -> None:
    """Write `buffers` (then the bytes `finish()` returns, if given) to a temporary name,
    fsync, rename to `path`, fsync the directory. `buffers` is a list, or an iterator
    whose buffers are made as the file is written (a converter's arrays one at a time). A
    failed write removes its temporary file; out of space, the error says how many bytes
    the file needs (when `buffers` is a list) and how many are free."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    size = sum(len(b) for b in buffers) if isinstance(buffers, list) else None
    try:
        with open(tmp, "wb") as f:
            f.writelines(buffers)
            if finish is not None:
                last = finish()
                size = None if size is None else size + len(last)
                f.write(last)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        _remove_quietly(tmp)
        if e.errno == errno.ENOSPC:
            needs = "" if size is None else f" needs {_mib(size)},"
            raise OSError(errno.ENOSPC, f"no space left on device: {name}{needs} "
                          f"{_mib(_free_bytes(directory))} free") from None
        raise
    except BaseException:
        _remove_quietly(tmp)
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
def _open_shard(directory: str, entry: dict, step: int) -> tuple[pieces.PieceFile, dict]:
    """A format-4 shard file and its piece table, after checking it is the one the
    manifest names (its size and its header's crc32)."""
    path = os.path.join(directory, entry["file"])
    try:
        header, crc, size = pieces.read_header(path)
    except OSError as e:
        raise ValueError(f"its shard file {path}: {e.strerror or e}") from None
    if size != entry["size"] or crc != entry["crc32"]:
        raise ValueError(f"shard {entry['file']} is not the one the manifest names "
                         f"(size or checksum differs)")
    if header.get("format") != SHARD_FORMAT or header.get("step") != step:
        raise ValueError(f"shard {entry['file']} is not a shard of step {step}")
    return pieces.PieceFile(path), header["pieces"]


PARTS = ("params", "opt_state")


def _open_pieces(path: str, parts: tuple[str, ...]) -> Checkpoint:
    """A format-4 checkpoint with its arrays unread (`pieces.Stored`): the manifest's
    header and every shard file's header, checked."""
    record, _, _ = pieces.read_header(path)
    if record.get("format") != FORMAT:
        raise ValueError("not a shardwise checkpoint")
    step = int(record["step"])
    arrays, table = record.pop("arrays"), record.pop("pieces")
    files = [(pieces.PieceFile(path), table)] + [
        _open_shard(os.path.dirname(path), e, step) for e in record["shards"]]
    found = {part: {k: pieces.Stored(k, entry, [(f, piece) for f, t in files
                                                for piece in t[part][k]])
                    for k, entry in arrays[part].items()}
             for part in parts}
    return Checkpoint(path, step, record, found.get("params"), found.get("opt_state"))


def _unreadable(path: str, e: Exception) -> CheckpointError:
    if isinstance(e, OSError):
        return CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}")
    return CheckpointError(f"checkpoint {path} is unreadable or truncated "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                           f"move it aside to resume from an older one")


_BAD = (OSError, ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException)


def open_checkpoint(path: str, parts: tuple[str, ...] = PARTS) -> Checkpoint:
    """One checkpoint with its headers read and checked; in format 4 its arrays are
    `pieces.Stored`, read by `restore` piece by piece as the devices need them, older
    formats are read whole. `parts` names what to open (a part left out is None and its
    pieces are not checked: generation reads only the params)."""
    try:
        if pieces.is_format_4(path):
            return _open_pieces(path, parts)
        return old_formats.read_whole(path, parts, Checkpoint)
    except _BAD as e:
        raise _unreadable(path, e) from None


def read(path: str, parts: tuple[str, ...] = PARTS) -> Checkpoint:
    """Read and verify one checkpoint (the manifest, every shard file it names, every
    piece's checksum, full coverage of every array) into global host arrays. Reads
    formats 1 to 3 too."""
    ckpt = open_checkpoint(path, parts)
    try:
        return dataclasses.replace(ckpt, **{
            part: {k: x.read() if isinstance(x, pieces.Stored) else x
                   for k, x in getattr(ckpt, part).items()} for part in parts})
    except _BAD as e:
        raise _unreadable(path, e) from None


def latest(directory: str, parts: tuple[str, ...] = PARTS, lazy: bool = False):
    """The newest complete checkpoint in `directory`, read (`parts` of it) and verified,
    or with `lazy` only opened (`open_checkpoint`); None if none."""
    found = list_checkpoints(directory)
    if not found:
        return None
    return (open_checkpoint if lazy else read)(found[-1][1], parts)


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
    opt_shapes = optim.state_shapes(trainer.tcfg, trainer.cfg)
    return (restore_params(ckpt, trainer),
            _place(ckpt.opt_state, opt_shapes, trainer.opt_specs, trainer.mesh, ckpt.path,
                   "opt_state", getattr(trainer, "layer_order", None)))


def _regions(x, sharding):
    """The callback `jax.make_array_from_callback` calls for each device of `sharding`:
    its region of `x`. A `pieces.Stored` array reads every region this process's devices
    hold at once (each piece read once, a chunk at a time) into aligned host arrays,
    which jax's CPU client takes as the device buffers without a copy, so a restore
    holds the state once plus a chunk; devices holding the same region (replicas) share
    one array. A host array (an older format) is sliced, once for a run of replicas."""
    if isinstance(x, pieces.Stored):
        wanted = {}
        for index in sharding.addressable_devices_indices_map(x.shape).values():
            wanted.setdefault(tuple(map(tuple, _index(index, x.shape))), None)
        found = dict(zip(wanted, x.regions([list(map(list, k)) for k in wanted])))
        return lambda index: found[tuple(map(tuple, _index(index, x.shape)))]
    last = [None, None]

    def region(index):
        where = [(s.start, s.stop) for s in index]
        if last[0] != where:
            last[:] = where, x[index]
        return last[1]
    return region


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
        sharding = NamedSharding(mesh, spec)
        try:
            out.append(jax.make_array_from_callback(x.shape, sharding, _regions(x, sharding)))
        except _BAD as e:
            raise _unreadable(path, e) from None
    return jax.tree.unflatten(treedef, out)
