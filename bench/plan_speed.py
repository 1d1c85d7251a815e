"""Where a first (uncached) plan spends its time: CPU seconds per program of each phase;
with --plan, the whole plan's wall clock from an empty ledger cache.

    python bench/plan_speed.py --devices 8 --model small [--sample 30]
    python bench/plan_speed.py --devices 8 --model small --plan --compare
    python bench/plan_speed.py --devices 256 --hardware h100 --model llama3-70b \
        --seq 8192 --batch 512 --bounds 27.5
    python bench/plan_speed.py --devices 64 --hardware h100 --model small --batch 64 \
        --axes fsdp,cp --remat full --derive --sample 8

With --plan it runs `engine.planner.search.plan` with an empty ledger cache (a fresh
directory) and prints the candidates ranked, the wall clock, the candidates per second
and how many ledgers were traced and how many derived from their structure's shapes
(engine/planner/ledgers.py), best-first by bound for the top --top (10; engine/planner/best.py);
--compare plans again, cold, pricing every program, and says whether the top --top
(layout, switches, predicted step) are identical. --axes and --max
restrict the space as `python -m engine.plan`'s do.

Enumerates the plan's candidates (engine/planner/search.py) and, in this one process without
the ledger cache, runs every `len(programs) / --sample`-th program through the phases a
worker runs: the memory model (engine/cost/fit.py), the trace on an AbstractMesh
(engine/cost/ledger.py `trace_step`), the walk into ledger rows (`ledger`) and the
pricing of each class of axis orders as a plan's worker prices them
(engine/planner/worker.py `priced`; a pp step along its schedule, engine/cost/pipeline.py),
over memory or not; `--kind pp` or `flat` samples only the programs with or without a
pp axis. Prints CPU seconds (process time, so
other jobs on shared cores inflate it less than wall clock) per program for each, the
imports a fresh worker needs (once per worker), and what the sampled mean gives for all programs on `--workers` cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (
    build_parser as train_parser,  # noqa: E402
    parse_or_exit,  # noqa: E402
)
from engine.parallel.layout import AXIS_ROLES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("plan speed")
    g.add_argument("--devices", type=int, default=8, help="devices to lay out")
    g.add_argument("--hardware", default="cpu", help="profile to price with")
    g.add_argument("--sample", type=int, default=30, help="programs to run")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="cores the estimate of the whole plan divides by; --plan's workers")
    g.add_argument("--plan", action="store_true",
                   help="time the whole plan from an empty ledger cache")
    g.add_argument("--compare", action="store_true",
                   help="with --plan: plan again tracing every program; compare the top --top")
    g.add_argument("--top", type=int, default=10,
                   help="with --plan: the ranking's length that must be exact (the plan's --top)")
    g.add_argument("--derive", action="store_true",
                   help="CPU seconds of a derived ledger against a traced one, over the "
                        "derivable programs of up to --sample structures")
    g.add_argument("--bounds", type=float, default=None, metavar="STEP_S",
                   help="the CPU seconds of every program's lower bound "
                        "(engine/planner/bound.py), and how many programs and candidates "
                        "have a bound below STEP_S (those a best-first plan must price "
                        "when its 10th best step is STEP_S)")
    g.add_argument("--kind", choices=("all", "pp", "flat"), default="all",
                   help="sample the programs with a pp axis, those without, or all")
    g.add_argument("--axes", default=",".join(AXIS_ROLES), help="as engine.plan's")
    g.add_argument("--max", default="", help="as engine.plan's")
    p = train_parser(prog="python bench/plan_speed.py", description=__doc__.split("\n\n")[0],
                     parents=[own], groups=("model", "batch", "training"))
    p.set_defaults(remat=None)
    return p


def main(argv=None) -> int:
    cfg, tcfg, _, _, mine = parse_or_exit(argv, build_parser())
    bad = [f"{k}={getattr(mine, k)} must be >= 1" for k in ("devices", "sample", "workers", "top")
           if getattr(mine, k) < 1]
    if bad:
        print(f"error: {'; '.join(bad)}", file=sys.stderr)
        return 2
    if mine.plan:
        return whole_plan(cfg, tcfg, mine)
    if mine.derive:
        return derive_cost(cfg, tcfg, mine)
    if mine.bounds is not None:
        return bound_spread(cfg, tcfg, mine)
    os.environ["SHARDWISE_LEDGER_CACHE"] = "off"
    import subprocess

    from engine.cost import fit, hardware
    from engine.cost.ledger import ledger, trace_step
    from engine.planner import ledgers, search as plan, worker

    # what a fresh worker imports before its first job
    imports = float(subprocess.run(
        [sys.executable, "-c", "import time; t = time.process_time(); import "
         + ", ".join(worker.WORKER_MODULES) + "; print(time.process_time() - t)"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}).stdout)

    hw = hardware.get(mine.hardware)
    from engine.cli.plan import search_space

    names, limits, _ = search_space(mine)
    names, _ = plan.considered(cfg, names)
    t = time.process_time()
    ok, _ = plan.candidates(cfg, tcfg, mine.devices,
                            {"remat": mine.remat} if mine.remat else {}, names, limits)
    enumerate_s = time.process_time() - t
    groups: dict[tuple, list] = {}
    for c in ok:
        groups.setdefault(c.program, []).append(c)
    structures = {ledgers.structure(cands[0]) for cands in groups.values()}
    kinds = [g for g in groups.values() if mine.kind == "all"
             or (g[0].layout.degree("pp") > 1) == (mine.kind == "pp")]
    capacity = fit.capacity(hw, mine.devices)
    every = max(1, len(kinds) // mine.sample)
    picked = kinds[::every][:mine.sample]
    phases = dict(memory=0.0, trace=0.0, ledger=0.0, price=0.0)
    for cands in picked:
        # as a plan's worker: memory, then each order class priced (engine/planner/worker.py)
        t = [time.process_time()]
        cands, peaks, mem_of, _ = worker.fitting(cands, tcfg, hw, capacity, True)
        c = cands[0]
        t.append(time.process_time())
        jaxpr = trace_step(c.cfg, tcfg, c.layout, c.parallel, hw.bf16_collectives_in_f32)
        t.append(time.process_time())
        rows = ledger(jaxpr, c.layout)
        t.append(time.process_time())
        worker.priced(rows, cands, peaks, mem_of, hw, None)
        t.append(time.process_time())
        for name, a, b in zip(phases, t, t[1:]):
            phases[name] += b - a
    n = len(picked)
    per = {k: v / n for k, v in phases.items()}
    total = sum(per.values())
    print(f"{len(ok)} candidates (enumerated and validated in {enumerate_s:.1f} CPU-s), "
          f"{len(groups)} programs of {len(structures)} structures; {n} sampled (every "
          f"{every}th); load average {os.getloadavg()[0]:.1f}")
    print(f"imports of a fresh worker {imports:.2f} CPU-s; per program: "
          + ", ".join(f"{k} {v:.3f}" for k, v in per.items())
          + f" = {total:.3f} CPU-s ({100 * per['trace'] / total:.0f}% tracing)")
    print(f"all {len(groups)} programs: {total * len(groups):.0f} CPU-s, "
          f"{total * len(groups) / mine.workers:.0f} s on {mine.workers} free core(s)")
    return 0


def _cold_plan(cfg, tcfg, mine, exhaustive: bool):
    """(Plan, wall seconds, CPU seconds of this process and its workers) of a plan from
    an empty ledger cache: best-first by bound for the top `--top` (engine/planner/best.py),
    or with `exhaustive` every program priced."""
    import tempfile

    from engine.cli.plan import search_space
    from engine.cost import hardware
    from engine.planner import search

    names, limits, _ = search_space(mine)
    with tempfile.TemporaryDirectory() as where:
        os.environ["SHARDWISE_LEDGER_CACHE"] = where
        t, cpu = time.perf_counter(), _cpu()
        got = search.plan(cfg, tcfg, mine.devices, hardware.get(mine.hardware),
                          pinned={"remat": mine.remat} if mine.remat else {},
                          workers=mine.workers, names=names, limits=limits,
                          top=None if exhaustive else mine.top)
        return got, time.perf_counter() - t, _cpu() - cpu


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the plan's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def bound_spread(cfg, tcfg, mine) -> int:
    """CPU seconds to enumerate, group by program and bound every program; the programs
    and candidates whose bound is below `--bounds`."""
    from engine.cli.plan import search_space
    from engine.cost import hardware
    from engine.planner import bound, search

    names, limits, _ = search_space(mine)
    hw = hardware.get(mine.hardware)
    t = time.process_time()
    ok, _ = search.candidates(cfg, tcfg, mine.devices,
                              {"remat": mine.remat} if mine.remat else {},
                              search.considered(cfg, names)[0], limits)
    groups: dict = {}
    for c in ok:
        groups.setdefault(c.program, []).append(c)
    mid = time.process_time()
    bounds = [(bound.lower_bound(g[0], tcfg, hw), len(g)) for g in groups.values()]
    end = time.process_time()
    below = [(b, k) for b, k in bounds if b < mine.bounds]
    print(f"{len(ok)} candidates, {len(groups)} programs: enumerated and grouped in "
          f"{mid - t:.1f} CPU-s, bounded in {end - mid:.1f} CPU-s "
          f"({1e3 * (end - mid) / max(len(groups), 1):.2f} ms a program); bounds "
          f"{min(b for b, _ in bounds):.4g} to {max(b for b, _ in bounds):.4g} s; below "
          f"{mine.bounds:.4g} s: {len(below)} programs, {sum(k for _, k in below)} "
          f"candidates")
    # the memory model on every len/--sample-th of those: how many a plan would trace
    from engine.cost import fit

    under = [g for g, (b, _) in zip(groups.values(), bounds) if b < mine.bounds]
    step = max(1, len(under) // mine.sample)
    picked = under[::step]
    capacity = fit.capacity(hw, mine.devices)
    t = time.process_time()
    fits = sum(1 for g in picked
               if (m := fit.predicted(g[0].cfg, tcfg, g[0].parallel, g[0].layout, hw))
               is None or capacity is None or m.peak <= capacity)
    spent = time.process_time() - t
    print(f"memory model on {len(picked)} of them (every {step}th, {spent / len(picked):.3f} "
          f"CPU-s each): {fits} fit (without more microbatches), so about "
          f"{round(fits / len(picked) * len(under))} programs below the bound fit")
    return 0


def derive_cost(cfg, tcfg, mine) -> int:
    """Per program of the plan's derivable structures: the derived ledger's CPU time
    and the trace and walk's, the two ledgers compared row by row."""
    from engine.cli.plan import search_space
    from engine.cost import derive
    from engine.cost.ledger import ledger, trace_step
    from engine.planner import ledgers, search

    names, limits, _ = search_space(mine)
    ok, _ = search.candidates(cfg, tcfg, mine.devices,
                              {"remat": mine.remat} if mine.remat else {},
                              search.considered(cfg, names)[0], limits)
    by: dict = {}
    for c in ok:
        roles = ledgers.structure(c)[0]
        by.setdefault(ledgers.structure(c), {}).setdefault(ledgers.sizes(c, roles), c)
    cost, n, refused = {"derived": 0.0, "traced": 0.0}, 0, 0
    big = [(k, v) for k, v in by.items() if len(k[0]) >= 2 and len(v) >= len(k[0]) + 2]
    for (roles, _, par, model), progs in big[:mine.sample]:
        sizes = sorted(progs, key=lambda s: -min(s))
        picked = [sizes[i] for i in derive.independent(sizes, len(roles)) or []]
        try:
            st = derive.Structure(roles, [(s, trace_step(model, tcfg, progs[s].layout, par))
                                          for s in picked])
        except derive.NotDerivable:
            refused += 1
            continue
        for s in (s for s in sizes if s not in picked and st.derivable(s)):
            lay = progs[s].layout
            t = time.process_time()
            got = st.ledger(lay)
            mid = time.process_time()
            want = ledger(trace_step(model, tcfg, lay, par), lay)
            cost["derived"] += mid - t
            cost["traced"] += time.process_time() - mid
            n += 1
            assert not derive.differences(got, want), progs[s].describe()
    print(f"{n} programs of {min(len(big), mine.sample)} structures ({refused} not "
          f"derivable): derived {cost['derived'] / max(n, 1):.3f} CPU-s each, traced and "
          f"walked {cost['traced'] / max(n, 1):.3f} CPU-s each; every ledger equal")
    return 0


