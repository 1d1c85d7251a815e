"""Check the planner by measurement: its top candidates and random ones, timed on the
8 forced host-CPU devices, predicted vs measured rank.

    python bench/plan_check.py --model small [--top 8] [--random 8] [--json out.json]

Plans for the devices on the cpu profile (engine/planner/search.py; `--calibration`, else the
calibration file if bench/calibrate.py wrote one, else the built-in defaults; the
candidates within `--refine` of the first priced again with their matmuls timed on the
devices, `plan.refine`), then compiles every chosen candidate (the planner's first
`--top` plus `--random` drawn, seeded, from the rest of the ranked list, priced with
their matmuls timed too), runs each one warm-up step, and times
`--rounds` round-robin passes over them, each pass timing `--timed-steps` steps of one
candidate before moving to the next (the default, one, interleaves single steps, so a
slow spell on the shared cores falls on every candidate alike). A candidate's measured
step is its fastest timed step: 8 device threads on 2 cores only ever lose time to
scheduling and other jobs, which spread one program's steps over a fifth to a third of
its time on `small`. Prints each one's predicted and measured step (and the median step) and rank,
the Spearman rank correlation of predicted vs measured (and over the candidates without
pp, which are the close calls), and where the planner's first choice lands:
`auto_vs_best` = measured step of the first choice / the best measured step (and the
same ratio of medians), and `auto_vs_best_paired`: the first choice's step over each
other candidate's in the same round, the median over the rounds, against the candidate
that comes out furthest ahead (`bench.timing.paired_ratio`: a slow spell of the shared
cores that lasts a round falls on both steps of each ratio; below 1, the first choice
beat every candidate round by round). On a shared machine the measured steps are noisy;
compare runs, not single figures. Two measures of that noise close the report (and the
JSON): `noise`, how far two halves of one candidate's steps disagree
(`bench.timing.split_half_noise`), and `same_program_gap`, how far apart one program
measured in two axis orders (fsdp4xtp2 and tp2xfsdp4 are one traced step: their gap is
the host's), over the fastest steps and round by round (`_paired`).

The best of many noisy candidates is picked partly for a lucky step, so the ratios above
lean against the first choice. A head-to-head run then settles it (`--confirm` rounds,
0 to skip): the first choice and its closest rival (the measured best, or the runner-up
when the first choice measured best; not the first choice's own program in another axis
order) timed alone, alternating, after the main run, with
the same compiled steps. `auto_vs_best_confirmed` is the first choice's fastest step
over the rival's in that run, `auto_vs_best_confirmed_paired` the median of the rounds'
ratios; below 1, the first choice held its place.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import (  # noqa: E402
    build_parser as train_parser,  # noqa: E402
    force_host_devices,
    keep_freed_memory,
    parse_or_exit,
)
from engine.planner.search import REFINE_WITHIN  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("plan check")
    g.add_argument("--devices", type=int, default=8, help="forced host-CPU devices")
    g.add_argument("--top", type=int, default=8, help="the planner's first N candidates")
    g.add_argument("--random", type=int, default=8, help="random candidates from the rest")
    g.add_argument("--sample-seed", type=int, default=0, help="seed of the random draw")
    g.add_argument("--timed-steps", type=int, default=1,
                   help="steps of one candidate timed back to back in each round")
    g.add_argument("--rounds", type=int, default=9,
                   help="round-robin passes over the candidates; each one's fastest timed "
                        "step is kept (other jobs on shared cores only slow a step)")
    g.add_argument("--confirm", type=int, default=8, metavar="R",
                   help="rounds of the head-to-head run of the first choice against its "
                        "closest rival after the main run (0 = none)")
    g.add_argument("--calibration", default=None,
                   help="cpu profile JSON (bench/calibrate.py --out); default: the one "
                        "bench/calibrate.py writes, else the built-in defaults")
    g.add_argument("--refine", type=float, default=REFINE_WITHIN, metavar="F",
                   help="the planner prices again the candidates predicted within F of the "
                        "first with their matmuls timed on the devices (engine/planner/search.py "
                        "refine), and the random ones measured too; 0 = one matmul rate")
    g.add_argument("--json", default=None, help="write figures as JSON")
    p = train_parser(prog="python bench/plan_check.py", description=__doc__.split("\n\n")[0],
                     parents=[own], groups=("model", "batch", "training"))
    p.set_defaults(remat=None)  # remat: the plan's unless --remat pins it
    return p


def ranks(values) -> "np.ndarray":
    """Ranks from 1, ties sharing their mean rank."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    out[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):
        tied = values == v
        out[tied] = out[tied].mean()
    return out


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's correlation of the (tie-averaged) ranks."""
    import numpy as np

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom else float("nan")


