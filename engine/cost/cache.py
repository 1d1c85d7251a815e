"""A disk cache of step ledgers, keyed by what changes the traced program.

A step's ledger (engine/cost/ledger.py) is a function of the model, the batch and
sequence length (per device, given the axis sizes), the parallel config and the layout's
axis sizes by role. Not of how long a run is or what its values are: `--steps`, the
learning rate, its warmup and schedule, the seed change constants in the traced
program, not its operations, so `python -m engine.train --layout auto --steps 20` finds
the ledgers `python -m engine.plan` traced at another `--steps`. Nor of the hardware:
the ledger is priced per profile after it is read (engine/cost/price.py). The order of the axes
only changes the order rows name their axes in, which no price depends on
(engine/cost/price.py reads axes as a set). The key is a hash of those, of the jax
version and of the source of every module the traced step is built from (its import
closure in collectives/, engine/ and layers/), so an edit to the step misses the cache
instead of returning a stale ledger.

    SHARDWISE_LEDGER_CACHE=DIR   where the files go (default ~/.cache/shardwise/ledgers);
                                 `off` disables the cache
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import pickle
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collectives", "engine", "layers")


def directory() -> Path | None:
    """The cache directory, or None when SHARDWISE_LEDGER_CACHE=off."""
    value = os.environ.get("SHARDWISE_LEDGER_CACHE", "")
    if value == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "shardwise" / "ledgers"


def _module_file(name: str) -> Path | None:
    """The source file of module `name` if it is in one of PACKAGES."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path, name: str) -> set[str]:
    """Modules `path` (module `name`) imports anywhere in its body, absolute names; for
    `from a import b` both a and a.b (b may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in [*parts, base] if p)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


@functools.cache
def code_fingerprint() -> str:
    """Hash of jax's version and the source of every module of PACKAGES that the traced
    step and its ledger import, transitively (read off the files, so tools such as the
    planner or the CLI can change without invalidating the cache)."""
    import jax

    seen, todo = {}, ["engine.run.step", "engine.cost.ledger"]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if path is None or name in seen:
            continue
        seen[name] = path
        parents = [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        todo.extend([*_imports(path, name), *parents])
    h = hashlib.sha256(jax.__version__.encode())
    for name in sorted(seen):
        h.update(name.encode())
        h.update(seen[name].read_bytes())
    return h.hexdigest()


# TrainConfig fields that change values in the traced step, never its operations
RUN_FIELDS = ("steps", "lr", "warmup", "min_lr_ratio", "schedule_steps", "seed")


def program_fields(tcfg) -> tuple:
    """The TrainConfig fields the traced step's operations depend on, by name."""
    import dataclasses

    return tuple((f.name, getattr(tcfg, f.name)) for f in dataclasses.fields(tcfg)
                 if f.name not in RUN_FIELDS)


def key(cfg, tcfg, parallel, layout, pack=None) -> str:
    """What the traced step depends on, hashed: the configs (of the training config, the
    fields of `program_fields`), the axis sizes by role (not their order) and the weight
    gather's packing (`trace_step`'s `pack`)."""
    from engine.parallel.layout import AXIS_ROLES

    sizes = tuple(layout.degree(r) for r in AXIS_ROLES)
    text = repr((cfg, program_fields(tcfg), parallel, sizes, pack, code_fingerprint()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(cfg, tcfg, layout, parallel, pack) -> Path | None:
    """The file of the step's ledger (None: no cache); pack None is keyed as the
    Trainer packs on an AbstractMesh (`collectives.widens_2byte`), so both spellings
    share one entry."""
    from collectives import widens_2byte

    pack = widens_2byte(layout.abstract_mesh()) if pack is None else pack
    where = directory()
    return where / f"{key(cfg, tcfg, parallel, layout, pack)}.pkl.z" if where else None


def lookup(cfg, tcfg, layout, parallel, pack=None) -> list | None:
    """The cached ledger of the step, or None (not cached, or unreadable)."""
    path = _path(cfg, tcfg, layout, parallel, pack)
    if path is not None and path.is_file():
        try:
            return pickle.loads(zlib.decompress(path.read_bytes()))
        except (OSError, zlib.error, pickle.UnpicklingError, EOFError):
            pass
    return None


def store(rows: list, cfg, tcfg, layout, parallel, pack=None) -> None:
    """Keep `rows` as the step's ledger (an unwritable cache is skipped)."""
    path = _path(cfg, tcfg, layout, parallel, pack)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(zlib.compress(pickle.dumps(rows, protocol=5), 1))
        os.replace(f.name, path)
    except OSError:
        pass


def step_ledger(cfg, tcfg, layout, parallel, pack=None) -> tuple[list, bool]:
    """(the ledger of the step, whether it came from the cache); traces and stores it
    on a miss. An unreadable or unwritable cache only costs the trace."""
    from engine.cost.ledger import step_ledger as trace

    rows = lookup(cfg, tcfg, layout, parallel, pack)
    if rows is not None:
        return rows, True
    rows = trace(cfg, tcfg, layout, parallel, pack)
    store(rows, cfg, tcfg, layout, parallel, pack)
    return rows, False