def whole_plan(cfg, tcfg, mine) -> int:
    from engine.planner.search import ordinal

    top = {}
    for exhaustive in (False, True) if mine.compare else (False,):
        got, wall, cpu = _cold_plan(cfg, tcfg, mine, exhaustive)
        traced = got.programs - got.cached - got.derived
        how = "every program priced" if exhaustive else f"best-first by bound (top {mine.top})"
        ranked = len(got.ranked) + len(got.over) + got.pruned + len(got.refused)
        print(f"{how}: {len(got.ranked)} candidates ranked in {wall:.1f} s, {cpu:.1f} "
              f"CPU-s ({len(got.ranked) / wall:.1f} a second); {got.programs} programs: "
              f"{traced} traced, {got.derived} derived; of {ranked} candidates "
              f"{len(got.refused)} refused, {len(got.over)} over memory, {got.pruned} "
              f"pruned by bound (cannot beat the {ordinal(mine.top)}), {got.deferred} programs "
              f"put back by their bound as they run; load average {os.getloadavg()[0]:.1f}")
        if len(got.ranked) >= mine.top:
            print(f"  1st {got.ranked[0].step_s:.4g} s, {ordinal(mine.top)} "
                  f"{got.ranked[mine.top - 1].step_s:.4g} s: "
                  f"{got.ranked[0].candidate.describe()}")
        top[exhaustive] = [(p.candidate.describe(), p.step_s) for p in got.ranked[:mine.top]]
    if mine.compare:
        print(f"top {mine.top} identical to the exhaustive ranking: {top[False] == top[True]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