def compiled(cand, tcfg):
    """(compiled step, params, opt_state, tokens) of one candidate on the host devices."""
    from bench.timing import compiled_step
    from engine.run.step import Trainer

    trainer = Trainer(cand.cfg, tcfg, cand.layout, cand.layout.mesh(), cand.parallel)
    step, params, opt_state, tokens, _ = compiled_step(trainer)
    return step, params, opt_state, tokens


def same_program_gaps(cands, times) -> tuple[float, float] | None:
    """How far apart one program measured in two axis orders (`Candidate.program`
    equal: the same traced step, on devices that share the host's cores, so their gap is
    the host's noise): the largest, over such pairs among `cands`, of the slower fastest
    step over the faster, and of the round-by-round ratio (`paired_ratio`, the larger of
    a/b and b/a), each less 1. None without such a pair."""
    from bench.timing import paired_ratio

    pairs = [(times[i], times[j]) for i, j in itertools.combinations(range(len(cands)), 2)
             if cands[i].candidate.program == cands[j].candidate.program]
    if not pairs:
        return None
    spread = lambda r: max(r, 1 / r) - 1  # noqa: E731
    return (max(spread(min(a) / min(b)) for a, b in pairs),
            max(spread(paired_ratio(a, b)) for a, b in pairs))


def measure(cands, tcfg, steps: int, rounds: int, say=print) -> tuple[list, list]:
    """(every candidate's timed step seconds, `rounds` x `steps` of them; the compiled
    steps with their state, for `round_robin`): each compiled and run one untimed
    warm-up step, then `rounds` round-robin passes that time `steps` steps of one
    candidate back to back before the next (bench/timing.round_robin)."""
    from bench.timing import round_robin, timed_step

    held = []
    for i, p in enumerate(cands):
        step, params, opt_state, tokens = compiled(p.candidate, tcfg)
        params, opt_state, _, seconds = timed_step(step, params, opt_state, tokens)
        held.append([step, params, opt_state, tokens])
        say(f"  {i + 1}/{len(cands)} {p.candidate.describe()}: predicted {p.step_s:.4g} s, "
            f"warm-up step {seconds:.4g} s", flush=True)
    return round_robin(held, rounds, steps, say=lambda line: say(line, flush=True)), held


def rival(times, programs=None) -> int | None:
    """The index of the first choice's (index 0) closest rival: the candidate other than
    it with the fastest step, leaving out those of the same program (`programs[j]`, e.g.
    fsdp4xtp2 and tp2xfsdp4: the same traced step, whose gap is the host's noise). None
    when every other candidate is the first choice's program."""
    others = [j for j in range(1, len(times)) if programs is None or programs[j] != programs[0]]
    return min(others, key=lambda j: min(times[j]), default=None)


def head_to_head(held, j: int, rounds: int, steps: int, say=print) -> dict:
    """The first choice (held[0]) and candidate j timed alone, alternating, `rounds`
    passes of `steps` steps each: their step seconds, the fastest-step ratio, the median
    of the rounds' ratios and the split-half noise of the two."""
    from bench.timing import paired_ratio, round_robin, split_half_noise

    a, b = round_robin([held[0], held[j]], rounds, steps,
                       say=lambda line: say(line, flush=True))
    return {"against": j, "rounds": rounds, "first_s": a, "rival_s": b,
            "fastest_ratio": min(a) / min(b), "paired_ratio": paired_ratio(a, b),
            "noise": split_half_noise([a, b])}


