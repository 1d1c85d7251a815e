"""Predicted vs measured time per layer and per collective, and the step's roofline.

    python bench/roofline.py --layout fsdp4xtp2 --model small
    python bench/roofline.py --predict-only --hardware h100 --layout fsdp32xtp8 \\
        --model llama3-70b --batch 256 --seq 4096

Takes the training CLI's model and layout flags (`engine.train.build_parser`). Without
--predict-only it compiles the step on forced host devices, audits its collectives
against the ledger, times `--steps` steps (median wall clock) and attributes the time of
`--trace-steps` profiled steps to ledger categories (engine/cost/trace.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.train import force_host_devices, keep_freed_memory, parse_or_exit  # noqa: E402
from engine.train import build_parser as train_parser  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The training CLI's flags plus this report's own."""
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("roofline report")
    g.add_argument("--hardware", default="cpu", choices=("cpu", "v4", "v5e", "v5p", "a100", "h100"),
                   help="profile to price with; cpu = the calibrated profile")
    g.add_argument("--predict-only", action="store_true",
                   help="trace on an AbstractMesh only: no devices, no run")
    g.add_argument("--calibration", default=None, help="cpu profile JSON (bench/calibrate.py)")
    g.add_argument("--in-run-rates", action=argparse.BooleanOptionalAction, default=True,
                   help="cpu, when running: price with rates measured in this run just "
                        "before the step is timed, each dot at its own shapes, all devices "
                        "at once (engine/cost/microbench.py), instead of the calibration file")
    g.add_argument("--trace-steps", type=int, default=2, help="steps to profile")
    g.add_argument("--json", default=None, help="write figures as JSON")
    g.add_argument("--by", default="scope", choices=("scope", "fusion"),
                   help="compute table per named scope, or per fusion group (the "
                        "accelerator fusion model, engine/cost/fusion.py)")
    g.add_argument("--plot", default=None, help="roofline PNG (needs matplotlib)")
    p = train_parser(prog="python bench/roofline.py", description=__doc__.split("\n\n")[0],
                     parents=[own])
    p.set_defaults(steps=5)  # steps timed for the measured column
    return p


def _err(pred, meas):
    return None if meas in (None, 0) else (pred - meas) / meas


def _fmt(x, unit=""):
    if x is None:
        return "-"
    return f"{100 * x:+.0f}%" if unit == "%" else f"{x:.3g}"


def scope_table(pred, measured, hw):
    """Rows per scope: FLOPs, bytes (as priced on `hw`), intensity, bound, predicted,
    measured, error."""
    from engine.cost.price import moved_bytes

    agg = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for p in pred.rows:
        if p.row.kind == "collective":
            continue
        a = agg[p.row.scope]
        a[0] += p.row.total_flops
        a[1] += moved_bytes(p.row, hw) * p.row.count
        a[2] += p.seconds
        a[3] += p.seconds if p.bound == "compute" else 0.0
    meas = collections.Counter()
    for (kind, scope, *_), s in (measured or {}).items():
        if kind in ("matmul", "memory"):
            meas[scope] += s
    out = []
    for scope, (flops, nbytes, t, t_compute) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        m = meas.get(scope) if measured else None
        out.append([scope, flops, nbytes, flops / max(nbytes, 1),
                    "compute" if t_compute >= t / 2 else "memory", t, m, _err(t, m)])
    return out


def fusion_table(pred, hw, top: int = 25):
    """The `top` fusion groups by predicted time: scope, phase, members (primitives),
    count, FLOPs, bytes per step, bound, predicted seconds."""
    from engine.cost.price import moved_bytes

    agg = {}
    for p in pred.rows:
        r = p.row
        if r.kind == "collective":
            continue
        if r.fusion < 0 and r.kind != "attention":
            continue  # merged into an identical op (CSE): moves nothing
        key = ("kernel", id(r)) if r.fusion < 0 else ("fusion", r.fusion)
        a = agg.setdefault(key, dict(scope=r.scope, phase=r.phase, ops=collections.Counter(),
                                     count=r.count, flops=0.0, bytes=0.0, s=0.0, cs=0.0))
        a["ops"][r.primitive] += 1
        a["flops"] += r.total_flops
        a["bytes"] += moved_bytes(r, hw) * r.count
        a["s"] += p.seconds
        a["cs"] += p.seconds if p.bound == "compute" else 0.0
    out = []
    for a in sorted(agg.values(), key=lambda a: -a["s"])[:top]:
        ops = " ".join(f"{k}x{n}" if n > 1 else k for k, n in a["ops"].most_common(4))
        out.append([a["scope"], a["phase"], ops, a["count"], a["flops"], a["bytes"],
                    "compute" if a["cs"] >= a["s"] / 2 else "memory", a["s"]])
    return out


