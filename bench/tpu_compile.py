"""Per-device memory of the step as XLA:TPU compiles it, on a host without a TPU, beside
the memory model's prediction.

    pip install -e '.[tpu]'                    # libtpu: the TPU compiler, no TPU needed
    python bench/tpu_compile.py                # the published TPU runs (bench/published.py)
    python bench/tpu_compile.py --only 22B --live 12 --json out.json
    python bench/tpu_compile.py --hardware v5e --layout fsdp256 --model llama3-8b \
        --seq 8192 --batch 256 --remat full     # any configuration: does it fit?

libtpu compiles for a TPU slice named by its topology alone (`jax.experimental.topologies`:
compile-only devices, the ahead-of-time path MaxText's train_compile.py takes), so the
step of each published TPU run is lowered on a mesh of its chips and compiled by
XLA:TPU, never run. XLA:TPU refuses a step whose buffer assignment (the arguments and
every temporary, as it packs them) exceeds the chip's HBM (RESOURCE_EXHAUSTED, with both
figures): whether it compiles is the compiler's own verdict on fit, and the assignment's
total ('Total bytes used', read from XLA's dump of the step) is the figure it checks.
Printed beside it: the bytes live at once at the peak of XLA's live-range report (what
the memory model's one-moment sum compares with; the assignment adds the holes its
heap packing leaves), `memory.predict(..., platform="tpu")`, the peak
`bench/published.py` and the planner judge fit by, and `memory_analysis()` of the
compiled step, whose temp is larger than what that check counts (the v4 22B step: 39.6
GiB there, accepted on 32 GiB chips; why was not found). Figures:
bench/results/2026-11-29-tpu-memory-cpu.md.

Attention compiles as the `blocked` kernel (the flash algorithm in jnp, which XLA:TPU
compiles like any layer) where a run asks for `auto`: this engine's Pallas kernel is
written for interpret mode, not for Mosaic. The memory model prices the target's flash
kernel for both. `--live N` prints the N largest buffers live at the peak of XLA's
buffer assignment, from its live-range report. `--cost` prints XLA:TPU's count of the
step's FLOPs and bytes accessed beside the ledger's (engine/cost/ledger.py) with the TPU
fusion model's bytes and the op-by-op bytes: a check of the fusion model against the
target's own fusions, meaningful on a step without loops (`--layers 1 --attention
reference`), as XLA counts a loop's body once.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2 ** 30
# topology names of TPU slices by chip count (Cloud TPU system-architecture pages: v4 and
# v5p are 3-D tori, wrapped once every side is 4 chips or more, a side of AxBxC at most
# 4 or a multiple of 4, so v4-384's 192 chips are 4x4x12; v5e is a 2-D mesh, its
# 256-chip pod wrapped along both sides); each v4 / v5p chip is one "megacore" device
CUBES = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
         128: (4, 4, 8), 192: (4, 4, 12), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
         2048: (8, 16, 16)}
PLANES = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
          256: (16, 16)}
PREFIX = {"v4": "v4", "v5p": "v5", "v5e": "v5e"}


def one_slice(run) -> bool:
    """A published run on one slice whose topology `topology` knows (runs across slices
    add a DCN data-parallel axis, which a compile-only topology of one slice lacks)."""
    try:
        topology(run.hardware, run.chips)
    except ValueError:
        return False
    return not run.layout.startswith("dp")


def topology(hardware: str, chips: int) -> dict:
    """`jax.experimental.topologies.get_topology_desc` arguments for a slice of `chips`
    chips of a TPU profile; ValueError for a count this table has no slice of."""
    if hardware not in PREFIX:
        raise ValueError(f"no TPU topology for hardware {hardware!r} (known: "
                         f"{', '.join(sorted(PREFIX))})")
    cube = hardware != "v5e"
    shape = (CUBES if cube else PLANES).get(chips)
    if shape is None:
        raise ValueError(f"no {hardware} slice of {chips} chips here (known: "
                         f"{', '.join(map(str, sorted(CUBES if cube else PLANES)))})")
    if cube:
        wrap = (min(shape) >= 4,) * 3
    else:
        wrap = (shape[0] >= 16, shape[1] >= 16, False)
    return dict(topology_name=f"{PREFIX[hardware]}:{'x'.join(map(str, shape))}",
                platform="tpu", chip_config_name="megacore" if cube else "default",
                chips_per_host_bounds=(2, 2, 1), wrap=wrap)


@contextlib.contextmanager
def quiet_stderr():
    """libtpu's start-up warnings (no TPU metadata server here) go to fd 2 from C++:
    held back, and shown only if the block raises."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def libtpu_installed() -> bool:
    """Whether the `libtpu` package (the TPU compiler jax loads as its TPU plugin) is
    importable here."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def devices(slice_: dict):
    """Compile-only TPU devices of a slice (`topology`'s arguments)."""
    from jax.experimental import topologies

    with quiet_stderr():
        return topologies.get_topology_desc(**slice_).devices


def live_at_peak(dump: Path, n: int) -> list[tuple[str, int]]:
    """The n largest (buffer, bytes) of the 'Live ranges at ... (peak)' section of the
    step's live-range report in an XLA dump directory."""
    reports = sorted(dump.glob("*train_step*live-range.txt"))
    if not reports:
        return []
    text = reports[-1].read_text()
    section = text.split("(peak):", 1)[-1]
    found = re.findall(r"^\s+(\S+): (\d+) bytes", section, flags=re.M)
    return sorted(((name, int(b)) for name, b in found), key=lambda x: -x[1])[:n]


def live_peak_bytes(dump: Path) -> int | None:
    """Bytes live at once at the peak of the step's live-range report in an XLA dump
    directory (the arguments and the temporaries live at that instruction: what the
    memory model's peak adds up), None without one. The buffer assignment's total is at
    least this: its heap also holds the holes left where buffers live at different times
    could not share an offset."""
    reports = sorted(dump.glob("*train_step*live-range.txt"))
    if not reports:
        return None
    found = re.findall(r"\(cumulative: (\d+) bytes\)",
                       reports[-1].read_text().split("(peak):", 1)[-1].split("Stack trace", 1)[0])
    return int(found[-1]) if found else None


def next_dump(dump: Path, keep: str | None, i: int) -> None:
    """Empty the dump directory for the next step (one module's dump at a time): its
    files moved to `keep`/step<i> (replacing an older one) where `keep` is given, else
    deleted."""
    if keep:
        kept = Path(keep) / f"step{i}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.move(dump, kept)
    else:
        shutil.rmtree(dump)
    dump.mkdir()


# XLA:TPU's refusal of a step whose temporaries exceed the chip's HBM
OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory.*?temporaries \(([\d.]+)G\) "
                        r"exceeds available HBM \(([\d.]+)G\)", re.S)