def host_profile(n: int, calibration: str | None) -> tuple:
    """(the first n host-CPU devices, the cpu profile from `calibration`, else
    bench/calibrate.py's file, else the built-in defaults), with n host devices forced
    and freed memory kept; (None, a one-line reason) when fewer devices are available or
    the calibration file is bad."""
    force_host_devices(n)
    keep_freed_memory()
    import jax

    from engine.cost.calibration import ProfileError
    from engine.planner.auto import hardware_profile

    if len(jax.devices()) < n:
        return None, (f"{n} devices wanted, {len(jax.devices())} available (XLA_FLAGS sets "
                      f"another count)")
    try:
        return jax.devices()[:n], hardware_profile("cpu", calibration)
    except ProfileError as e:
        return None, str(e)


def main(argv=None) -> int:
    cfg, tcfg, _, _, mine = parse_or_exit(argv, build_parser())
    minimum = {"devices": 1, "top": 1, "random": 0, "timed_steps": 1, "rounds": 1,
               "refine": 0, "confirm": 0}
    problems = [f"{k}={getattr(mine, k)} must be >= {m}" for k, m in minimum.items()
                if getattr(mine, k) < m]
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    devices, hw = host_profile(mine.devices, mine.calibration)
    if devices is None:
        print(f"error: {hw}", file=sys.stderr)
        return 2
    from tabulate import tabulate

    from bench.timing import paired_ratio, split_half_noise
    from engine.planner import search as plan
    from engine.planner.auto import no_plan_message

    pinned = {"remat": mine.remat} if mine.remat else {}
    # every program priced (top None): the candidates measured beside the first are
    # drawn from the whole ranking, not from the top a best-first plan stops at
    result = plan.plan(cfg, tcfg, mine.devices, hw, pinned=pinned, workers=2,
                       devices=devices, within=mine.refine, top=None)
    if not result.ranked:
        print(f"error: {no_plan_message(result, mine.devices)}", file=sys.stderr)
        return 2
    chosen = result.ranked[:mine.top]
    rest = result.ranked[mine.top:]
    chosen += random.Random(mine.sample_seed).sample(rest, min(mine.random, len(rest)))
    if result.refined:  # every candidate measured is priced alike: its matmuls timed
        again = [i for i, p in enumerate(chosen) if not p.dots_timed]
        repriced, _ = plan.timed_prices([chosen[i] for i in again], tcfg, result.hw,
                                        mine.devices, devices)
        for i, p in zip(again, repriced):
            chosen[i] = p
    print(f"plan: {len(result.ranked)} candidates in {result.seconds:.1f} s on {hw.name} "
          f"({hw.source}; the first {result.refined} priced again with their matmuls timed "
          f"here); measuring {len(chosen)} on {mine.devices} host devices, "
          f"{mine.rounds} round(s) of {mine.timed_steps} step(s) each")
    load = [os.getloadavg()[0]]
    times, held = measure(chosen, tcfg, mine.timed_steps, mine.rounds)
    load.append(os.getloadavg()[0])
    measured = [min(t) for t in times]
    medians = [statistics.median(t) for t in times]
    predicted = [p.step_s for p in chosen]
    pr, mr = ranks(predicted), ranks(measured)
    rows = [[i + 1 if i < mine.top else "random", p.candidate.describe(),
             f"{p.step_s:.4g}", f"{m:.4g}", f"{med:.4g}", f"{100 * (p.step_s - m) / m:+.1f}%",
             f"{a:g}", f"{b:g}"]
            for i, (p, m, med, a, b) in enumerate(zip(chosen, measured, medians, pr, mr))]
    print(tabulate(rows, ["plan #", "candidate", "predicted s", "measured s (fastest)",
                          "median s", "error", "predicted rank", "measured rank"],
                   disable_numparse=True))
    rho = spearman(predicted, measured)
    # pipelined candidates are far slower than the rest here and easy to rank: the
    # correlation among the others says how well the planner orders its close calls
    flat = [(p.step_s, m) for p, m in zip(chosen, measured) if p.candidate.layout.degree("pp") == 1]
    rho_flat = spearman(*zip(*flat)) if len(flat) > 2 else None
    auto_vs_best = measured[0] / min(measured)
    median_vs_best = medians[0] / min(medians)
    # round by round: the first choice against the candidate it trails most
    paired, ahead = max(((paired_ratio(times[0], t), j) for j, t in enumerate(times) if j),
                        default=(1.0, 0))
    n = mine.rounds * mine.timed_steps
    print(f"Spearman {rho:.3f} over {len(chosen)} candidates"
          + (f" ({rho_flat:.3f} over the {len(flat)} without pp)" if rho_flat is not None
             and len(flat) < len(chosen) else "")
          + f"; the first choice measured "
          f"{measured[0]:.4g} s, rank {mr[0]:g} of {len(chosen)}: auto_vs_best "
          f"{auto_vs_best:.3f} over the fastest of {n} steps, {median_vs_best:.3f} over "
          f"their medians, {paired:.3f} round by round against "
          f"{chosen[ahead].candidate.describe()} (median of the rounds' ratios; load "
          f"average {load[0]:.1f} before, {load[1]:.1f} after measuring: timings on "
          f"shared cores are noisy)")
    noise = split_half_noise(times)
    gaps = same_program_gaps(chosen, times)
    print(f"noise: two halves of one candidate's steps disagree by up to {100 * noise:.1f}%"
          + ("" if gaps is None else f"; one program in two axis orders measured up to "
             f"{100 * gaps[0]:.1f}% apart (fastest steps), {100 * gaps[1]:.1f}% round by "
             f"round"))
    confirmed = None
    j = rival(times, [p.candidate.program for p in chosen]) if mine.confirm else None
    if j is not None:
        print(f"head to head: the first choice against {chosen[j].candidate.describe()}, "
              f"{mine.confirm} round(s)")
        confirmed = head_to_head(held, j, mine.confirm, mine.timed_steps)
        load.append(os.getloadavg()[0])
        print(f"head to head: the first choice {min(confirmed['first_s']):.4g} s, its rival "
              f"{min(confirmed['rival_s']):.4g} s (fastest steps): auto_vs_best_confirmed "
              f"{confirmed['fastest_ratio']:.3f}, {confirmed['paired_ratio']:.3f} round by "
              f"round; halves disagree by up to {100 * confirmed['noise']:.1f}% (load average "
              f"{load[-1]:.1f} after)")
    if mine.json:
        Path(mine.json).write_text(json.dumps({
            "spearman": rho, "spearman_without_pp": rho_flat, "auto_vs_best": auto_vs_best,
            "auto_vs_best_median": median_vs_best, "auto_vs_best_paired": paired,
            "paired_against": chosen[ahead].candidate.describe(), "hardware_source": hw.source,
            "timed_steps": mine.timed_steps, "rounds": mine.rounds, "load_average": load,
            "noise": noise, "same_program_gap": None if gaps is None else gaps[0],
            "same_program_gap_paired": None if gaps is None else gaps[1],
            "auto_vs_best_confirmed": confirmed and confirmed["fastest_ratio"],
            "auto_vs_best_confirmed_paired": confirmed and confirmed["paired_ratio"],
            "confirmed_against": confirmed and chosen[confirmed["against"]].candidate.describe(),
            "head_to_head": confirmed,
            "candidates": [dict(p.record(), measured_step_s=m, median_step_s=med,
                                step_times_s=t, predicted_rank=float(a),
                                measured_rank=float(b))
                           for p, m, med, t, a, b in zip(chosen, measured, medians, times,
                                                          pr, mr)]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
