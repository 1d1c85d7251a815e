"""How far the planner's matmul timing (`refine`) moves the ratio of candidates'
predicted steps from one timing to the next, in one pass over their dots and in several.

    python bench/dot_passes.py --model medium [--passes 1,3] [--repeats 6] \\
        [--candidate "fsdp8 --zero 3" --candidate "fsdp4xtp2 --zero 3 --tp-comm sequence"]

Traces each candidate's step (its layout and switches after the model and training
flags), then `--repeats` times: times every distinct dot of all of them on the host
devices at once (engine/cost/microbench.py `dot_seconds`, the next of `--passes` each
time, so the settings alternate and share the host's slow spells) and prices each step
with those times (engine/cost/pipeline.py `predict_step`, the rest at `--calibration`'s
rates). Prints each repeat's seconds and predicted steps over the first candidate's,
then, per pass count, the spread of those ratios: the noise `engine.plan.DOT_PASSES`
is chosen against.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (
    build_parser as train_parser,  # noqa: E402
    parse_or_exit,  # noqa: E402
)

CANDIDATES = ("fsdp8 --zero 3", "fsdp4xtp2 --zero 3 --tp-comm sequence",
              "fsdp4xtp2 --zero 2 --tp-comm sequence", "dp2xfsdp4 --zero 3")


def own_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("dot passes")
    g.add_argument("--devices", type=int, default=8, help="forced host-CPU devices")
    g.add_argument("--candidate", action="append", default=None, metavar="LAYOUT_AND_FLAGS",
                   help="a layout and its switches, e.g. \"fsdp4xtp2 --zero 3\"; repeat; the "
                        "first is the baseline (default: " + "; ".join(CANDIDATES) + ")")
    g.add_argument("--passes", default="1,3", help="pass counts to alternate, comma separated")
    g.add_argument("--repeats", type=int, default=6, help="timings of the dots per pass count")
    g.add_argument("--calibration", default=None,
                   help="cpu profile JSON for the rows that are not dots (bench/calibrate.py)")
    return own


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own = own_parser()
    parser = train_parser(prog="python bench/dot_passes.py", description=__doc__.split("\n\n")[0],
                          parents=[own], groups=("model", "batch", "training"))
    mine, base = own.parse_known_args(argv)  # base: the flags every candidate shares
    parse_or_exit(argv, parser)  # --help and bad model flags: one line, exit 2
    try:
        passes = [int(p) for p in mine.passes.split(",")]
    except ValueError:
        passes = []
    if not passes or min(passes) < 1 or mine.repeats < 1 or mine.devices < 1:
        print("error: --passes wants counts >= 1 (e.g. 1,3); --repeats and --devices >= 1",
              file=sys.stderr)
        return 2
    cands = mine.candidate or list(CANDIDATES)
    from bench.plan_check import host_profile

    devices, hw = host_profile(mine.devices, mine.calibration)
    if devices is None:
        print(f"error: {hw}", file=sys.stderr)
        return 2
    from engine.cost import cache
    from engine.cost.microbench import dot_seconds, flat_mesh
    from engine.cost.pipeline import predict_step

    steps = []
    for c in cands:
        cfg, tcfg, parallel, layout, _ = parse_or_exit(
            base + ["--layout", *shlex.split(c)], train_parser())
        rows = cache.step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)[0]
        steps.append((rows, layout, parallel))
    dots = [r for rows, _, _ in steps for r in rows if r.dot is not None]
    mesh = flat_mesh(devices)
    print(f"{len({r.dot for r in dots})} distinct dots over {len(cands)} candidates; "
          f"baseline {cands[0]}")
    ratios = {p: [] for p in passes}
    for k in range(mine.repeats * len(passes)):
        n = passes[k % len(passes)]
        t0 = time.perf_counter()
        timed = dot_seconds(dots, mesh, passes=n)
        took = time.perf_counter() - t0
        priced = dataclasses.replace(hw, dot_seconds=timed)
        s = [predict_step(rows, priced, layout, parallel)[0].step_s
             for rows, layout, parallel in steps]
        ratios[n].append([x / s[0] for x in s[1:]])
        print(f"passes {n}: {took:.1f} s, load average {os.getloadavg()[0]:.1f}; "
              + ", ".join(f"{c} {x:.3f} s ({x / s[0]:.3f})" for c, x in zip(cands, s)),
              flush=True)
    from tabulate import tabulate

    table = []
    for n, rs in ratios.items():
        for i, c in enumerate(cands[1:]):
            col = [r[i] for r in rs]
            table.append([n, c, f"{min(col):.3f}", f"{max(col):.3f}",
                          f"{statistics.stdev(col):.3f}" if len(col) > 1 else "-"])
    print(tabulate(table, ["passes", f"step over {cands[0]}'s", "min", "max", "std dev"],
                   disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
