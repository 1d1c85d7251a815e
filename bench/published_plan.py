"""The planner on the published training runs of bench/published.py: for each run's
chip, chip count, model, sequence and batch, the planner's choice against the
published layout, both predicted by the same cost model (no devices).

    python bench/published_plan.py                 # every run
    python bench/published_plan.py --only 7b --json out.json

A full plan of 64-256 chips is thousands of programs, so the search is restricted, in
two stages, and always holds the published configuration itself:
1. layouts: axes dp, fsdp and tp only (no cp, pp or ep; dp and fsdp not both), tp at
   most `--max-tp` (8: one NVLink domain of the GPUs; on TPUs the same bound), every
   order of the axes, with the published run's switches where they apply;
2. switches: from the fastest of stage 1, one switch changed at a time (zero, prefetch,
   tp-comm, remat; engine/planner/search.py `neighbours`), moving to the fastest while it
   improves, at most `--rounds` times.
Prints the table, then for each run where the choice differs, `engine.planner.report.why`:
the compute and exposed-communication difference and the category holding most of it.
Candidates the memory model puts over the chip's HBM are dropped; where it puts the
published configuration itself over the HBM (it ran, so the memory model overestimates
it), the bound is the published configuration's predicted peak instead (flagged in the
table). Ledgers go to the planner's disk cache
(engine/cost/cache.py), and runs with the same model, chips and batch on other chips
share them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.published import RUNS, argv, profile, source_settings  # noqa: E402

DATA_AXES = ("dp", "fsdp")


def published_candidate(run):
    """(Candidate, TrainConfig) of the run as bench/published.py states it."""
    from engine.cli.args import build_parser, parse_or_exit
    from engine.planner import search as plan

    cfg, tcfg, parallel, layout, _ = parse_or_exit(argv(run, source_settings(run)), build_parser())
    return plan.Candidate(layout, parallel, cfg), tcfg


def shown(c) -> dict:
    """{switch: value} of the switches that apply to the candidate's layout."""
    from engine.planner import search as plan

    par = c.parallel
    return {s.name: v for s, v in zip(plan.SWITCHES, c.flags.values())
            if s.applies(c.layout, par)}


def changes(a, b) -> str:
    """What b changes from a: layout and the switches that apply to either, `x -> y`
    (`-`: does not apply)."""
    out = [f"layout {a.layout} -> {b.layout}"] if str(a.layout) != str(b.layout) else []
    fa, fb = shown(a), shown(b)
    out += [f"{k} {fa.get(k, '-')} -> {fb.get(k, '-')}" for k in {**fa, **fb}
            if fa.get(k, "-") != fb.get(k, "-")]
    return "; ".join(out) or "none"


def search(run, hw, executor, max_tp: int, rounds: int) -> dict:
    """The restricted plan of one run (module doc): the published candidate priced, the
    choice, and how many programs were priced."""
    from engine.cost import fit
    from engine.planner import search as plan

    pub, tcfg = published_candidate(run)
    n = pub.layout.size
    capacity = fit.capacity(hw, n)
    stage1, _ = plan.candidates(pub.cfg, tcfg, n, pub.flags, ("dp", "fsdp", "tp"),
                                {"tp": max_tp}, pub.parallel)
    stage1 = [c for c in stage1 if not all(c.layout.degree(a) > 1 for a in DATA_AXES)]
    seen: dict[tuple, object] = {}
    over: dict[tuple, int] = {}
    programs = cached = over_programs = 0

    def priced(cands):
        nonlocal programs, cached, over_programs
        fresh = [c for c in cands if (c.program, str(c.layout)) not in seen
                 and (c.program, str(c.layout)) not in over]
        ranked, out, p, h, _ = plan.price(fresh, tcfg, hw, n, capacity, executor=executor)
        programs, cached = programs + p, cached + h
        over_programs += len({c.program for c, _ in out})
        seen.update({(p.candidate.program, str(p.candidate.layout)): p for p in ranked})
        over.update({(c.program, str(c.layout)): peak for c, peak in out})

    # the published configuration is priced whatever its memory (capacity None); it ran,
    # so where the memory model puts it over the HBM, the candidates may use as much
    ranked, _, p, h, _ = plan.price([pub], tcfg, hw, n, None, executor=executor)
    programs, cached = programs + p, cached + h
    published = ranked[0]
    pub_over = published.peak_bytes is not None and capacity is not None \
        and published.peak_bytes > capacity
    if pub_over:
        capacity = published.peak_bytes
    seen[(pub.program, str(pub.layout))] = published
    priced(stage1)
    best = min(seen.values(), key=lambda q: q.step_s)
    for _ in range(rounds):
        priced(plan.neighbours(best.candidate, tcfg))
        nxt = min(seen.values(), key=lambda q: q.step_s)
        if nxt.step_s >= best.step_s:
            break
        best = nxt
    return dict(name=run.name, hardware=run.hardware, chips=n, published=published,
                published_over=pub_over, capacity=capacity, choice=best, programs=programs,
                cached=cached, over_programs=over_programs, tcfg=tcfg, hw=hw)


