"""Stage shifts under pp x tp allreduce: 1/tp slices gathered over tp against the whole value.

    python bench/pp_shift.py --model medium --layout pp2xtp2 --schedules gpipe 1f1b

Under `--tp-comm allreduce` the pipeline's x and its cotangent are the same on every tp
rank of a stage; engine/parallel/shifts.py sends 1/tp of them from each tp rank over pp
and all-gathers the slices over tp on arrival. For each schedule this compiles that
step and the same step with the shift sending the whole value from every tp rank (the
shift before it: `stage_shift` with no tp axis), then times them in turn
(`bench.timing.round_robin`, so a slow spell of the shared host falls on both) and
prints, per program: the compiled step's bytes a device moves per step by
collective-permute and by all-gather (engine/cost/hlo.py, loop trips counted), the
median and fastest step, the paired ratio sliced / whole (< 1: the slices are faster),
and the cost model's predicted step on the cpu and h100 profiles (the ledger traced
with each shift; the ledger cache is off). The model runs in f32 with `--layers`
layers.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import OneLineParser, UsageError, force_host_devices  # noqa: E402

MiB = 2 ** 20


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python bench/pp_shift.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="pp2xtp2", help="a layout with pp and tp axes")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                   choices=("gpipe", "1f1b", "interleaved", "zb1"))
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--virtual", type=int, default=2,
                   help="chunks per device of the interleaved schedule")
    p.add_argument("--model", default="medium", choices=("tiny", "small", "medium"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="passes over the programs")
    return p


def _whole(stage_shift):
    """`stage_shift` sending the whole value from every device (no tp slicing)."""
    return lambda v_BLD, pp, direction, tp=None: stage_shift(v_BLD, pp, direction, None)


def _bytes(text: str) -> dict[str, float]:
    """Bytes a device moves per step by collective-permute and by all-gather."""
    from engine.cost import hlo

    out = {"collective-permute": 0.0, "all-gather": 0.0}
    for c in hlo.collectives(text):
        if c.kind in out:
            out[c.kind] += c.bytes * c.count
    return out


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numbers = ("microbatches", "virtual", "layers", "batch", "seq", "rounds")
    if min(getattr(args, n) for n in numbers) < 1:
        print(f"error: --{', --'.join(numbers)} must be positive", file=sys.stderr)
        return 2
    os.environ["SHARDWISE_LEDGER_CACHE"] = "off"  # the two shifts share their source
    force_host_devices(8)
    from engine.config import ConfigError, ParallelConfig, TrainConfig, model_config
    from engine.parallel.layout import Layout

    try:
        layout = Layout.parse(args.layout)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if layout.degree("pp") < 2 or layout.degree("tp") < 2 or layout.size > 8:
        print(f"error: --layout {args.layout} needs a pp and a tp axis on at most 8 "
              "devices", file=sys.stderr)
        return 2

    from tabulate import tabulate

    from bench.timing import compiled_step, paired_ratio, round_robin
    from engine.cost import hardware
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.parallel import shifts, validate
    from engine.run.step import Trainer

    cfg = model_config(args.model, dtype="f32", n_layers=args.layers)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq)
    programs, rows = [], []
    for schedule in args.schedules:
        par = ParallelConfig(microbatches=args.microbatches, pp_schedule=schedule,
                             tp_comm="allreduce",
                             pp_virtual=args.virtual if schedule == "interleaved" else 1)
        try:
            validate.check(cfg, tcfg, par, layout)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for shift in ("sliced", "whole"):
            with (mock.patch.object(shifts, "stage_shift", _whole(shifts.stage_shift))
                  if shift == "whole" else contextlib.nullcontext()):
                trainer = Trainer(cfg, tcfg, layout, layout.mesh(), par)
                step, params, opt_state, tokens, _ = compiled_step(trainer)
                ledger = step_ledger(cfg, tcfg, layout, par)
            predicted = [predict_step(ledger, hardware.get(h), layout, par)[0].step_s
                         for h in ("cpu", "h100")]
            params, opt_state, _ = step(params, opt_state, tokens)  # warm
            programs.append([step, params, opt_state, tokens])
            rows.append(dict(schedule=schedule, shift=shift, bytes=_bytes(step.as_text()),
                             predicted=predicted))
            print(f"  compiled {schedule} {shift}", file=sys.stderr, flush=True)
    times = round_robin(programs, args.rounds, say=lambda s: print(s, file=sys.stderr))
    table = []
    for k, r in enumerate(rows):
        ratio = (f"{paired_ratio(times[k], times[k + 1]):.3f}" if r["shift"] == "sliced"
                 else "")
        table.append([r["schedule"], r["shift"],
                      f"{r['bytes']['collective-permute'] / MiB:.2f}",
                      f"{r['bytes']['all-gather'] / MiB:.2f}",
                      f"{statistics.median(times[k]):.4g}", f"{min(times[k]):.4g}", ratio,
                      f"{r['predicted'][0]:.4g}", f"{r['predicted'][1] * 1e3:.4g}"])
    load = os.getloadavg()
    print(f"{args.model}, {args.layers} layers, f32, {args.layout} --tp-comm allreduce, "
          f"M={args.microbatches}, batch {args.batch}, seq {args.seq}, {args.rounds} rounds; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(tabulate(table, ["schedule", "shift", "permute MiB/step", "all-gather MiB/step",
                           "step s median", "step s min", "sliced / whole",
                           "pred. cpu s", "pred. h100 ms"], disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
