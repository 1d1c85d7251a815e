"""Long sequences under context parallelism: the longest sequence that fits a per-device
memory budget for each cp, and tokens/s at one long sequence for each `--cp-comm`.

    python bench/long_context.py
    python bench/long_context.py --preset tiny --cps 1 2 4 8 --seq 4096 --json out.json

Layouts `single`, `cp2`, `cp4`, `cp8` (the batch per device is the same on all of
them), remat full, the reference attention kernel (the one cp runs), `--batch` rows.

Fit: for each cp (and each comm of `--comms`), the longest sequence on a grid of
`--grain` tokens whose predicted peak (`engine.cost.memory.predict`) is within the
budget, then checked against the compiler (`memory.measure` of the compiled step:
arguments + temp + unaliased outputs, compile only, nothing allocated): stepped down
while the measured peak is over the budget, up while the next grid point still fits.
The sequence reported is the longest measured to fit; beside it the predicted and
measured peaks there.

Speed: at `--seq` tokens on the largest cp, each comm's train step (median of
`--steps` after one warm-up), with its predicted and measured peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (  # noqa: E402
    OneLineParser,
    UsageError,
    force_host_devices,
    keep_freed_memory,  # noqa: E402
)

MiB = 2 ** 20
FAST = {"xla_backend_optimization_level": 0}  # same buffer assignment, half the compile
MAX_COMPILES = 6  # per fit row: compiles spent correcting the prediction


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    from engine.config import PRESETS
    from layers.kernels.context import CP_COMMS

    p = OneLineParser(prog="python bench/long_context.py",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--batch", type=_positive, default=1, help="rows per step (every layout)")
    p.add_argument("--budget-mib", type=_positive, default=32,
                   help="per-device memory budget for the fit")
    p.add_argument("--cps", type=_positive, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--comms", nargs="+", default=list(CP_COMMS), choices=list(CP_COMMS))
    p.add_argument("--grain", type=_positive, default=256,
                   help="the fit's sequence grid (a multiple of 2 x the largest cp)")
    p.add_argument("--max-seq", type=_positive, default=1 << 20)
    p.add_argument("--seq", type=_positive, default=8192, help="sequence of the speed rows")
    p.add_argument("--steps", type=_positive, default=3, help="timed steps per speed row")
    p.add_argument("--no-speed", action="store_true", help="only the fit")
    p.add_argument("--json", default=None, help="write every row as JSON")
    return p


def _setup(args, cp: int, comm: str, seq: int):
    """(cfg, tcfg, parallel, layout) for one row; raises UsageError if invalid."""
    from engine.config import ParallelConfig, TrainConfig, model_config
    from engine.parallel.layout import Layout
    from engine.parallel.validate import problems

    cfg = model_config(args.preset, dtype=args.dtype, remat="full", attention="reference")
    tcfg = TrainConfig(batch=args.batch, seq=seq)
    parallel = ParallelConfig(cp_comm=comm)
    layout = Layout.parse("single" if cp == 1 else f"cp{cp}")
    bad = problems(cfg, tcfg, parallel, layout)
    if bad:
        raise UsageError(f"{layout} seq {seq}: {bad[0]}")
    return cfg, tcfg, parallel, layout


def predicted(args, cp: int, comm: str, seq: int) -> int:
    from engine.cost import memory

    cfg, tcfg, parallel, layout = _setup(args, cp, comm, seq)
    return memory.predict(cfg, tcfg, layout, "cpu", parallel=parallel).peak


def measured(args, cp: int, comm: str, seq: int) -> int:
    import jax

    from engine.cost import memory
    from engine.run.step import Trainer

    cfg, tcfg, parallel, layout = _setup(args, cp, comm, seq)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
    peak = memory.measure(memory.compile_step(trainer, FAST))["peak"]
    jax.clear_caches()
    return peak


def fit(args, cp: int, comm: str) -> dict:
    """The longest grid sequence measured within the budget (module doc)."""
    budget = args.budget_mib * MiB
    lo, hi = 0, args.max_seq // args.grain  # in grains: lo fits (predicted), hi + 1 not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predicted(args, cp, comm, mid * args.grain) <= budget:
            lo = mid
        else:
            hi = mid - 1
    n, seen = max(lo, 1), {}
    for _ in range(MAX_COMPILES):
        seen[n] = measured(args, cp, comm, n * args.grain)
        if seen[n] > budget and n > 1:
            n -= 1
        elif seen[n] <= budget and n + 1 not in seen and n < args.max_seq // args.grain:
            n += 1
        else:
            break
    fits = [k for k, v in seen.items() if v <= budget]
    best = max(fits) if fits else min(seen)
    seq = best * args.grain
    return dict(cp=cp, comm=comm, seq=seq, fits=bool(fits),
                predicted_seq=lo * args.grain,
                predicted_peak_bytes=predicted(args, cp, comm, seq),
                measured_peak_bytes=seen[best], compiles=len(seen))


def speed(args, cp: int, comm: str) -> dict:
    """Tokens/s and peaks of the train step at --seq on cp ranks."""
    import jax

    from bench.timing import compiled_step, time_steps
    from engine.cost import memory
    from engine.run.step import Trainer

    cfg, tcfg, parallel, layout = _setup(args, cp, comm, args.seq)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
    step, params, opt_state, tokens, compile_s = compiled_step(trainer)
    step_s, *_ = time_steps(step, params, opt_state, tokens, args.steps)
    out = dict(cp=cp, comm=comm, seq=args.seq, step_s=step_s, compile_s=compile_s,
               tokens_per_s=args.batch * args.seq / step_s,
               predicted_peak_bytes=memory.predict(cfg, tcfg, layout, "cpu",
                                                   trainer=trainer).peak,
               measured_peak_bytes=memory.measure(step)["peak"])
    del step, params, opt_state, tokens
    jax.clear_caches()
    return out


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.grain % (2 * max(args.cps)):
            raise UsageError(f"--grain {args.grain} is not a multiple of 2 x the largest "
                             f"cp ({2 * max(args.cps)})")
        for cp in args.cps:
            for comm in args.comms:
                _setup(args, cp, comm, args.grain)
                if not args.no_speed:
                    _setup(args, max(args.cps), comm, args.seq)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    force_host_devices(max(args.cps))
    keep_freed_memory()
    from tabulate import tabulate

    load = os.getloadavg()
    print(f"{args.preset}, {args.dtype}, batch {args.batch}, remat full, reference "
          f"attention; budget {args.budget_mib} MiB per device; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    def mib(x):
        return f"{x / MiB:.1f}"

    def err(r):
        return f"{100 * (r['predicted_peak_bytes'] / r['measured_peak_bytes'] - 1):+.1f}%"

    fits = []
    for cp in args.cps:
        for comm in args.comms if cp > 1 else args.comms[:1]:
            fits.append(fit(args, cp, comm))
            print(f"  fit cp{cp} {comm if cp > 1 else '-'}: seq {fits[-1]['seq']}",
                  file=sys.stderr, flush=True)
    base = fits[0]["seq"]
    print(tabulate([[r["cp"], r["comm"] if r["cp"] > 1 else "-",
                     r["seq"] if r["fits"] else "none", f"{r['seq'] / base:.2f}",
                     r["predicted_seq"], mib(r["predicted_peak_bytes"]),
                     mib(r["measured_peak_bytes"]), err(r)] for r in fits],
                   ["cp", "cp-comm", "longest seq", "x cp1", "predicted seq", "pred MiB",
                    "measured MiB", "pred err"], disable_numparse=True, stralign="right"))
    speeds = []
    if not args.no_speed:
        cp = max(args.cps)
        for comm in args.comms:
            speeds.append(speed(args, cp, comm))
            print(f"  speed cp{cp} {comm}: {speeds[-1]['tokens_per_s']:.0f} tokens/s",
                  file=sys.stderr, flush=True)
        print(tabulate([[f"cp{r['cp']}", r["comm"], r["seq"], f"{r['tokens_per_s']:.0f}",
                         f"{1e3 * r['step_s']:.0f}", mib(r["predicted_peak_bytes"]),
                         mib(r["measured_peak_bytes"]), err(r)] for r in speeds],
                       ["layout", "cp-comm", "seq", "tokens/s", "ms/step", "pred MiB",
                        "measured MiB", "pred err"], disable_numparse=True, stralign="right"))
    end = os.getloadavg()
    print(f"peak = arguments + temp + unaliased outputs per device (memory_analysis); "
          f"median of {args.steps} steps after one warm-up; load average at the end "
          f"{end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "preset": args.preset, "dtype": args.dtype, "batch": args.batch,
            "budget_bytes": args.budget_mib * MiB, "load_average_start": load,
            "load_average_end": end, "fit": fits, "speed": speeds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