def memory_fit(cfg, tcfg, layout, hw):
    """(predicted peak bytes per device, fits in hw.hbm_capacity) for an accelerator
    (engine/cost/memory.py, flash attention); (None, None) when not modelled."""
    from engine.cost import memory

    if hw.shared_host:
        return None, None
    try:
        peak = memory.predict(cfg, tcfg, layout, platform="accelerator").peak
    except memory.Unsupported:
        return None, None
    return peak, (peak <= hw.hbm_capacity) if hw.hbm_capacity else None


def collective_table(pred, measured, mesh_axes):
    """Rows per (HLO kind, axes): bytes/step, count, predicted, predicted exposed,
    measured transfer, wait, error."""
    from engine.cost.audit import canonical_axes
    from engine.cost.ledger import COLLECTIVES

    agg = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    for p in pred.rows:
        kind = COLLECTIVES.get(p.row.primitive)
        if p.row.kind != "collective" or kind is None or p.row.bytes == 0:
            continue
        a = agg[(kind, canonical_axes(p.row.axes, mesh_axes))]
        a[0] += p.row.total_bytes
        a[1] += p.row.count
        a[2] += p.seconds
        a[3] += p.exposed
    meas, wait = collections.Counter(), collections.Counter()
    for (kind, _, _, key), s in (measured or {}).items():
        if kind == "collective":
            meas[key] += s
        elif kind == "collective wait":
            wait[key] += s
    out = []
    for key, (nbytes, count, t, exposed) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        m = meas.get(key) if measured else None
        out.append([key[0], ",".join(key[1]), nbytes, count, t, exposed, m,
                    wait.get(key) if measured else None, _err(t, m)])
    return out