def out_of_hbm(message: str) -> tuple[float, float] | None:
    """(bytes the temporaries need, bytes available) from XLA:TPU's out-of-memory error,
    None for any other message. XLA prints both with a 'G' of 2**30 bytes."""
    m = OUT_OF_HBM.search(message)
    return None if m is None else (float(m.group(1)) * GiB, float(m.group(2)) * GiB)


def assigned_bytes(dump: Path) -> int | None:
    """'Total bytes used' of the step's buffer assignment in an XLA dump directory (the
    arguments and every temporary, as XLA:TPU packed them), None without one."""
    for report in sorted(dump.glob("*train_step*buffer-assignment*.txt")):
        if found := re.search(r"Total bytes used: (\d+)", report.read_text()):
            return int(found.group(1))
    return None


def ledger_cost(cfg, tcfg, parallel, layout, hardware: str) -> dict:
    """The step's FLOPs and bytes by the ledger, as XLA:TPU compiles it: compute rows
    (no collectives), the jnp attention's own rows (what the compile runs, not the
    flash kernel pricing puts in their place), bytes by the TPU fusion model and op by
    op (`Row.bytes`)."""
    import dataclasses

    from engine.cost.hardware import get
    from engine.cost.ledger import step_ledger
    from engine.cost.price import moved_bytes, priced_rows

    hw = dataclasses.replace(get(hardware), attention_eff=0.0, attention_rates=())
    ledger = step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)
    rows = [r for r in priced_rows(ledger, hw) if r.kind != "collective"]
    return dict(flops=sum(r.flops * r.count for r in rows),
                fused_bytes=sum(moved_bytes(r, hw) * r.count for r in rows),
                bytes=sum(r.bytes * r.count for r in rows))


