"""The overlap and memory switches (--tp-comm, --zero, --prefetch) side by side:
tokens/s, memory and predicted step time per config.

    python bench/switches.py --layout fsdp4xtp2 --model medium --steps 3 --json out.json
    python bench/switches.py --layout fsdp4xtp2 --model tiny --configs "tp_comm=ring,zero=2" zero=1

Takes the training CLI's flags (`engine.cli.args.build_parser`); they give the base config,
and each `--configs` entry (comma-separated `field=value` over `ParallelConfig` or
`ModelConfig`: `tp_comm=sequence`, `zero=2`, `prefetch` or `prefetch=1`, `remat=dots`,
...) overrides it. Each config is checked by `engine.parallel.validate` before anything runs.
Default: allreduce+zero3, sequence+zero3, ring+zero3, allreduce+zero3+prefetch,
allreduce+zero2, allreduce+zero1. Every config is compiled and run one warm-up step,
then the configs are timed one step at a time, round robin, `--steps` steps each (a slow
spell on the shared cores falls on every config alike). For each config, one row:

- tokens/s and ms/step: the median step; fastest ms: the fastest;
- peak MiB per device, measured: the compiled step's `memory_analysis()`, arguments +
  temp + unaliased outputs (engine/cost/memory.py defines it), and predicted by
  `engine.cost.memory.predict`, with the error;
- predicted step on `cpu`: the ledger priced with rates measured in this run, one
  profile for every config (`engine.cost.microbench.in_run_profile` over all their
  rows), with its error against the fastest step;
- predicted step and exposed communication on `h100`, the same layout's devices
  (`engine.cost.price.predict` with the overlap model; prefetch lets FSDP gathers hide).

Then the order check: the run's noise is how far the fastest of one config's
even-numbered steps and the fastest of its odd-numbered steps disagree, at most, over
the configs (`bench.timing.split_half_noise`); for every pair of configs whose fastest
steps differ by more, whether the cpu predictions put them in the same order.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (  # noqa: E402
    UsageError,
    build_parser as train_parser,  # noqa: E402
    force_host_devices,
    host_memory_or_exit,
    keep_freed_memory,
    parse_or_exit,  # noqa: E402
)

DEFAULT_CONFIGS = ("tp_comm=allreduce,zero=3", "tp_comm=sequence,zero=3",
                   "tp_comm=ring,zero=3", "tp_comm=allreduce,zero=3,prefetch",
                   "tp_comm=allreduce,zero=2", "tp_comm=allreduce,zero=1")
MiB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("switches bench")
    g.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="K=V,...",
                   help="configs to run, each comma-separated ParallelConfig or ModelConfig "
                        "overrides of the "
                        "base flags (default: six settings of --tp-comm, --zero and --prefetch)")
    g.add_argument("--calibration", default=None,
                   help="cpu profile JSON the in-run rates start from (bench/calibrate.py)")
    g.add_argument("--json", default=None, help="write every row as JSON")
    p = train_parser(prog="python bench/switches.py", description=__doc__.split("\n\n")[0],
                     parents=[own])
    p.set_defaults(steps=8)  # timed steps of each config, after one warm-up step
    return p


def parse_config(text: str, cfg, parallel) -> tuple:
    """'tp_comm=ring,zero=2,prefetch' -> (cfg, parallel) with those fields replaced; each
    key names a `ParallelConfig` or `ModelConfig` field."""
    bases = (cfg, parallel)
    kws: tuple[dict, dict] = ({}, {})
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        which = next((i for i, b in enumerate(bases)
                      if key in {f.name for f in dataclasses.fields(b)}), None)
        if which is None:
            raise UsageError(f"--configs {text!r}: unknown field {key!r}")
        kind = type(getattr(bases[which], key))
        if kind is bool:
            if eq and value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise UsageError(f"--configs {text!r}: {key}={value!r} is not a boolean")
            kws[which][key] = not eq or value.lower() in ("1", "true", "yes")
        else:
            if not eq:
                raise UsageError(f"--configs {text!r}: {key} needs a value")
            try:
                kws[which][key] = kind(value)
            except ValueError:
                raise UsageError(f"--configs {text!r}: {key}={value!r} is not a "
                                 f"{kind.__name__}") from None
    return tuple(dataclasses.replace(b, **kw) for b, kw in zip(bases, kws))


def label(cfg, parallel) -> str:
    return (f"{parallel.tp_comm} zero{parallel.zero}{' +prefetch' if parallel.prefetch else ''}"
            f"{'' if cfg.remat == 'full' else f' remat {cfg.remat}'}"
            f"{'' if parallel.grad_reduce == 'compute' else f' grads {parallel.grad_reduce}'}")


def check(cfg, tcfg, parallel, layout) -> None:
    """`engine.parallel.validate`'s problems of one derived config (raises UsageError)."""
    from engine.parallel import validate

    if problems := validate.problems(cfg, tcfg, parallel, layout):
        raise UsageError(f"{label(cfg, parallel)}: " + "; ".join(problems))