def plot_roofline(srows, hw, n_devices: int, path: str) -> None:
    """Per-scope points (FLOP/B, achieved FLOP/s per device, predicted and measured)
    under the profile's roofs. Needs the optional `plot` extra (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = n_devices if hw.shared_host else 1
    x = [10 ** (i / 10) for i in range(-20, 51)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype in sorted(hw.peak_flops):
        peak = hw.matmul_peak(dtype) * hw.matmul_eff / share
        ax.plot(x, [min(peak, i * hw.hbm * hw.mem_eff / share) for i in x], label=f"roof {dtype}")
    for scope, flops, _, intensity, _, t_pred, t_meas, _ in srows:
        if flops and intensity:
            ax.scatter([intensity], [flops / t_pred], marker="o")
            ax.annotate(scope, (intensity, flops / t_pred), fontsize=8)
            if t_meas:
                ax.scatter([intensity], [flops / t_meas], marker="x", color="k")
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="FLOP/s per device",
           title=f"{hw.name}: predicted (o) and measured (x) per scope")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def measure(cfg, tcfg, layout, trainer, steps: int, trace_steps: int):
    """(median step seconds, attributed {category: s}, hlo text)."""
    import jax

    from bench.timing import compiled_step, time_steps
    from engine.cost import trace
    from engine.cost.audit import axes_by_groups

    step, params, opt_state, tokens, _ = compiled_step(trainer)
    text = step.as_text()
    step_s, params, opt_state, _ = time_steps(step, params, opt_state, tokens, steps)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(trace_steps):
                params, opt_state, m = step(params, opt_state, tokens)
                jax.block_until_ready(m)
        events = trace.op_events(d)
    info = trace.classify(text, axes_by_groups(layout.mesh_axes()))
    return step_s, trace.attribute(events, info, step_s, trace_steps), text


def main(argv=None) -> int:
    cfg, tcfg, parallel, layout, mine = parse_or_exit(argv, build_parser())
    if not mine.predict_only:
        force_host_devices(layout.size)
        keep_freed_memory()
    from tabulate import tabulate

    from engine.cost import hardware
    from engine.cost.ledger import step_ledger
    from engine.cost.price import model_flops, predict, predicted_mfu

    hw = hardware.get(mine.hardware, mine.calibration)
    rows = step_ledger(cfg, tcfg, layout, parallel)
    measured, step_s, audit_clean = None, None, None
    if not mine.predict_only:
        from engine.cost.audit import audit
        from engine.step import Trainer

        trainer = Trainer(cfg, tcfg, layout, layout.mesh(), parallel)
        if mine.hardware == "cpu" and mine.in_run_rates:
            from engine.cost.microbench import in_run_profile

            hw = in_run_profile(hw, rows, trainer.mesh.devices.flatten().tolist())
    pred = predict(rows, hw, layout.mesh_axes(), prefetch=parallel.prefetch)
    if not mine.predict_only:
        step_s, measured, text = measure(cfg, tcfg, layout, trainer, tcfg.steps, mine.trace_steps)
        a = audit(rows, text, layout.mesh_axes(), "cpu")
        audit_clean = a.clean
        print(f"audit: {'clean' if a.clean else 'NOT clean'}; rules applied: {a.rules}")
        for k, n in {**a.missing, **a.extra}.items():
            side = "dropped by compiler" if k in a.missing else "added by compiler"
            print(f"  {side}: {n} x {k} {a.names[k]}")
    print(f"hardware {hw.name} ({hw.source}); layout {layout}; {cfg.dtype}, remat {cfg.remat}")
    heads = ["scope", "FLOPs", "bytes", "FLOP/B", "bound", "pred s", "meas s", "err"]
    srows = scope_table(pred, measured, hw)
    if mine.by == "fusion":
        print(tabulate([[*r[:4], *map(_fmt, r[4:6]), r[6], _fmt(r[7])]
                        for r in fusion_table(pred, hw)],
                       ["scope", "phase", "fusion (top ops)", "count", "FLOPs", "bytes",
                        "bound", "pred s"]))
    print(tabulate([[r[0], *map(_fmt, r[1:4]), r[4], *map(_fmt, r[5:7]), _fmt(r[7], "%")]
                    for r in srows], heads))
    crows = collective_table(pred, measured, layout.mesh_axes())
    print(tabulate([[r[0], r[1], *map(_fmt, r[2:8]), _fmt(r[8], "%")] for r in crows],
                   ["collective", "axes", "bytes/step", "count", "pred s", "pred exposed s",
                    "meas s", "wait s", "err"]))
    if not hw.overlap:
        print("  (no overlap on this hardware: every collective is exposed; on forced CPU "
              "devices collectives run synchronously, so measured time is all exposed)")
    mflops = model_flops(cfg, tcfg)
    mfu = predicted_mfu(pred, cfg, tcfg, hw, layout.size)
    meas_mfu = mfu * pred.step_s / step_s if step_s else None
    print(tabulate([["compute", pred.compute_s, None], ["comm (all)", pred.comm_s, None],
                    ["comm exposed", pred.exposed_comm_s, None],
                    ["step", pred.step_s, step_s], ["MFU", mfu, meas_mfu]],
                   ["step summary", "predicted", "measured"], floatfmt=".4g"))
    peak_bytes, fits = memory_fit(cfg, tcfg, layout, hw)
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
            "measured_step_s": step_s, "predicted_mfu": mfu, "measured_mfu": meas_mfu,
            "audit_clean": audit_clean, "predicted_peak_bytes": peak_bytes, "fits": fits,
            "liveness_peak_bytes": live,
            "predicted_compute_s": pred.compute_s,
            "predicted_comm_s": pred.comm_s, "predicted_exposed_comm_s": pred.exposed_comm_s,
            "scopes": [dict(zip(["scope", "flops", "bytes", "intensity", "bound",
                                 "predicted_s", "measured_s", "error"], r)) for r in srows],
            "collectives": [dict(primitive=r[0], axes=r[1].split(",") if r[1] else [],
                                 bytes=r[2], count=r[3], predicted_s=r[4],
                                 predicted_exposed_s=r[5], predicted_hidden_s=r[4] - r[5],
                                 measured_s=r[6], wait_s=r[7]) for r in crows],
        }, indent=1))
    if mine.plot:
        plot_roofline(srows, hw, layout.size, mine.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