def describe(p) -> str:
    return p.candidate.describe()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="runs whose name contains this text")
    p.add_argument("--max-tp", type=int, default=8, help="largest tp axis searched")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of one-switch changes after the layout stage")
    p.add_argument("--workers", type=int, default=2, help="processes tracing programs")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    bad = [f"{k}={getattr(args, k)} must be >= {m}" for k, m in
           (("max_tp", 1), ("rounds", 0), ("workers", 1)) if getattr(args, k) < m]
    # the pipelined rows are left out: the restricted search places no pp axis
    runs = [r for r in RUNS if r.pp == 1
            and (args.only is None or args.only.lower() in r.name.lower())]
    if not runs:
        bad.append(f"no run matches {args.only!r}")
    if bad:
        print(f"error: {'; '.join(bad)}", file=sys.stderr)
        return 2
    from tabulate import tabulate

    from engine.planner import search as plan
    from engine.planner.report import why

    t0 = time.perf_counter()
    out = []
    with plan.Pool(args.workers) as executor:
        for r in runs:
            t = time.perf_counter()
            out.append(search(r, profile(r), executor, args.max_tp,
                              args.rounds))
            o = out[-1]
            print(f"  {r.name}: {o['programs']} programs priced ({o['cached']} from the "
                  f"cache), {o['over_programs']} over memory in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    rows = [[o["name"], describe(o["published"]) + (" (over HBM)" if o["published_over"] else ""),
             f"{100 * o['published'].mfu:.1f}", describe(o["choice"]),
             f"{100 * o['choice'].mfu:.1f}",
             f"{o['published'].step_s / o['choice'].step_s:.3f}",
             changes(o["published"].candidate, o["choice"].candidate)] for o in out]
    print(tabulate(rows, ["run", "published", "pred MFU %", "planner's choice", "pred MFU %",
                          "speed-up", "changed"], disable_numparse=True))
    for o in out:
        if o["choice"].candidate != o["published"].candidate:
            print(f"{o['name']}: " + why(o["choice"], o["published"], o["tcfg"], o["hw"])
                  .replace("#1 ", "the choice ").replace("#2 ", "the published "))
    slower = [o["name"] for o in out if o["choice"].step_s > o["published"].step_s]
    print(f"{len(out)} runs in {time.perf_counter() - t0:.0f} s: "
          f"{sum(o['programs'] for o in out)} programs priced "
          f"({sum(o['cached'] for o in out)} from the ledger cache), "
          f"{sum(o['over_programs'] for o in out)} over memory (not traced); the choice is "
          f"predicted "
          f"at least as fast as the published layout in {len(out) - len(slower)}"
          + (f" (not in: {', '.join(slower)})" if slower else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(
            name=o["name"], hardware=o["hardware"], chips=o["chips"],
            published=o["published"].record(), published_over_hbm=o["published_over"],
            choice=o["choice"].record(), changed=changes(o["published"].candidate,
                                                         o["choice"].candidate),
            programs=o["programs"], programs_cached=o["cached"],
            programs_over_memory=o["over_programs"]) for o in out], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