def prepare(cfg, tcfg, parallel, layout) -> dict:
    """Compile one config, run its warm-up step, and predict what needs no measurement:
    its peak memory and its step on h100. `held` is [step, params, opt_state, tokens]
    for bench/timing.round_robin; `rows` its ledger."""
    import jax

    from bench.timing import compiled_step, timed_step
    from engine.cost import hardware, memory
    from engine.cost.ledger import step_ledger
    from engine.cost.price import predict
    from engine.run.step import Trainer

    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
    step, params, opt_state, tokens, compile_s = compiled_step(trainer)
    measured = memory.measure(step)
    try:
        mem = memory.predict(cfg, tcfg, layout, "cpu", trainer=trainer)
    except memory.Unsupported as e:
        print(f"  {label(cfg, parallel)}: no memory prediction: {e}", file=sys.stderr)
        mem = None
    rows = step_ledger(cfg, tcfg, layout, parallel)
    pred_h100 = predict(rows, hardware.get("h100"), layout.mesh_axes(), prefetch=parallel.prefetch)
    params, opt_state, first, _ = timed_step(step, params, opt_state, tokens)
    return dict(
        held=[step, params, opt_state, tokens], rows=rows, parallel=parallel,
        devices=trainer.mesh.devices.flatten().tolist(), figures=dict(
            config=label(cfg, parallel), tp_comm=parallel.tp_comm, zero=parallel.zero,
            prefetch=parallel.prefetch, remat=cfg.remat, compile_s=compile_s,
            first_loss=float(jax.device_get(first["loss"])),
            measured_peak_bytes=measured["peak"], measured_memory=measured,
            predicted_peak_bytes=mem.peak if mem else None,
            peak_error=memory.error(mem, measured) if mem else None,
            predicted_memory=dict(params=mem.params, opt_state=mem.opt_state,
                                  tokens=mem.tokens, grads=mem.grads,
                                  grads_live=mem.grads_live, residuals=mem.residuals,
                                  transient=mem.transient, phase=mem.phase,
                                  items=mem.items) if mem else None,
            predicted_h100_step_s=pred_h100.step_s,
            predicted_h100_exposed_comm_s=pred_h100.exposed_comm_s,
            predicted_h100_comm_s=pred_h100.comm_s))


