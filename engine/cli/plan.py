"""`python -m engine.plan`: the planner's command line (the planning is engine/planner/search.py).

Parses the model and training flags of `python -m engine.train` and the plan's own
(`--devices`, `--hardware`, `--hbm-gib`, `--top`, `--json`, `--workers`, `--refine`,
`--grad-reduce`, `--axes`, `--max`), runs `plan.plan`, prints the ranked table and why
the first beats the runner-up, and writes `--json`. A bad flag is one line on stderr,
exit code 2.
"""
from __future__ import annotations

import json
import os
import sys

from engine.config import GRAD_REDUCES, ConfigError, ParallelConfig
from engine.parallel.layout import AXIS_ROLES
from engine.planner.auto import gib, hardware_profile, no_plan_message
from engine.planner.search import REFINE_WITHIN, plan, progress_line


def build_parser():
    import argparse

    from engine.cli.args import build_parser as train_parser
    from engine.cost.hardware import PROFILES

    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("plan")
    g.add_argument("--devices", type=int, required=True, help="devices to lay out")
    g.add_argument("--hardware", default="cpu", choices=("cpu", *PROFILES),
                   help="profile to price with; cpu = the calibrated profile")
    g.add_argument("--calibration", default=None, help="cpu profile JSON (bench/calibrate.py)")
    g.add_argument("--hbm-gib", type=float, default=None,
                   help="memory per device, GiB (default: the profile's HBM; on the cpu "
                        "the host's available RAM over the devices)")
    g.add_argument("--top", type=int, default=10, help="candidates to print")
    g.add_argument("--json", default=None, help="write the ranked candidates as JSON")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes tracing programs")
    g.add_argument("--refine", type=float, default=REFINE_WITHIN, metavar="F",
                   help="on the cpu, price again the candidates predicted within F of the "
                        "first (0.15 = 15%%) with their matmuls timed on this host's "
                        "devices; 0 = one matmul rate for every candidate")
    g.add_argument("--grad-reduce", default="compute", choices=GRAD_REDUCES,
                   help="the dtype every candidate's fsdp grad reduce-scatters run in "
                        "(python -m engine.train --help)")
    g.add_argument("--axes", default=",".join(AXIS_ROLES),
                   help="the roles a layout may use, comma-separated (default: every role)")
    g.add_argument("--max", default="", metavar="ROLE=SIZE,...",
                   help="the largest size of a role's axis, e.g. tp=8 to keep tensor "
                        "parallelism within an 8-GPU node (default: no limit)")
    from engine.planner import search

    p = train_parser(prog="python -m engine.plan",
                     description=search.__doc__.split("\n\n")[0],
                     parents=[own], groups=("model", "batch"),
                     layout=False)
    # --remat pins remat; without it the plan chooses it
    p.set_defaults(remat=None)
    return p


def search_space(mine) -> tuple[tuple[str, ...], dict, list[str]]:
    """(--axes as roles, --max as {role: largest size}, problems with either)."""
    names = tuple(r.strip() for r in mine.axes.split(",") if r.strip())
    problems = [f"--axes: unknown role {r!r} (known: {', '.join(AXIS_ROLES)})"
                for r in names if r not in AXIS_ROLES]
    if not names:
        problems.append(f"--axes names no role (known: {', '.join(AXIS_ROLES)})")
    limits = {}
    for item in filter(None, (x.strip() for x in mine.max.split(","))):
        role, _, size = (x.strip() for x in item.partition("="))
        if role not in AXIS_ROLES or not size.isdigit() or int(size) < 1:
            problems.append(f"--max {item!r}: want ROLE=SIZE with a role of "
                            f"{', '.join(AXIS_ROLES)} and a size >= 1")
        else:
            limits[role] = int(size)
    return tuple(r for r in AXIS_ROLES if r in names), limits, problems


def flag_problems(mine) -> list[str]:
    problems = [f"{name}={getattr(mine, name)} must be >= 1"
                for name in ("devices", "top", "workers") if getattr(mine, name) < 1]
    if mine.devices > 2**16:
        problems.append(f"devices={mine.devices} is absurd (limit 65,536)")
    if mine.hbm_gib is not None and not mine.hbm_gib > 0:
        problems.append(f"hbm_gib={mine.hbm_gib} must be > 0")
    if not mine.refine >= 0:
        problems.append(f"refine={mine.refine} must be >= 0")
    if mine.calibration is not None and mine.hardware != "cpu":
        problems.append(f"--calibration is the cpu profile; --hardware {mine.hardware} "
                        f"does not use it")
    return problems


