"""Pipeline schedules on 8 host devices: the bubble and the peak memory, measured and predicted.

    python bench/pipeline.py
    python bench/pipeline.py --pp 2 --schedules 1f1b --json pipeline.json

For each pp in --pp (layout pp{p}xfsdp{8/p}), M in {p, 2p, 4p} (--m-per-pp) and each schedule
(interleaved with --virtual chunks per device), the --model preset with 8 layers (f32,
--remat; --batch rows of --seq tokens) compiles once and runs; one row per
configuration:

    bubble        (p-1)/(V·M+p-1) (V = 1 but for interleaved), the schedule's idle
                  fraction (`Plan.bubble()`) when pp divides M; zb1 2(p-1)/(3M+2(p-1)), its
                  idle fraction with F = B = W (1F1B's ticks, up to s Ws deferred on
                  stage s)
    stash         the stash's slots per device (`Plan.stash_slots`): microbatches
                  (chunk units under interleaved) whose backward has not run
    idle meas.    the mean over devices of 1 - (time inside the pipeline's forward and
                  backward units) / step time, read off a profiler trace of --trace-steps
                  steps: per device, the union of the intervals of HLO ops whose
                  `op_name` is under the `pp_forward` / `pp_backward` / `pp_weight`
                  scopes
    idle pred.    engine/cost/pipeline.py's `bubble` on the cpu profile: the fraction
                  of its time a stage waits when every tick lasts its slowest stage's
                  unit (the units priced on this host)
    + shifts      the same with each tick lasting its slowest unit plus its shifts
                  (the stage ppermutes and buffer writes outside the units, which the
                  trace counts as idle)
    h100 bubble   `bubble` with the units priced on an H100
    step s        median wall clock of --steps steps; pred. = engine/cost/pipeline.py
                  on the cpu profile (a shared host: a tick costs the mean of its units)
    peak MiB      per device: `memory_analysis()` of the compiled step
                  (engine/cost/memory.py `measure`) and `memory.predict`

A second table splits a tick's traced time per device (`tick_parts`): the units, the
stage shifts' transfer and wait, the conds' dispatch and the buffer writes, and says
how many of the 2T possible shifts the table runs.

Forced host devices are threads sharing the host's cores: a stage with nothing to do in
a tick gives its cores to the busy ones, so the wall clock does not show the bubble the
way a chip per device would, and a busy unit is stretched by the other threads.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import OneLineParser, force_host_devices  # noqa: E402

MiB = 2 ** 20


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python bench/pipeline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4], choices=(2, 4, 8),
                   help="pipeline degrees (layout pp{p}xfsdp{8/p})")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb1"],
                   choices=("gpipe", "1f1b", "interleaved", "zb1"))
    p.add_argument("--m-per-pp", nargs="+", type=_positive, default=[1, 2, 4],
                   help="microbatches as multiples of pp")
    p.add_argument("--virtual", type=_positive, default=2,
                   help="chunks per device of the interleaved schedule (8 layers: "
                        "pp x V must divide 8)")
    p.add_argument("--batch", type=_positive, default=32,
                   help="global batch (divisible by fsdp x 4p)")
    p.add_argument("--seq", type=_positive, default=32)
    p.add_argument("--model", default="tiny", choices=("tiny", "medium"),
                   help="preset, run with 8 layers in f32")
    p.add_argument("--remat", default="full", choices=("full", "dots", "none"))
    p.add_argument("--steps", type=_positive, default=3,
                   help="steps timed per round, each schedule's in turn (`round_robin`)")
    p.add_argument("--rounds", type=_positive, default=2,
                   help="passes over the schedules of one (pp, M), each timing --steps steps")
    p.add_argument("--zero", type=int, default=3, choices=(1, 2, 3),
                   help="ZeRO level over fsdp (3: each unit gathers its layers' weights)")
    p.add_argument("--trace-steps", type=_positive, default=2, help="steps profiled")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    return p


def unit_intervals(text: str, events, kinds=None) -> dict[int, float]:
    """{device: seconds inside the units of `kinds` (scopes; default the forward,
    backward and W units)} from the trace's op events (`engine.cost.trace.op_events`),
    nested ops (a stage cond inside a unit) counted once: the union of their intervals."""
    from engine.cost import hlo
    from layers import scopes

    kinds = kinds or (scopes.PP_FORWARD, scopes.PP_BACKWARD, scopes.PP_WEIGHT)
    module = hlo.parse(text)
    first = {name: next((i.op_name for i in instrs if i.op_name), "")
             for name, instrs in module.computations.items()}
    units = {ins.name for ins in module.instructions()
             if any(s in (ins.op_name or first.get(ins.callee, "")) for s in kinds)}
    spans: dict[int, list] = {}
    for op, dev, start, dur in events:
        if op in units:
            spans.setdefault(dev, []).append((start, start + dur))
    busy = {}
    for dev, iv in spans.items():
        iv.sort()
        total, end = 0, None
        for a, b in iv:
            if end is None or a > end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
        busy[dev] = total / 1e9
    return busy


def tick_parts(text: str, events, devices, ticks: int) -> dict[str, float]:
    """A tick's mean time per device (seconds) split by what the tick body runs, from
    the trace's op events of one step (`engine.cost.trace.op_events`):

        unit      ops inside the forward / backward / W units (union of intervals)
        shift     the stage shifts' collective-permutes, each occurrence's fastest
                  device (what moving the data costs once every device has arrived)
        wait      the rest of the collective-permutes' time: devices waiting at the
                  shift for a slower neighbour (the lock-step idle)
        dispatch  the tick's conditionals (slot units, shifts) less the ops inside them
        buffers   the tick body's other ops (slot writes into the x / ct / stash / W
                  buffers, the table lookups)"""
    from engine.cost import hlo
    from layers import scopes

    module = hlo.parse(text)
    by_name = {i.name: i for i in module.instructions()}
    unit_names = (scopes.PP_FORWARD, scopes.PP_BACKWARD, scopes.PP_WEIGHT)
    in_unit = lambda i: any(u in i.op_name for u in unit_names)  # noqa: E731
    # the tick body: the computation holding the slot conditionals
    bodies = [i.computation for i in module.instructions() if i.opcode == "conditional"
              and scopes.PP_TICK in i.op_name and not in_unit(i)]
    body = max(set(bodies), key=bodies.count)
    parts = dict(unit=0.0, shift=0.0, wait=0.0, dispatch=0.0, buffers=0.0)
    per_dev = {d: sorted((e for e in events if e[1] == d), key=lambda e: e[2]) for d in devices}
    permutes: dict[str, list] = {}
    for d, evs in per_dev.items():
        for op, _, start, dur in evs:
            i = by_name.get(op)
            if i is None:
                continue
            if i.opcode == "collective-permute" and not in_unit(i) and scopes.PP_TICK in i.op_name:
                permutes.setdefault(op, []).append((d, dur))
            elif i.computation == body and i.opcode == "conditional":
                inner = sum(e[3] for e in evs if start <= e[2] and e[2] + e[3] <= start + dur
                            and e[0] != op)
                parts["dispatch"] += max(dur - inner, 0)
            elif i.computation == body and i.opcode not in ("collective-permute", "while"):
                parts["buffers"] += dur
    for occurrences in permutes.values():
        by_dev: dict = {}
        for d, dur in occurrences:
            by_dev.setdefault(d, []).append(dur)
        n = min(len(v) for v in by_dev.values())
        fastest = sum(min(by_dev[d][k] for d in by_dev) for k in range(n))
        parts["shift"] += fastest * len(by_dev)
        parts["wait"] += sum(sum(v) for v in by_dev.values()) - fastest * len(by_dev)
    parts["unit"] = sum(unit_intervals(text, events).values()) * 1e9
    return {k: v / 1e9 / len(devices) / ticks for k, v in parts.items()}


def unit_kinds(text: str, events, the_plan, n_devices: int, steps: int) -> dict[str, float]:
    """A unit's mean traced time per kind (seconds): F, B (under a split plan the input
    gradient alone) and W, each the union of its scope's op intervals summed over the
    devices, over the units of that kind they ran in `steps` steps; and "F coll." etc.,
    the time of the collectives inside them (the fsdp gathers, the grads'
    reduce-scatters), summed the same way."""
    from engine.cost import hlo
    from engine.parallel.schedules import NONE
    from layers import scopes

    counts = {"F": (the_plan.forward_TP != NONE).sum(), "B": (the_plan.backward_TP != NONE).sum(),
              "W": (the_plan.weight_TP != NONE).sum() if the_plan.split else 0}
    pp = the_plan.forward_TP.shape[1]
    by_name = {i.name: i for i in hlo.parse(text).instructions()}
    collective = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
                  "all-to-all")
    out = {}
    for kind, scope in (("F", scopes.PP_FORWARD), ("B", scopes.PP_BACKWARD),
                        ("W", scopes.PP_WEIGHT)):
        busy = sum(unit_intervals(text, events, (scope,)).values())
        comm = sum(dur for op, _, _, dur in events if op in by_name
                   and scope in (by_name[op].op_name or "")
                   and by_name[op].opcode.startswith(collective)) / 1e9
        # the devices are pp stages x the other axes: each stage's units run on n/pp
        units = counts[kind] * steps * n_devices // pp
        out[kind] = busy / units if units else 0.0
        out[f"{kind} coll."] = comm / units if units else 0.0
    return out


def _with_shifts(pipe, the_plan) -> float:
    """The predicted idle fraction of a device when every tick lasts its slowest stage's
    work plus the tick's shifts (the ops outside the units, which the trace counts as
    idle)."""
    pp = pipe.unit_s.shape[1]
    work_TP = the_plan.work_TP(*pipe.unit_s)
    return 1 - work_TP.sum() / (pp * (the_plan.lockstep_T(*pipe.unit_s) + pipe.shift_T).sum())


def run_one(cfg, tcfg, layout, par, args) -> tuple[dict, list]:
    """(the row of one configuration but its step time, [its compiled step, params,
    opt_state, tokens] run --trace-steps times: warm, for `round_robin`)."""
    import jax

    from bench.timing import compiled_step
    from engine.cost import hardware, memory, trace
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.parallel import pipeline
    from engine.run.step import Trainer

    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), par)
    step, params, opt_state, tokens, _ = compiled_step(trainer)
    measured_mem = memory.measure(step)["peak"]
    predicted_mem = memory.predict(cfg, tcfg, layout, "cpu", parallel=par).peak
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.trace_steps):
                params, opt_state, m = step(params, opt_state, tokens)
                jax.block_until_ready(m)
        events = trace.op_events(d)
    busy = unit_intervals(step.as_text(), events)
    the_plan = pipeline.step_plan(layout, par)
    devices = [d.id for d in trainer.mesh.devices.flat]
    tick = tick_parts(step.as_text(), events, devices, the_plan.ticks * args.trace_steps)
    kinds = unit_kinds(step.as_text(), events, the_plan, len(devices), args.trace_steps)
    wall = [e[2] for e in events], [e[2] + e[3] for e in events]
    traced_s = (max(wall[1]) - min(wall[0])) / 1e9 / args.trace_steps
    idle = [1 - busy.get(d, 0.0) / args.trace_steps / traced_s for d in devices]
    rows = step_ledger(cfg, tcfg, layout, par)
    cpu, cpu_pipe = predict_step(rows, hardware.get("cpu"), layout, par)
    _, h100 = predict_step(rows, hardware.get("h100"), layout, par)
    pp, M = layout.degree("pp"), par.microbatches
    V = par.pp_virtual
    return dict(pp=pp, microbatches=M, schedule=par.pp_schedule, virtual=V,
                ticks=the_plan.ticks, bubble_formula=(
                    2 * (pp - 1) / (3 * M + 2 * (pp - 1)) if the_plan.split
                    else (pp - 1) / (V * M + pp - 1)),
                schedule_bubble=the_plan.bubble(),
                measured_idle=statistics.mean(idle), measured_idle_min=min(idle),
                measured_idle_max=max(idle), traced_step_s=traced_s,
                predicted_step_s=cpu.step_s,
                predicted_idle=cpu_pipe.bubble,
                predicted_idle_shifts=_with_shifts(cpu_pipe, the_plan),
                h100_bubble=h100.bubble, stash_slots=the_plan.stash_slots,
                measured_peak_bytes=measured_mem, predicted_peak_bytes=predicted_mem,
                tick_s=tick, unit_kind_s=kinds,
                predicted_unit_kind_s=dict(zip("FBW", cpu_pipe.unit_s.max(axis=1).tolist())),
                shifts_run=int(the_plan.send_x_T.sum() + the_plan.send_ct_T.sum())), [
        step, params, opt_state, tokens]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    force_host_devices(8)
    import dataclasses
    import os

    from tabulate import tabulate

    from bench.timing import round_robin
    from engine.config import ParallelConfig, TrainConfig, model_config
    from engine.parallel.layout import Layout

    cfg = model_config(args.model, dtype="f32", remat=args.remat, n_layers=8)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq)
    for pp in args.pp:  # every configuration checked before any compiles
        if args.batch % (8 // pp * max(args.m_per_pp) * pp):
            print(f"error: --batch {args.batch} is not divisible by fsdp x M = "
                  f"{8 // pp} x {max(args.m_per_pp) * pp}", file=sys.stderr)
            return 2
        if "interleaved" in args.schedules and 8 % (pp * args.virtual):
            print(f"error: 8 layers are not divisible by pp x V = {pp} x {args.virtual}",
                  file=sys.stderr)
            return 2
    out, start = [], os.getloadavg()
    for pp in args.pp:
        layout = Layout.parse(f"pp{pp}xfsdp{8 // pp}")
        for m in (k * pp for k in args.m_per_pp):
            rows, held = [], []
            for schedule in args.schedules:
                v = args.virtual if schedule == "interleaved" else 1
                par = ParallelConfig(microbatches=m, pp_schedule=schedule, pp_virtual=v,
                                     zero=args.zero)
                row, warm = run_one(cfg, tcfg, layout, par, args)
                rows.append(row)
                held.append(warm)
                print(f"  traced pp={pp} M={m} {schedule}", file=sys.stderr, flush=True)
            say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
            times = round_robin(held, args.rounds, args.steps, say)
            for row, t in zip(rows, times):
                row["step_s_rounds"] = [statistics.median(t[r * args.steps:(r + 1) * args.steps])
                                        for r in range(args.rounds)]
                row["measured_step_s"] = statistics.median(t)
            base = rows[0]  # the ratios' reference: the first schedule (gpipe by default)
            for row in rows:
                row["step_ratio_rounds"] = [a / b for a, b in zip(row["step_s_rounds"],
                                                                  base["step_s_rounds"])]
                row["peak_ratio"] = row["measured_peak_bytes"] / base["measured_peak_bytes"]
                row["idle_ratio"] = row["measured_idle"] / base["measured_idle"]
                row["reference"] = base["schedule"]
            out.extend(rows)
            del held
    load = os.getloadavg()
    table = [[r["pp"], r["microbatches"],
              r["schedule"] + (f" V={r['virtual']}" if r["virtual"] > 1 else ""), r["ticks"], r["stash_slots"],
              f"{r['bubble_formula']:.3f}",
              f"{r['measured_idle']:.3f} ({r['measured_idle_min']:.2f}-{r['measured_idle_max']:.2f})",
              f"{r['predicted_idle']:.3f}", f"{r['predicted_idle_shifts']:.3f}", f"{r['h100_bubble']:.3f}", f"{r['measured_step_s']:.3g}", f"{r['predicted_step_s']:.3g}",
              f"{r['measured_peak_bytes'] / MiB:.2f}", f"{r['predicted_peak_bytes'] / MiB:.2f}"]
             for r in out]
    print(f"{args.model}, 8 layers, f32, remat {args.remat}, batch {args.batch}, seq {args.seq}; "
          f"layouts pp{{p}}xfsdp{{8/p}} zero {args.zero} on 8 host devices; load average "
          f"{start[0]:.2f} {start[1]:.2f} {start[2]:.2f} at the start, "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print(tabulate(table, ["pp", "M", "schedule", "ticks", "stash", "bubble (p-1)/(VM+p-1)",
                           "idle meas. (min-max)", "idle pred.", "+ shifts", "h100 bubble", "step s meas.",
                           "step s pred.", "peak MiB meas.", "peak MiB pred."],
                   disable_numparse=True))
    parts = ("unit", "shift", "wait", "dispatch", "buffers")
    print("\nA tick's mean time per device, ms (`tick_parts`): its units, the shifts' "
          "transfer and wait, the conds' dispatch, the buffer writes")
    print(tabulate([[r["pp"], r["microbatches"], r["schedule"], r["ticks"],
                     f"{r['shifts_run']} of {2 * r['ticks']}",
                     *(f"{r['tick_s'][k] * 1e3:.2f}" for k in parts),
                     f"{r['traced_step_s'] / r['ticks'] * 1e3:.2f}"] for r in out],
                   ["pp", "M", "schedule", "ticks", "shifts run", *parts, "traced step / ticks"],
                   disable_numparse=True))
    print("\nA unit's mean traced time per kind, ms (`unit_kinds`: B is the input gradient "
          "alone under zb1), and the cpu profile's price of the slowest stage's")
    kinds = ("F", "F coll.", "B", "B coll.", "W", "W coll.")
    print(tabulate([[r["pp"], r["microbatches"], r["schedule"],
                     *(f"{r['unit_kind_s'][k] * 1e3:.2f}" for k in kinds),
                     *(f"{r['predicted_unit_kind_s'][k] * 1e3:.2f}" for k in "FBW")]
                    for r in out],
                   ["pp", "M", "schedule", *kinds, "F pred.", "B pred.", "W pred."],
                   disable_numparse=True))
    print(f"\nStep seconds, median of --steps {args.steps} per round, the schedules of one "
          f"(pp, M) timed in turn (`round_robin`), and ratios to the first schedule's in the "
          f"same round; idle and compiled peak as ratios to its")
    print(tabulate([[r["pp"], r["microbatches"], r["schedule"],
                     " ".join(f"{x:.3g}" for x in r["step_s_rounds"]),
                     " ".join(f"{x:.2f}" for x in r["step_ratio_rounds"]),
                     f"{r['idle_ratio']:.2f}", f"{r['peak_ratio']:.2f}"] for r in out],
                   ["pp", "M", "schedule", "step s per round",
                    f"step / {out[0]['reference']} per round", "idle ratio", "peak ratio"],
                   disable_numparse=True))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            rows=out, load_average=load, load_average_start=start, config=dict(batch=args.batch, seq=args.seq,
                                                     model=dataclasses.asdict(cfg))),
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
