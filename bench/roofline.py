"""Predicted vs measured time per layer and per collective, and the step's roofline.

    python bench/roofline.py --layout fsdp4xtp2 --model small
    python bench/roofline.py --predict-only --hardware h100 --layout fsdp32xtp8 \\
        --model llama3-70b --batch 256 --seq 4096

Takes the training CLI's model and layout flags (`engine.cli.args.build_parser`). Without
--predict-only it compiles the step on forced host devices, audits its collectives
against the ledger, times `--steps` steps (median wall clock) and attributes the time of
`--trace-steps` profiled steps to ledger categories (engine/cost/trace.py). On the cpu
profile with in-run rates the rates are measured `--rounds` times, each just before its
share of the timed steps. A step whose temporaries glibc maps anew every step (above a
thread's heap, engine/run/host.py) is also priced for faulting them in.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (  # noqa: E402
    UsageError,
    build_parser as train_parser,  # noqa: E402
    check_apart,
    force_host_devices,
    host_memory_or_exit,
    keep_freed_memory,
    parse_or_exit,
)
from engine.cost.hardware import PROFILES  # noqa: E402
from engine.run.host import THREAD_HEAP_MAX, mapped_each_step  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The training CLI's flags plus this report's own."""
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("roofline report")
    g.add_argument("--hardware", default="cpu", choices=("cpu", *PROFILES),
                   help="profile to price with; cpu = the calibrated profile")
    g.add_argument("--predict-only", action="store_true",
                   help="trace on an AbstractMesh only: no devices, no run")
    g.add_argument("--calibration", default=None, help="cpu profile JSON (bench/calibrate.py)")
    g.add_argument("--in-run-rates", action=argparse.BooleanOptionalAction, default=True,
                   help="cpu, when running: price with rates measured in this run just "
                        "before the step is timed, each dot at its own shapes, all devices "
                        "at once (engine/cost/microbench.py), instead of the calibration file")
    g.add_argument("--trace-steps", type=int, default=2, help="steps to profile")
    g.add_argument("--rounds", type=int, default=3,
                   help="cpu with in-run rates: measure the rates this many times, each "
                        "just before its share of the timed steps (the shared host's "
                        "speed drifts within a run); the report prices with the round "
                        "whose prediction is the median, and --json pairs every round's "
                        "predicted and measured step")
    g.add_argument("--json", default=None, help="write figures as JSON")
    g.add_argument("--top-ops", type=int, default=0, metavar="N",
                   help="when running: also list the N compiled ops that took the most "
                        "measured time, with their scope, result and what each fusion "
                        "computes (a transpose there is a layout change XLA added)")
    g.add_argument("--by", default="scope", choices=("scope", "fusion"),
                   help="compute table per named scope, or per fusion group (the "
                        "accelerator fusion model, engine/cost/fusion.py)")
    g.add_argument("--plot", default=None, help="roofline PNG (needs matplotlib)")
    p = train_parser(prog="python bench/roofline.py", description=__doc__.split("\n\n")[0],
                     parents=[own], groups=("model", "parallel", "batch", "training"))
    p.set_defaults(steps=5)  # steps timed for the measured column
    return p


