"""The pipelined published rows priced with one engine mechanism taken out at a time.

    python bench/published_mechanisms.py             # every pipelined row of the table
    python bench/published_mechanisms.py --only "Megatron 310"
    python bench/published_mechanisms.py --breakdown      # each row's step and peak in parts

Each column prices the row as bench/published.py's "as the source ran it" column does,
from the same ledger rows less the rows of one mechanism the engine runs, to say how
much of a miss each accounts for (the table prices them):
- embedding RS: ZeRO-2's embedding / unembedding grad reduce-scatters inside the units
  (none since the pipeline sums those grads over the microbatches and reduce-scatters
  them once a step: the column checks that nothing is left);
- chunk copies: an interleaved unit's large f32 slices and updates of its chunk's rows
  of the stage's stack (the chunk's weights sliced once each way a unit, its grads
  added into its rows);
- no bubble: every unit back to back (M·V forward and backward units of the slowest
  stage, plus the rows outside the ticks), both mechanisms out.
`--breakdown` prints, per row (pipelined or not: `--only torchtitan --breakdown`), the
predicted step in parts. A row without a pipeline: matmuls, the attention kernel's
forward, recompute and backward, elementwise work and each collective kind's exposed
time, with the rate each compute part ran at (matmuls: their FLOPs over their time; the
flash kernel: in its benchmarks' convention, half the [L, L] FLOPs). A pipelined row:
(ticks x the
slowest stage's forward and backward units, each split into matmul, attention,
elementwise and exposed collectives by kind and axes; the tick's own shifts and buffer
writes; the bubble; the rows outside the ticks by scope) and the memory peak in parts
(params, optimizer state, grads, the stash as slots x per slot, shift buffers, the
transient of the unit's backward).
Results: bench/results/2026-11-28-published-cpu.md, bench/results/2026-11-29-published-cpu.md,
bench/results/2026-11-29-published-gpu-cpu.md (rows without a pipeline).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import published  # noqa: E402
from bench.published_runs import HELD_OUT, RUNS  # noqa: E402


def mechanisms(plan) -> dict:
    """{mechanism: predicate on a ledger row that it belongs to the mechanism}."""
    from engine.cost import pipeline as cp
    from layers import scopes

    def in_unit(r):
        return scopes.PP_TICK in r.pp and cp.unit_of(r) is not None and not set(r.pp) & cp.EDGES

    return {
        "embedding RS": lambda r: (in_unit(r) and r.scope in ("embed", "loss")
                                   and r.primitive == "reduce_scatter"),
        "chunk copies": lambda r: (plan.virtual > 1 and in_unit(r) and r.scope == "other"
                                   and r.dtype == "float32" and r.bytes > 1e8
                                   and r.primitive in ("dynamic_slice", "dynamic_update_slice",
                                                       "broadcast_in_dim", "add")),
    }


def traced(r):
    """(settings, cfg, tcfg, parallel, layout, hw, ledger rows, plan) of `r` as its
    source ran it."""
    from engine.cli.args import build_parser, parse_or_exit
    from engine.cost.ledger import step_ledger
    from engine.parallel import pipeline

    s = published.source_settings(r)
    cfg, tcfg, parallel, layout, _ = parse_or_exit(published.argv(r, s), build_parser())
    hw = published.profile(r, s)
    rows = step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)
    return s, cfg, tcfg, parallel, layout, hw, rows, pipeline.step_plan(layout, parallel)


def row_figures(r) -> list[float]:
    """[published, as priced, less each mechanism, less both, and no bubble] MFU %."""
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predicted_mfu
    from engine.run.mfu import flops_per_token

    _, cfg, tcfg, parallel, layout, hw, rows, plan = traced(r)

    def mfu(kept):
        pipe = predict_pipeline(kept, hw, layout.mesh_axes(), plan, parallel.prefetch)
        return 100 * predicted_mfu(pipe.prediction, cfg, tcfg, hw, layout.size), pipe

    out = [mfu(rows)[0]]
    found = mechanisms(plan)
    for test in found.values():
        out.append(mfu([x for x in rows if not test(x)])[0])
    rest, pipe = mfu([x for x in rows if not any(t(x) for t in found.values())])
    back_to_back = plan.units * pipe.unit_s.max(axis=1).sum() + pipe.outside_s
    per_token = flops_per_token(cfg, tcfg.seq)
    publ = 100 * published.tokens_per_chip(r, per_token) * per_token / published.PEAK[r.hardware]
    return [publ, *out, rest, rest * pipe.step_s / back_to_back]


def _parts(pred) -> dict:
    """{part: seconds} of a `price.Prediction`: compute by kind, collectives exposed by
    (primitive, axes)."""
    out = {}
    names = {"matmul": "matmul", "attention": "attention", "memory": "elementwise"}
    for p in pred.rows:
        key = (f"{p.row.primitive} {','.join(p.row.axes)}" if p.bound == "comm"
               else names.get(p.row.kind, p.row.kind))
        out[key] = out.get(key, 0.0) + (p.exposed if p.bound == "comm" else p.seconds)
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def _fmt(parts: dict, scale: float = 1e3, unit: str = "ms") -> str:
    return ", ".join(f"{k} {v * scale:.3g}" for k, v in parts.items()) + f" ({unit})"


def rates(pred, hw) -> list[tuple]:
    """[(part, seconds, TFLOP/s or None)] of a `price.Prediction` on `hw`: matmuls, the attention
    kernel by phase (its rate in its benchmarks' convention, `price.attention_flops`),
    elementwise work and each collective's exposed time by (primitive, axes)."""
    from engine.cost.price import attention_flops

    seconds, flops = {}, {}
    for p in pred.rows:
        r = p.row
        if p.bound == "comm":
            key, t, f = f"{r.primitive} {','.join(r.axes)} (exposed)", p.exposed, 0.0
        elif r.kind == "matmul":
            key, t, f = "matmul", p.seconds, r.flops * r.count
        elif r.kind == "attention":
            key = f"attention {r.phase}"
            t, f = p.seconds, attention_flops(r, hw) * r.count
        else:
            key, t, f = "elementwise", p.seconds, 0.0
        seconds[key] = seconds.get(key, 0.0) + t
        flops[key] = flops.get(key, 0.0) + f
    return [(k, t, flops[k] / t / 1e12 if flops[k] and t else None)
            for k, t in sorted(seconds.items(), key=lambda kv: -kv[1]) if t > 0]



def flat_breakdown(r) -> list[str]:
    """A row without a pipeline: its predicted step in parts with their rates."""
    from engine.cost.pipeline import predict_step
    from engine.cost.price import predict, predicted_mfu

    s, cfg, tcfg, parallel, layout, hw, rows, _ = traced(r)
    step, _ = predict_step(rows, hw, layout, parallel)
    pred = predict(rows, hw, layout.mesh_axes(), parallel.prefetch)
    mfu = 100 * predicted_mfu(step, cfg, tcfg, hw, layout.size)
    lines = [f"{r.name}: {' '.join(s.flags)}",
             (f"  {hw.name}: step {step.step_s:.3f} s (MFU {mfu:.1f}) = compute "
              f"{pred.compute_s:.3f} s + exposed communication {pred.exposed_comm_s:.3f} s "
              f"of {pred.comm_s:.3f} s; matmul rate {hw.matmul_rate('bfloat16') / 1e12:.0f} "
              "TFLOP/s bf16")]
    lines += [f"    {k:40s} {1e3 * t:9.1f} ms" + (f"  at {tf:.0f} TFLOP/s" if tf else "")
              for k, t, tf in rates(pred, hw)]
    return lines


def breakdown(r) -> list[str]:
    """The row's predicted step and memory peak in parts (module doc), as lines."""
    from engine.cost import pipeline as cp
    from engine.cost.fit import predicted
    from engine.cost.price import predict
    from layers import scopes

    if r.pp == 1:
        return flat_breakdown(r)
    s, cfg, tcfg, parallel, layout, hw, rows, plan = traced(r)
    mesh = layout.mesh_axes()
    pipe = cp.predict_pipeline(rows, hw, mesh, plan, parallel.prefetch)
    T, pp = plan.forward_TP.shape
    once = cp._once([x for x in rows if scopes.PP_TICK in x.pp])
    lines = [f"{r.name}: {' '.join(s.flags)}",
             f"  step {pipe.step_s:.3f} s = {T} ticks {pipe.tick_s.sum():.3f} s + outside "
             f"{pipe.outside_s:.3f} s (forward shifts hidden under backward slots: "
             f"{pipe.hidden_shift_s:.3f} s); {plan.units} units of each kind a device; bubble "
             f"{pipe.bubble:.3f} of stage time (the table's {pipe.schedule_bubble:.3f})"]
    for kind, name in ((cp.FORWARD, "forward"), (cp.BACKWARD, "backward")):
        stage = int(pipe.unit_s[kind].argmax())
        part = predict(cp.unit_rows(once, kind, stage, pp), hw, mesh, parallel.prefetch)
        lines.append(f"  {name} unit, slowest stage {stage}: {1e3 * pipe.unit_s[kind, stage]:.3g}"
                     f" ms = {_fmt(_parts(part))}")
    shift = [x for x in once if not set(cp.UNITS.values()) & set(x.pp)]
    lines.append(f"  a tick's own rows: {1e3 * pipe.shift_s:.3g} ms = "
                 f"{_fmt(_parts(predict(shift, hw, mesh, parallel.prefetch)))}")
    outside = predict([x for x in rows if scopes.PP_TICK not in x.pp], hw, mesh,
                      parallel.prefetch)
    lines.append(f"  outside the ticks: {_fmt(_parts(outside), 1, 's')}")
    mem = predicted(cfg, tcfg, parallel, layout, hw)
    if mem is not None:
        gib = 2 ** 30
        lines.append(f"  peak {mem.peak / gib:.1f} GiB ({mem.phase}): params "
                     f"{mem.params / gib:.2f}, optimizer state {mem.opt_state / gib:.2f}, "
                     f"grads live {mem.grads_live / gib:.2f}, transient "
                     f"{mem.transient / gib:.2f}")
        lines += [f"    {v / gib:8.2f} GiB {k}" for k, v in mem.items.items()
                  if k.startswith("pipeline:")]
    return lines


def main(argv=None) -> int:
    from tabulate import tabulate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="rows whose name contains this text")
    p.add_argument("--breakdown", action="store_true",
                   help="print each row's step (and a pipelined row's memory peak) in "
                        "parts instead, held-out rows included")
    args = p.parse_args(argv)
    pick = [r for r in RUNS + (HELD_OUT if args.breakdown else ())
            if args.only is None or args.only in r.name]
    rows = pick if args.breakdown else [r for r in pick if r.pp > 1]
    if not rows:
        what = "row" if args.breakdown else "pipelined row"
        print(f"error: no {what} matches {args.only!r}", file=sys.stderr)
        return 2
    if args.breakdown:
        published._plans_once()
        for r in rows:
            print("\n".join(breakdown(r)))
        return 0
    print(tabulate([[r.name, *row_figures(r)] for r in rows],
                   ["run", "published", "priced", "no embedding RS", "no chunk copies",
                    "neither", "and no bubble"], floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