def xla_cost(compiled) -> dict:
    """XLA:TPU's own count of the compiled step's FLOPs and bytes accessed
    (`cost_analysis()`, which counts a loop's body once whatever its trip count) and
    how many loops the step holds."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(flops=cost.get("flops", 0.0), bytes=cost.get("bytes accessed", 0.0),
                loops=len(re.findall(r"\swhile\(", compiled.as_text())))


def compile_step(name: str, hardware: str, cfg, tcfg, parallel, layout,
                 cost: bool = False) -> dict:
    """Compile one step for a slice of `layout.size` chips of a TPU profile: whether
    XLA:TPU accepts it (it refuses a step whose buffer assignment exceeds the chip's
    HBM), its figures, and the memory model's peak. Attention `auto` compiles as
    `blocked` (the module docstring)."""
    import dataclasses

    import jax

    from engine.cost import memory
    from engine.cost.hardware import get
    from engine.run.step import Trainer

    if cfg.attention == "auto":
        cfg = dataclasses.replace(cfg, attention="blocked")
    slice_ = topology(hardware, layout.size)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(devices(slice_)), parallel)
    model = memory.predict(cfg, tcfg, layout, platform="tpu", parallel=parallel)
    hbm = get(hardware).hbm_capacity
    row = dict(name=name, topology=slice_["topology_name"],
               attention=cfg.attention, model_peak=model.peak, model_phase=model.phase,
               hbm=hbm, fits_model=model.peak <= hbm, compiler=None, needs=None)
    t0 = time.perf_counter()
    try:
        compiled = memory.compile_step(trainer)
        row["compiler"] = memory.measure(compiled)
        row["fits_compiler"] = True
        if cost:
            row["xla_cost"] = xla_cost(compiled)
            row["ledger_cost"] = ledger_cost(cfg, tcfg, parallel, layout, hardware)
    except jax.errors.JaxRuntimeError as e:
        if (refused := out_of_hbm(str(e))) is None:
            raise
        row["needs"], row["available"] = refused
        row["fits_compiler"] = False
    row["compile_s"] = time.perf_counter() - t0
    return row


def verdict(row: dict) -> str:
    if not row["fits_compiler"]:
        return (f"refused by XLA:TPU: {row['needs'] / GiB:.2f} GiB over the "
                f"{row['available'] / GiB:.2f} GiB available")
    c, assigned = row["compiler"], row.get("assigned")
    return (f"compiles, {'?' if assigned is None else f'{assigned / GiB:.2f}'} GiB assigned "
            f"(memory_analysis: argument {c['argument'] / GiB:.2f} + temp "
            f"{c['temp'] / GiB:.2f})")


def build_parser() -> argparse.ArgumentParser:
    from engine.cli.args import build_parser as train_parser

    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("tpu compile")
    g.add_argument("--hardware", default=None, choices=sorted(PREFIX),
                   help="compile the configuration the model, parallel and training flags "
                        "give on a slice of this TPU of --layout's size (default: the "
                        "published TPU runs instead)")
    g.add_argument("--only", default=None, help="published TPU runs whose name contains this")
    g.add_argument("--live", type=int, default=0, metavar="N",
                   help="also print the N largest buffers live at XLA's peak")
    g.add_argument("--cost", action="store_true",
                   help="also print XLA:TPU's FLOPs and bytes accessed (cost_analysis) "
                        "beside the ledger's; XLA counts a loop body once, so compare "
                        "steps without loops: --layers 1 --attention reference")
    g.add_argument("--json", default=None, help="write the rows as JSON")
    g.add_argument("--dump", default=None, metavar="DIR",
                   help="keep XLA's dump of each step (optimized HLO, buffer assignment, "
                        "live ranges) in DIR/step<i> instead of deleting it")
    p = train_parser(prog="python bench/tpu_compile.py", description=__doc__.split("\n\n")[0],
                     parents=[own], groups=("model", "parallel", "batch", "training"))
    p.set_defaults(activations="bf16")
    return p


def main(argv=None) -> int:
    from engine.cli.args import build_parser as train_parser, parse_or_exit

    cfg, tcfg, parallel, layout, args = parse_or_exit(argv, build_parser())
    if args.hardware is not None:
        if args.only is not None:
            print("error: --only picks published runs; --hardware compiles the flags' "
                  "configuration: give one", file=sys.stderr)
            return 2
        try:
            topology(args.hardware, layout.size)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        steps = [(f"{layout} on {layout.size}x{args.hardware}", args.hardware,
                  (cfg, tcfg, parallel, layout))]
    else:
        from bench.published import HELD_OUT, RUNS, argv as run_argv, source_settings

        runs = [r for r in RUNS + HELD_OUT if r.hardware in PREFIX and one_slice(r)
                and (args.only is None or args.only.lower() in r.name.lower())]
        if not runs:
            print(f"error: no published TPU run matches {args.only!r}", file=sys.stderr)
            return 2
        steps = [(r.name, r.hardware,
                  parse_or_exit(run_argv(r, source_settings(r)), train_parser())[:4])
                 for r in runs]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host backend; the TPU is compile-only
    # libtpu holds a lock file for the one process that may drive the chips; a
    # compile-only process drives none, so two of them may run at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not libtpu_installed():
        print("error: libtpu is not installed (pip install -e '.[tpu]' brings the TPU "
              "compiler; no TPU is needed)", file=sys.stderr)
        return 2
    from tabulate import tabulate

    # the step's buffer assignment, read from XLA's dump; set before the TPU compiler starts
    dump = Path(tempfile.mkdtemp(prefix="tpu_compile_"))
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                               f"--xla_dump_hlo_module_re=.*train_step.*").strip()
    out = []
    for name, hardware, configs in steps:
        row = compile_step(name, hardware, *configs, cost=args.cost)
        row["assigned"] = row["needs"] if row["needs"] is not None else assigned_bytes(dump)
        row["live"] = live_at_peak(dump, args.live)
        row["live_peak"] = live_peak_bytes(dump)
        next_dump(dump, args.dump, len(out))
        out.append(row)
        live = "" if row["live_peak"] is None else f", {row['live_peak'] / GiB:.2f} GiB live at once"
        print(f"{row['name']} on {row['topology']}: {verdict(row)}{live}; model "
              f"{row['model_peak'] / GiB:.2f} GiB ({row['compile_s']:.0f} s)", flush=True)
        for buffer, size in row["live"]:
            print(f"    {size / GiB:7.3f} GiB  {buffer}")
        if "xla_cost" in row:
            x, m = row["xla_cost"], row["ledger_cost"]
            loops = (f"; {x['loops']} loops, each body counted once by XLA"
                     if x["loops"] else "")
            print(f"    XLA:TPU {x['flops']:.4g} FLOPs, {x['bytes']:.4g} bytes accessed{loops}"
                  f"\n    ledger  {m['flops']:.4g} FLOPs ({m['flops'] / x['flops']:.3f}x), "
                  f"{m['fused_bytes']:.4g} bytes fused ({m['fused_bytes'] / x['bytes']:.3f}x), "
                  f"{m['bytes']:.4g} op by op ({m['bytes'] / x['bytes']:.3f}x)")
    shutil.rmtree(dump)
    print(tabulate([[r["name"], r["topology"], r["fits_compiler"], r["fits_model"],
                     None if r["assigned"] is None else r["assigned"] / GiB,
                     None if r["live_peak"] is None else r["live_peak"] / GiB,
                     r["model_peak"] / GiB, r["hbm"] / GiB,
                     None if r["compiler"] is None else r["compiler"]["peak"] / GiB]
                    for r in out],
                   ["run", "slice", "compiles", "fits (model)", "XLA:TPU GiB", "live at peak GiB",
                    "model GiB",
                    "HBM GiB", "memory_analysis GiB"], floatfmt=".2f"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