def order_pairs(predicted, measured, noise: float) -> list[dict]:
    """The pairs of configs whose measured steps differ by more than `noise` (relative
    to the faster), each with whether the predictions put them in the same order."""
    out = []
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            gap = abs(measured[i] - measured[j]) / min(measured[i], measured[j])
            if gap > noise:
                out.append(dict(pair=(i, j), measured_gap=gap, right=(
                    (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0)))
    return out


def main(argv=None) -> int:
    cfg, tcfg, parallel, layout, mine = parse_or_exit(argv, build_parser())
    try:
        configs = [parse_config(text, cfg, parallel) for text in mine.configs]
        for c, par in configs:
            check(c, tcfg, par, layout)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    force_host_devices(layout.size)
    host_memory_or_exit(cfg)  # before anything is built
    keep_freed_memory()
    import statistics

    from tabulate import tabulate

    from bench.timing import round_robin, split_half_noise
    from engine.cost import hardware
    from engine.cost.microbench import in_run_profile
    from engine.cost.price import predict

    load = os.getloadavg()
    print(f"{layout}, model {mine.model}, batch {tcfg.batch}, seq {tcfg.seq}, {cfg.dtype}, "
          f"attention {cfg.attention}; {tcfg.steps} steps of each config, one at a time "
          f"round robin, after one warm-up; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}", flush=True)
    prepared = []
    for c, par in configs:
        prepared.append(prepare(c, tcfg, par, layout))
        print(f"  compiled {label(c, par)}", file=sys.stderr, flush=True)
    # one profile for every config: their order is not moved by rates measured apart
    cpu = in_run_profile(hardware.get("cpu", mine.calibration),
                         [row for p in prepared for row in p["rows"]], prepared[0]["devices"])
    times = round_robin([p["held"] for p in prepared], tcfg.steps,
                        say=lambda line: print(line, file=sys.stderr, flush=True))
    out = []
    for p, t in zip(prepared, times):
        fastest, median = min(t), statistics.median(t)
        pred = predict(p["rows"], cpu, layout.mesh_axes(), prefetch=p["parallel"].prefetch)
        out.append(dict(p["figures"], tokens_per_s=tcfg.batch * tcfg.seq / median,
                        step_s=median, fastest_step_s=fastest, step_times_s=t,
                        predicted_cpu_step_s=pred.step_s,
                        cpu_step_error=(pred.step_s - fastest) / fastest))
        del p["held"]
    noise = split_half_noise(times)
    pairs = order_pairs([r["predicted_cpu_step_s"] for r in out],
                        [r["fastest_step_s"] for r in out], noise)

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    def mib(x):
        return "-" if x is None else f"{x / MiB:.1f}"

    table = [[r["config"], f"{r['tokens_per_s']:.0f}", f"{1e3 * r['step_s']:.0f}",
              f"{1e3 * r['fastest_step_s']:.0f}",
              mib(r["measured_peak_bytes"]), mib(r["predicted_peak_bytes"]), pct(r["peak_error"]),
              f"{1e3 * r['predicted_cpu_step_s']:.0f}", pct(r["cpu_step_error"]),
              f"{1e3 * r['predicted_h100_step_s']:.2f}",
              f"{1e3 * r['predicted_h100_exposed_comm_s']:.2f}"] for r in out]
    print(tabulate(table, ["config", "tokens/s", "ms/step", "fastest ms", "peak MiB",
                           "pred MiB", "mem err", "pred cpu ms", "cpu err", "pred h100 ms",
                           "h100 exposed comm ms"],
                   disable_numparse=True, stralign="right"))
    end = os.getloadavg()
    right = sum(q["right"] for q in pairs)
    print(f"tokens/s and ms/step: the median step; cpu err: against the fastest step. "
          f"Noise (two halves of one config's steps disagree by up to) {100 * noise:.1f}%: "
          f"{len(pairs)} of {len(out) * (len(out) - 1) // 2} pairs of configs differ by more, "
          f"the cpu prediction orders {right} of them right"
          + "".join(f"; wrong: {out[q['pair'][0]]['config']} vs {out[q['pair'][1]]['config']} "
                    f"({100 * q['measured_gap']:.1f}% apart)" for q in pairs if not q["right"]))
    print(f"peak = arguments + temp + unaliased outputs per device (memory_analysis); "
          f"load average at the end {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    if mine.json:
        Path(mine.json).write_text(json.dumps({
            "layout": str(layout), "model": mine.model, "batch": tcfg.batch, "seq": tcfg.seq,
            "dtype": cfg.dtype, "steps": tcfg.steps, "load_average_start": load,
            "load_average_end": end, "noise": noise, "order_pairs": pairs,
            "rows": out}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
