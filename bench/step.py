"""Tokens/s and MFU of the training step, against the best matmul measured in this run.

    python bench/step.py --layout single --model medium
    python bench/step.py --layout fsdp8 --model small --steps 10
    python bench/step.py --compile-depths 4 32 --layout fsdp4xtp2 --model small

Takes the training CLI's flags (`engine.cli.args.build_parser`). The MFU denominator is the
best throughput of square matmuls (1024^3, 2048^3; compute-dtype operands, f32
accumulation, best of 3) measured in the same process just before the step is timed, so
the figure means the same on any machine and under any load. On forced host devices
the peak is the host's (all devices share its cores). It also prints the process's CPU
time per step (getrusage: all threads, so up to the core count times ms/step) and the
part spent in the kernel (page faults, thread wake-ups). With `--compile-depths` it
instead compiles the step at each depth and prints compile time per depth and its
ratio to the first: scan-over-layers should keep it flat.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (  # noqa: E402
    build_parser as train_parser,  # noqa: E402
    force_host_devices,
    host_memory_or_exit,
    keep_freed_memory,
    parse_or_exit,
)


def build_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("step bench")
    g.add_argument("--compile-depths", type=int, nargs="+", default=None, metavar="N",
                   help="only compile, at each of these layer counts, and compare times")
    p = train_parser(prog="python bench/step.py", description=__doc__.split("\n\n")[0],
                     parents=[own])
    p.set_defaults(steps=5)  # timed steps (median), after one warm-up step
    return p


def best_matmul(dtype, sizes=(1024, 2048), reps: int = 3) -> float:
    """Best FLOP/s of n^3 matmuls in `dtype` with f32 accumulation, on one device."""
    from engine.run.mfu import measured_matmul_peak

    return max(measured_matmul_peak(dtype, n, reps) for n in sizes)


def compile_seconds(cfg, tcfg, parallel, layout) -> float:
    """Seconds to lower and compile the train step (no run)."""
    import jax

    from engine.cost.ledger import _shape_dtype_specs
    from engine.run.step import Trainer

    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
    args = _shape_dtype_specs(cfg, tcfg)
    t0 = time.perf_counter()
    trainer.train_step.lower(*args).compile()
    jax.clear_caches()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    cfg, tcfg, parallel, layout, mine = parse_or_exit(argv, build_parser())
    force_host_devices(layout.size)
    host_memory_or_exit(cfg)  # before anything is built
    keep_freed_memory()
    import dataclasses

    from tabulate import tabulate

    from bench.timing import compiled_step, time_steps
    from engine.run.mfu import flops_per_token
    from engine.run.step import Trainer

    if mine.compile_depths:
        rows, first = [], None
        for n in mine.compile_depths:
            s = compile_seconds(dataclasses.replace(cfg, n_layers=n), tcfg, parallel, layout)
            first = first or s
            rows.append([n, s, s / first])
        print(f"compile time, {layout}, {cfg.dtype}, remat {cfg.remat}")
        print(tabulate(rows, ["layers", "compile s", "ratio"], floatfmt=".3g"))
        return 0

    peak = best_matmul(cfg.compute_dtype)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
    step, params, opt_state, tokens, compile_s = compiled_step(trainer)
    _, params, opt_state, _ = time_steps(step, params, opt_state, tokens, 1)  # settle first
    before = resource.getrusage(resource.RUSAGE_SELF)
    step_s, *_ = time_steps(step, params, opt_state, tokens, tcfg.steps)
    after = resource.getrusage(resource.RUSAGE_SELF)
    calls = tcfg.steps + 1  # time_steps' own warm-up call too
    cpu_s = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / calls
    sys_s = (after.ru_stime - before.ru_stime) / calls
    tokens_per_step = tcfg.batch * tcfg.seq
    model_flops = flops_per_token(cfg, tcfg.seq) * tokens_per_step
    print(f"{layout}, {cfg.dtype}, remat {cfg.remat}, tp_comm {parallel.tp_comm}, "
          f"zero {parallel.zero}{', prefetch' if parallel.prefetch else ''}; "
          f"median of {tcfg.steps} steps")
    print(tabulate([[str(layout), tokens_per_step / step_s, 1e3 * step_s, model_flops / 1e9,
                     model_flops / step_s / 1e9, peak / 1e9, model_flops / step_s / peak,
                     compile_s, 1e3 * cpu_s, 1e3 * sys_s]],
                   ["layout", "tokens/s", "ms/step", "GFLOP/step", "GFLOP/s",
                    f"best {cfg.dtype} matmul GFLOP/s", "MFU", "compile s",
                    "host CPU ms/step", "of it kernel"],
                   floatfmt=(None, ".0f", ".0f", ".1f", ".1f", ".1f", ".1%", ".1f", ".0f",
                             ".0f")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