def measure(layout, trainer, steps: int, trace_steps: int, rounds: int = 1, before=None):
    """(median step seconds, [each round's step seconds], [what `before` returned each
    round], attributed {category: s}, hlo text, {op: (s, runs)} per compiled op,
    {op: trace.OpInfo}, one device's temporaries in bytes (the compiled step's
    `memory_analysis`)). After one warm-up step, `rounds` rounds each call `before`
    (if given: the in-run rates) and then time their share of the `steps` steps
    (rounded up), so rates and steps sample the shared host over the same minutes."""
    import jax

    from bench.timing import compiled_step, timed_step
    from engine.cost import memory, trace
    from engine.cost.audit import axes_by_groups

    step, params, opt_state, tokens, _ = compiled_step(trainer)
    text, temp = step.as_text(), memory.measure(step)["temp"]
    params, opt_state, _, _ = timed_step(step, params, opt_state, tokens)
    made, times = [], []
    for _ in range(rounds):
        made.append(before() if before else None)
        times.append([])
        for _ in range(max(1, -(-steps // rounds))):
            params, opt_state, _, seconds = timed_step(step, params, opt_state, tokens)
            times[-1].append(seconds)
    step_s = statistics.median(t for ts in times for t in ts)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(trace_steps):
                params, opt_state, m = step(params, opt_state, tokens)
                jax.block_until_ready(m)
        events = trace.op_events(d)
    info = trace.classify(text, axes_by_groups(layout.mesh_axes()))
    return (step_s, times, made, trace.attribute(events, info, step_s, trace_steps), text,
            trace.op_seconds(events, info, step_s, trace_steps), info, temp)


def output_problem(flag: str, path: str | None) -> str | None:
    """Why `path` cannot be written as the file of `flag`, or None."""
    if path is None:
        return None
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        return f"{flag} {path}: is a directory"
    if not parent.is_dir():
        return f"{flag} {path}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{flag} {path}: not writable"
    return None


def flag_problem(mine) -> str | None:
    """This report's own bad flags (no jax needed), or None."""
    if mine.hardware != "cpu" and not mine.predict_only:
        return (f"--hardware {mine.hardware} prices a {mine.hardware}, but measuring runs "
                f"on this machine's CPU; pass --predict-only (or --hardware cpu)")
    if mine.calibration is not None and mine.hardware != "cpu":
        return f"--calibration is the cpu profile; --hardware {mine.hardware} does not use it"
    if mine.trace_steps < 1:
        return f"trace_steps={mine.trace_steps} must be >= 1"
    if mine.rounds < 1:
        return f"rounds={mine.rounds} must be >= 1"
    if mine.top_ops < 0:
        return f"top_ops={mine.top_ops} must be >= 0"
    if mine.top_ops and mine.predict_only:
        return "--top-ops lists measured ops; --predict-only measures nothing"
    if problem := output_problem("--json", mine.json) or output_problem("--plot", mine.plot):
        return problem
    try:
        check_apart({"--calibration": mine.calibration}, {"--json": mine.json,
                                                          "--plot": mine.plot})
    except UsageError as e:
        return str(e)
    if mine.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib)"
    return None


def run_peak(cfg, trainer) -> float:
    """The MFU denominator of a measured run, as the training CLI measures it on these
    devices (engine/run/mfu.py: the best 2048^3 matmul in the compute dtype, on a CPU the
    host's), so both tools report the same MFU for the same step time."""
    from engine.run.mfu import peak_flops

    return peak_flops(cfg.compute_dtype, list(trainer.mesh.devices.flat))[0]


def main(argv=None) -> int:
    cfg, tcfg, parallel, layout, mine = parse_or_exit(argv, build_parser())
    from engine.cost import calibration, hardware

    try:
        problem = flag_problem(mine)
        hw = None if problem else hardware.get(mine.hardware, mine.calibration)
    except calibration.ProfileError as e:
        problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not mine.predict_only:
        force_host_devices(layout.size)
        host_memory_or_exit(cfg)  # before anything is built: the step is run here
        keep_freed_memory()
    from engine.cost import report
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.cost.price import mfu as mfu_of, mfu_peak, model_flops, predicted_mfu

    rows = step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)
    measured, step_s, audit_clean, orows, rounds = None, None, None, [], None
    temp, mapped = None, 0
    if mine.predict_only:
        pred, pipe = predict_step(rows, hw, layout, parallel)
    else:
        from engine.cost.audit import audit
        from engine.run.step import Trainer

        trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
        dtype = "bfloat16" if cfg.dtype == "bf16" else "float32"
        hw = dataclasses.replace(hw, mfu_peak={dtype: run_peak(cfg, trainer)})
        before, n_rounds = None, 1
        if mine.hardware == "cpu" and mine.in_run_rates:
            from engine.cost.microbench import in_run_profile

            devices = trainer.mesh.devices.flatten().tolist()
            before = functools.partial(in_run_profile, hw, rows, devices)
            n_rounds = mine.rounds
        step_s, times, profiles, measured, text, op_s, info, temp = measure(
            layout, trainer, tcfg.steps, mine.trace_steps, n_rounds, before)
        mapped = mapped_each_step(temp) if hw.shared_host else 0
        priced = [predict_step(rows, p or hw, layout, parallel, mapped) + (p or hw,)
                  for p in profiles]
        pred, pipe, hw = sorted(priced, key=lambda x: x[0].step_s)[(len(priced) - 1) // 2]
        rounds = [{"predicted_s": q.step_s, "measured_s": statistics.median(ts)}
                  for (q, _, _), ts in zip(priced, times)]
        if len(rounds) > 1:
            print("rounds (rates measured, then steps timed): " + "; ".join(
                f"{r['predicted_s']:.4g} / {r['measured_s']:.4g} s" for r in rounds)
                + " predicted / measured")
        if mine.top_ops:
            orows = report.op_table(op_s, info, text, mine.top_ops)
        a = audit(rows, text, layout.mesh_axes(), "cpu")
        audit_clean = a.clean
        print(f"audit: {'clean' if a.clean else 'NOT clean'}; rules applied: {a.rules}")
        for k, n in {**a.missing, **a.extra}.items():
            side = "dropped by compiler" if k in a.missing else "added by compiler"
            print(f"  {side}: {n} x {k} {a.names[k]}")
    print(f"hardware {hw.name} ({hw.source}); layout {layout}; {cfg.dtype}, remat {cfg.remat}")
    if mine.predict_only:
        print(report.assumptions(cfg, parallel, hw, mine.activations))
    srows = report.scope_table(pred, measured, hw)
    if mine.by == "fusion":
        print(report.format_fusions(report.fusion_table(pred, hw)))
    print(report.format_scopes(srows))
    crows = report.collective_table(pred, measured, layout.mesh_axes())
    print(report.format_collectives(crows))
    if not hw.overlap:
        print("  (no overlap on this hardware: every collective is exposed; on forced CPU "
              "devices collectives run synchronously, so measured time is all exposed)")
    if orows:
        print(report.format_ops(orows))
    if pipe is not None:
        fwd, bwd, weight = pipe.unit_s.max(axis=1)
        split = f", weight grads {weight:.4g} s" if weight else ""
        print(f"pipeline {parallel.pp_schedule}, pp={layout.degree('pp')}, "
              f"M={parallel.microbatches}: {len(pipe.tick_s)} ticks of {pipe.tick_s.min():.4g}-"
              f"{pipe.tick_s.max():.4g} s (slowest stage's forward {fwd:.4g} s, backward "
              f"{bwd:.4g} s{split}, shifts {pipe.shift_s:.4g} s); predicted bubble "
              f"{pipe.bubble:.3f} of stage time, the schedule's idle fraction "
              f"{pipe.schedule_bubble:.3f}" + (
                  " (uniform: every stage runs each tick's units and keeps its own, so that "
                  "a ring's permutes meet on every device)" if pipe.uniform else
                  " (a shared host: the step does not pay the wait in full, idle stages "
                  "leave their cores to the busy ones)" if hw.shared_host else ""))
        print("  (the tables above count each unit's rows M times, the first stage's "
              "embedding and the last stage's loss alike; step s is the pipelined step)")
    mflops = model_flops(cfg, tcfg)
    mfu = predicted_mfu(pred, cfg, tcfg, hw, layout.size)
    meas_mfu = mfu_of(cfg, tcfg, hw, layout.size, step_s) if step_s else None
    g4 = lambda x: None if x is None else f"{x:.4g}"
    pct = lambda x: None if x is None else f"{100 * x:.1f}%"
    if temp is not None and hw.shared_host:
        print(f"temporaries: {temp / 2**20:.1f} MiB a device, " + (
            f"mapped anew every step (above glibc's {THREAD_HEAP_MAX >> 20} MiB thread heap): "
            f"their page faults priced {pred.fault_s:.4g} s" if mapped else
            "kept in the heap between steps: no page faults priced"))
    print(report.tabulate([["compute s", g4(pred.compute_s), None],
                           ["comm (all) s", g4(pred.comm_s), None],
                           ["comm exposed s", g4(pred.exposed_comm_s), None],
                           ["page faults s", g4(pred.fault_s), None],
                           ["step s", g4(pred.step_s), g4(step_s)],
                           ["MFU", pct(mfu), pct(meas_mfu)]],
                          ["step summary", "predicted", "measured"], disable_numparse=True))
    if hw.overlap and hw.overlap_slowdown:
        print(f"comm exposed counts {hw.hidden_comm_share:.3g} "
              f"of each hidden collective's time: compute runs {hw.overlap_slowdown:.1%} "
              f"slower beside a collective on {hw.name} (engine/cost/hardware.py)")
    print(f"MFU: {mflops / 1e9:.3g} model GFLOP per step over a peak of "
          f"{mfu_peak(cfg, hw, layout.size) / 1e12:.3g} TFLOP/s "
          f"({'the host' if hw.shared_host else f'{layout.size} chips'}, {cfg.dtype})")
    from engine.cost.fit import memory_fit

    peak_bytes, fits = memory_fit(cfg, tcfg, parallel, layout, hw)
    live = None
    if peak_bytes is not None:
        cap = f" of {hw.hbm_capacity / 2**30:.0f} GiB: {'fits' if fits else 'does NOT fit'}" \
            if fits is not None else ""
        print(f"predicted peak HBM per device {peak_bytes / 2**30:.1f} GiB{cap}")
        # `fits` is the hand model's (flash attention's own buffers); the liveness walk
        # of the traced jnp step is an upper bound (XLA:CPU: 1.0-1.33x, bench/memory.py)
        from engine.cost import liveness
        from engine.cost.ledger import trace_step
        closed = trace_step(cfg, tcfg, layout, parallel)
        live, fused = (liveness.peak_bytes(closed, fuse=f)[0] for f in (False, True))
        print(f"  liveness of the traced step: {live / 2**30:.1f} GiB (upper bound), "
              f"{fused / 2**30:.1f} GiB with loop fusion")
    if step_s:
        print(f"step error {100 * (pred.step_s - step_s) / step_s:+.1f}% "
              f"(model {mflops / 1e9:.1f} GFLOP/step)")
    if mine.json:
        Path(mine.json).write_text(json.dumps({
            "layout": str(layout), "hardware": mine.hardware, "predicted_step_s": pred.step_s,
            "measured_step_s": step_s, "predicted_mfu_fraction": mfu,
            "measured_mfu_fraction": meas_mfu,
            # the same fractions under the names the planner's JSON gives them
            "predicted_mfu": mfu, "measured_mfu": meas_mfu,
            "audit_clean": audit_clean, "predicted_peak_bytes": peak_bytes, "fits": fits,
            "liveness_peak_bytes": live,
            "predicted_compute_s": pred.compute_s,
            "predicted_bubble": None if pipe is None else pipe.bubble,
            "schedule_bubble": None if pipe is None else pipe.schedule_bubble,
            "predicted_comm_s": pred.comm_s, "predicted_exposed_comm_s": pred.exposed_comm_s,
            # one device's temporaries, the bytes of them mapped anew each step and the
            # page faults that costs (engine/run/host.py); None / 0 without a compiled step
            "temp_bytes": temp, "mapped_bytes": mapped, "predicted_fault_s": pred.fault_s,
            # per round: the rates measured, then its share of the timed steps (median)
            "rounds": rounds,
            "scopes": [dict(zip(["scope", "flops", "bytes", "intensity", "bound",
                                 "predicted_s", "measured_s", "error_fraction"], r))
                       for r in srows],
            "collectives": [dict(primitive=r[0], axes=r[1].split(",") if r[1] else [],
                                 bytes=r[2], count=r[3], predicted_s=r[4],
                                 predicted_exposed_s=r[5], predicted_hidden_s=r[4] - r[5],
                                 measured_s=r[6], wait_s=r[7]) for r in crows],
            "ops": [dict(zip(["op", "kind", "scope", "phase", "result", "runs_per_step",
                              "computes", "measured_s", "share"], r)) for r in orows],
        }, indent=1))
    if mine.plot:
        report.plot_roofline(srows, pred, hw, layout.size, mine.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