def host_devices(mine, say) -> list | None:
    """The host's devices to time matmuls on (`refine`) when planning for the cpu: the
    `--devices` count forced on XLA's CPU backend, or None (with a line saying why) when
    jax already runs with fewer."""
    if mine.hardware != "cpu" or mine.refine == 0:
        return None
    from engine.cli.args import force_host_devices

    force_host_devices(mine.devices)
    import jax

    devices = jax.devices("cpu")
    if len(devices) < mine.devices:
        say(f"planning: {len(devices)} host devices (XLA_FLAGS sets the count), not "
            f"{mine.devices}: every matmul priced at the profile's one rate")
        return None
    return devices


def searched(result) -> str:
    """What the plan searched and what it dropped before pricing, with why: the roles
    laid out (pp with its schedules), those left out, the commonest refusals."""
    from engine.parallel.pipeline import SCHEDULES
    from engine.planner.space import reasons

    axes = ", ".join(f"{r} (schedules {', '.join(SCHEDULES)}; 4·pp microbatches; "
                     f"interleaved over 2 virtual stages)" if r == "pp" else r
                     for r in result.axes)
    left = "".join(f"; {r} left out: {w}" for r, w in result.left_out.items())
    why = "; ".join(f"{k} {r}" for k, r in reasons(result.refused))
    return (f"axes considered: {axes}{left}\npruned before pricing: {len(result.refused)} "
            f"refused by engine.parallel.validate" + (f" (most: {why})" if why else "")
            + f", {len(result.over)} over memory (the memory model, before any ledger), "
            f"{result.pruned} pruned by bound (cannot beat #{result.top}: "
            f"engine/planner/bound.py)")


def main(argv=None) -> int:
    from engine.cli.args import UsageError, check_apart, check_output_file, parse_or_exit

    cfg, tcfg, _, _, mine = parse_or_exit(argv, build_parser())
    names, limits, space_problems = search_space(mine)
    try:
        if problems := flag_problems(mine) + space_problems:
            raise UsageError("; ".join(problems))
        check_apart({"--calibration": mine.calibration}, {"--json": mine.json})
        if mine.json:
            check_output_file(mine.json, "--json")
        from engine.cost.calibration import ProfileError

        try:
            hw = hardware_profile(mine.hardware, mine.calibration)
        except ProfileError as e:
            raise UsageError(str(e)) from None
        pinned = {"remat": mine.remat} if mine.remat else {}
        say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        result = plan(cfg, tcfg, mine.devices, hw, mine.hbm_gib and mine.hbm_gib * 2**30,
                      pinned, mine.workers, names, limits, progress=progress_line(say),
                      devices=host_devices(mine, say), within=mine.refine, say=say,
                      base=ParallelConfig(grad_reduce=mine.grad_reduce), top=mine.top)
        if not result.ranked:
            raise ConfigError(no_plan_message(result, mine.devices))
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = len(result.ranked) + len(result.over)  # priced: the memory model's included
    space = "" if names == AXIS_ROLES and not limits else "; axes " + ", ".join(
        f"{r} <= {limits[r]}" if r in limits else r for r in names)
    grads = "" if mine.grad_reduce == "compute" else f"; grads reduced in {mine.grad_reduce}"
    print(f"hardware {hw.name} ({hw.source}); model {mine.model}, seq {tcfg.seq}, batch "
          f"{tcfg.batch}; {mine.devices} devices, {gib(result.capacity)} per device{space}"
          f"{grads}")
    traced = result.programs - result.cached - result.derived
    every = total + len(result.refused) + result.pruned
    print(f"ranked {len(result.ranked)} of {every} candidates ({result.programs} programs "
          f"priced: {traced} traced with {result.workers} worker(s), {result.derived} "
          f"derived from their structure's shapes, {result.cached} from the ledger cache) "
          f"in {result.seconds:.1f} s")
    print(searched(result))
    if result.refined:
        print(f"the first {result.refined} priced again with their matmuls timed on "
              f"{mine.devices} host devices (those predicted within {mine.refine:.0%} of the "
              f"first at the profile's one matmul rate)")
    from engine.planner.report import runner_up, table, why

    print(table(result.ranked, mine.top))
    if (k := runner_up(result.ranked)) is not None:
        print(why(result.ranked[0], result.ranked[k], tcfg, result.hw, (1, k + 1)))
    if mine.json:
        with open(mine.json, "w") as f:
            json.dump({"devices": mine.devices, "hardware": mine.hardware,
                       "hardware_source": hw.source, "capacity_bytes": result.capacity,
                       "priced": total, "programs": result.programs,
                       "programs_cached": result.cached,
                       "programs_derived": result.derived,
                       "refused": len(result.refused), "over_memory": len(result.over),
                       "pruned_by_bound": result.pruned,
                       "refined": result.refined, "grad_reduce": mine.grad_reduce,
                       "seconds": result.seconds, "axes": list(names), "max": limits,
                       "left_out": result.left_out,
                       "candidates": [p.record() for p in result.ranked]}, f, indent=1)
    return 0

