"""The planner: every layout of N devices with every switch, ranked by the cost model.

    python -m engine.plan --devices 8 --hardware cpu --model small --seq 256 --batch 16
    python -m engine.plan --devices 8 --hardware h100 --model llama3-8b --seq 8192 \\
        --batch 16 --remat full --top 5 --json plan.json
    python -m engine.plan --devices 64 --hardware h100 --model llama3-8b --seq 8192 \\
        --batch 64 --axes dp,fsdp,tp --max tp=8

Candidates (engine/planner/space.py) are every factorisation of N into the axes of the
role registry (layers/roles.py; axes of size 1 left out) in every order, times every
value of each switch in `SWITCHES` (each read from its own registry, offered only where
it changes the program: `--zero` and `--prefetch` with an fsdp axis, `--tp-comm` with tp, `--cp-comm`
with cp, `--pp-schedule` with pp, at 4·pp microbatches, and `--pp-virtual 2` with the
interleaved schedule). `engine.parallel.validate` drops what cannot run, the memory
model (engine/cost/fit.py) what does not fit the device; the rest are ranked by the
predicted step of `bench/roofline.py --predict-only` (the ledger of the traced step
priced by engine/cost/price.py, a pp step along its schedule by
engine/cost/pipeline.py).

Speed: a step's ledger depends on the axis sizes and the switches, not on the order of
the axes (the order only picks, in pricing, the link tier a collective runs over), so
each distinct program (`Candidate.program`) gets its ledger once, in a pool of worker
processes (engine/planner/worker.py), and is priced there for every order. Programs
that differ only in axis sizes (a structure) go to one worker in one job, which
derives what it can of their ledgers from a few traces (engine/planner/ledgers.py; a
worker keeps what it learnt of a structure for its later jobs) and traces the rest on
an AbstractMesh.
`price` takes any candidate list, so a restricted search (`layouts` over some roles,
`neighbours`) reuses it.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time

from engine.config import ParallelConfig, TrainConfig
from engine.parallel.layout import AXIS_ROLES
from engine.planner import worker
from engine.planner.space import (  # noqa: F401  (the candidate space, as the planner's)
    SHARED_TRACE,
    SWITCHES,
    Candidate,
    Program,
    Switch,
    accumulated,
    candidates,
    considered,
    degree,
    factorisations,
    layouts,
    neighbours,
    programs,
    switch_settings,
)
from layers.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Priced:
    """A candidate with its predicted step (seconds), MFU (a fraction) and peak bytes
    per device (None: the memory model does not cover it)."""

    candidate: Candidate
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    mfu: float
    peak_bytes: int | None
    dots_timed: bool = False  # its matmuls priced by their time on the host (`timed_prices`)
    # each device's temporaries mapped anew every step (engine/cost/fit.py `mapped_bytes`),
    # whose page faults its step_s includes
    mapped_bytes: int = 0

    def record(self) -> dict:
        return dict(layout=str(self.candidate.layout), flags=self.candidate.flags,
                    predicted_step_s=self.step_s, predicted_mfu=self.mfu,
                    predicted_peak_bytes=self.peak_bytes,
                    predicted_compute_s=self.compute_s, predicted_comm_s=self.comm_s,
                    predicted_exposed_comm_s=self.exposed_comm_s,
                    predicted_mapped_bytes=self.mapped_bytes, dots_timed=self.dots_timed)


@dataclasses.dataclass(frozen=True)
class Plan:
    """ranked: fitting candidates, fastest first; refused: [(candidate, reason)] by
    engine.parallel.validate; over: [(candidate, predicted peak bytes)] over `capacity`
    bytes per device, in the order the workers' results came in; programs: distinct
    programs priced; cached: how many of them came from the ledger cache; workers:
    processes that traced; seconds: wall clock of `plan`;
    hw: the profile the first candidates are priced with (with their timed matmuls,
    `Hardware.dot_seconds`, when `refine` ran); refined: candidates `refine` re-priced."""

    ranked: list
    refused: list
    over: list
    capacity: float | None
    programs: int
    cached: int
    workers: int
    seconds: float
    hw: object = None
    refined: int = 0
    derived: int = 0  # programs whose ledger was derived from shapes (engine/planner/ledgers.py)
    axes: tuple = ()  # the roles laid out
    left_out: dict = dataclasses.field(default_factory=dict)  # {role: why not laid out}
    pruned: int = 0  # candidates never priced: their bound cannot reach the top (best.py)
    top: int | None = None  # the ranking's length that is exact (None: every program priced)
    deferred: int = 0  # programs put back in the queue at their bound as they run (best.py)


def predict_candidate(cand: Candidate, tcfg: TrainConfig, hw, mapped_bytes: int = 0):
    """The cost model's Prediction for one candidate, as roofline's --predict-only, plus
    the page faults of `mapped_bytes` per device (`Priced.mapped_bytes`)."""
    from engine.cost import cache
    from engine.cost.pipeline import predict_step

    rows, _ = cache.step_ledger(cand.cfg, tcfg, cand.layout, cand.parallel,
                                hw.bf16_collectives_in_f32)
    return predict_step(rows, hw, cand.layout, cand.parallel, mapped_bytes)[0]


def progress_line(say, every_s: float = 15.0, clock=time.perf_counter):
    """A `progress` for `plan` that says how many programs are priced and, at the mean
    time per program so far, about how long the rest will take, at most once every
    `every_s` seconds and never for a plan that takes less. A best-first plan passes
    `front()`: (K, the K-th best step so far or None, the least bound left); it stops
    when the bound passes the step, so no time left is guessed."""
    start = last = clock()

    def report(done: int, total: int, front=None):
        nonlocal last
        now = clock()
        if now - last < every_s:
            return
        last = now
        if front is None:
            left = (now - start) / max(done, 1) * (total - done)
            say(f"planning: {done}/{total} programs priced ({now - start:.0f} s, about "
                f"{left:.0f} s left)")
            return
        k, kth, bound = front()
        best = (f"{ordinal(k)} best step {kth:.4g} s" if kth is not None
                else f"fewer than {k} priced")
        say(f"planning: {done} of {total} programs checked ({now - start:.0f} s); {best}, "
            f"least bound left {bound:.4g} s (done when it passes the step)")
    return report


def ordinal(k: int) -> str:
    """1st, 2nd, 3rd, 10th, 21st, ..."""
    tail = {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th") if k % 100 not in (11, 12, 13) else "th"
    return f"{k}{tail}"


def by_program(cands: list) -> dict:
    """{`Candidate.program`: its candidates, in their order}, the programs in order of
    first appearance. The key is read once per distinct (parallel, model) pair of
    objects and axis sizes: a plan's candidates share those objects across every order
    of a factorisation, and hashing the configs for each of millions of candidates
    was most of the grouping's time."""
    keys: dict = {}  # (id(parallel), id(cfg), sizes) -> program
    groups: dict = {}
    for c in cands:
        sizes = dict(c.layout.axes)
        fast = (id(c.parallel), id(c.cfg), tuple(sizes.get(r, 1) for r in AXIS_ROLES))
        if (key := keys.get(fast)) is None:
            key = keys[fast] = c.program
        groups.setdefault(key, []).append(c)
    return groups


def price(cands: list, tcfg: TrainConfig, hw, n: int, capacity: float | None,
          workers: int = 1, executor=None, progress=None,
          grow: bool = False, counts: dict | None = None,
          shapes: bool = True, top: int | None = None,
          within: float = 0.0) -> tuple[list, list, int, int, int]:
    """`price_programs` of candidates `cands`, grouped by program (`by_program`)."""
    return price_programs(list(by_program(cands).values()), tcfg, hw, n, capacity, workers,
                          executor, progress, grow, counts, shapes, top, within)


def price_programs(groups: list, tcfg: TrainConfig, hw, n: int, capacity: float | None,
                   workers: int = 1, executor=None, progress=None,
                   grow: bool = False, counts: dict | None = None,
                   shapes: bool = True, top: int | None = None,
                   within: float = 0.0) -> tuple[list, list, int, int, int]:
    """Price the candidates of n devices in `groups` (each a program's candidates: a
    list or a `space.Program`), the programs by structure
    (engine/planner/ledgers.py), each program's memory checked and its ledger read from
    the cache, derived from shapes or traced once (`worker.run`), every candidate priced; with
    `grow`, a step without pp over memory is priced at the fewest microbatches (2, 4,
    ...) that fit (`worker.fitting`). top: price programs best-first by their lower bound
    (engine/planner/best.py) until no program left can reach the `top` fastest (nor
    come within `within` of the first); None: price every program. counts: filled with
    how many ledgers came each way ("cached", "traced", "derived") and how many
    candidates were "pruned" by the bound, and "refused" [(candidate, why)] those whose
    step does not trace; shapes False: trace every program not cached.
    Returns (ranked: [Priced] fastest first, over: [(candidate, peak
    bytes)] over `capacity`, programs priced, programs whose ledger came from the
    cache, workers used)."""
    from engine.cost.price import mfu
    from engine.planner.ledgers import HOW, structure

    planned = collections.Counter(structure(g[0]) for g in groups)

    def jobs_of(gs: list, cutoff: float | None = None) -> list:
        structures: dict[tuple, list] = {}
        for group in gs:
            structures.setdefault(structure(group[0]), []).append(group)
        return [(s, tcfg, hw, capacity, grow, shapes, {key: planned[key]}, cutoff)
                for key, s in structures.items()]

    if executor is None:
        workers = min(workers, max(1, len(groups) // 8))  # a worker costs a jax import
    ranked, over, done = [], [], 0
    counts = {} if counts is None else counts
    counts.update({h: 0 for h in HOW}, pruned=0, refused=[])

    def take(results) -> list:
        """Record `worker.run`'s results; returns [(candidates, bound)] of those deferred."""
        nonlocal done
        deferred = []
        for priced, how, peaks, group in results:
            if how == "failed":  # its step does not trace: `peaks` holds why
                counts["refused"].extend(zip(group, peaks))
                continue
            if how == "deferred":
                deferred.append((group, peaks))
                continue
            if all(p is None for p in priced):
                over.extend(zip(group, peaks))
                continue
            done += 1
            counts[how] += 1
            for c, got, peak in zip(group, priced, peaks):
                if got is None:
                    over.append((c, peak))
                    continue
                step, compute, comm, exposed, mapped = got
                ranked.append(Priced(c, step, compute, comm, exposed,
                                     mfu(c.cfg, tcfg, hw, n, step), peak,
                                     mapped_bytes=mapped))
        return deferred

    if top is None:
        take(worker.run(jobs_of(groups), workers, executor, progress))
    else:
        from engine.planner.best import best_first

        workers = best_first(groups, jobs_of, take,
                             lambda: [p.step_s for p in ranked], tcfg, hw, top, within,
                             workers, executor, progress, counts)
    ranked.sort(key=_rank)
    return ranked, over, done, counts["cached"], workers


def _rank(p: Priced) -> tuple:
    return p.step_s, str(p.candidate.layout), p.candidate.describe()


def timed_prices(priced: list, tcfg: TrainConfig, hw, n: int, devices,
                 time_dots=None) -> tuple[list, object]:
    """`priced` [Priced] priced again with every matmul of their steps timed on the first
    n of `devices`, all at once (engine/cost/microbench.py `dot_seconds`, as
    `bench/roofline.py`'s in-run profile times them, here the fastest of `DOT_PASSES`
    passes), instead of the profile's one matmul rate. Returns ([Priced] in the same
    order, the profile with those times).
    `time_dots(rows, mesh)` -> {Row.dot: seconds} replaces the timing (tests)."""
    from engine.cost import cache
    from engine.cost.microbench import dot_seconds, flat_mesh
    from engine.cost.pipeline import predict_step
    from engine.cost.price import mfu

    rows_of: dict = {}
    for p in priced:
        c = p.candidate
        if c.program not in rows_of:
            rows_of[c.program] = cache.step_ledger(c.cfg, tcfg, c.layout, c.parallel,
                                                   hw.bf16_collectives_in_f32)[0]
    todo = [r for rows in rows_of.values() for r in rows
            if r.dot is not None and r.dot not in hw.dot_seconds]
    time_dots = time_dots or functools.partial(dot_seconds, passes=DOT_PASSES)
    timed = time_dots(todo, flat_mesh(list(devices)[:n])) if todo else {}
    hw = dataclasses.replace(hw, dot_seconds={**hw.dot_seconds, **timed})
    out = []
    for p in priced:
        c = p.candidate
        pred = predict_step(rows_of[c.program], hw, c.layout, c.parallel, p.mapped_bytes,
                            itemized=False)[0]
        out.append(Priced(c, pred.step_s, pred.compute_s, pred.comm_s, pred.exposed_comm_s,
                          mfu(c.cfg, tcfg, hw, n, pred.step_s), p.peak_bytes, True,
                          p.mapped_bytes))
    return out, hw


# The cpu profile prices every matmul at one rate (`small`'s dots on fsdp8), and XLA:CPU
# runs other shapes at other rates: on the host the planner prices again, with their
# matmuls timed, every candidate predicted within this fraction of the first (`refine`),
# a search margin of about twice the one rate's error between candidates, not a price
# (measured: bench/results/2026-11-27-dot-rates-xeon2c.md).
REFINE_WITHIN = 0.15

# Passes over the refined candidates' matmuls, each dot's fastest kept (`dot_seconds`):
# three hold two candidates' predicted ratio steady where one pass lets a slow spell of
# the host move it (`python bench/dot_passes.py --model medium`;
# bench/results/2026-11-27-dot-rates-xeon2c.md).
DOT_PASSES = 3


def refine(ranked: list, tcfg: TrainConfig, hw, n: int, devices,
           within: float = REFINE_WITHIN, time_dots=None) -> tuple[list, object, int]:
    """The candidates of `ranked` (fastest first) predicted within `within` of the first
    priced again with their matmuls timed on `devices` (`timed_prices`) and ranked
    among themselves, ahead of the rest. Returns (ranked, the profile they are priced
    with, how many were priced again)."""
    if not ranked:
        return ranked, hw, 0
    near = [p for p in ranked if p.step_s <= ranked[0].step_s * (1 + within)]
    again, hw = timed_prices(near, tcfg, hw, n, devices, time_dots)
    return sorted(again, key=_rank) + ranked[len(near):], hw, len(near)


def plan(cfg: ModelConfig, tcfg: TrainConfig, n: int, hw, hbm_bytes: float | None = None,
         pinned: dict | None = None, workers: int = 1, names: tuple[str, ...] = AXIS_ROLES,
         limits: dict | None = None, executor=None, progress=None, devices=None,
         within: float = REFINE_WITHIN, say=None,
         base: ParallelConfig = ParallelConfig(), shapes: bool = True,
         top: int | None = 10) -> Plan:
    """Enumerate (`candidates`), validate, check memory, trace and price each program
    once (`price`), rank by predicted step. A candidate without pp over memory is
    priced at the fewest of 2, 4, ... microbatches that fit while they divide its batch
    (`price`'s `grow`). On a shared host (the cpu profile) with `devices` (at least n
    of them), the candidates within `within` of the first are priced again with their
    matmuls timed on those devices (`refine`; `say` gets one line before it). `base`:
    the ParallelConfig fields that are not the plan's switches (grad_reduce). shapes:
    derive ledgers from their structure's shapes (False: trace every program). top: the
    ranking's length that must be exact: programs are priced best-first by their lower
    bound until none left can reach it (`price`); None: price every program."""
    from engine.cost import fit

    t0 = time.perf_counter()
    names, left_out = considered(cfg, names)
    ok, refused = programs(cfg, tcfg, n, pinned, names, limits, base)
    capacity = fit.capacity(hw, n, hbm_bytes)
    grow = "microbatches" not in (pinned or {})  # pinned microbatches stay as given
    counts: dict = {}
    refining = hw.shared_host and devices is not None and len(devices) >= n and within > 0
    ranked, over, priced, cached, workers = price_programs(
        ok, tcfg, hw, n, capacity, workers, executor, progress, grow=grow, counts=counts,
        shapes=shapes, top=top, within=within if refining else 0.0)
    refined = 0
    if ranked and refining:
        if say is not None:
            say(f"planning: timing the matmuls of the candidates predicted within "
                f"{within:.0%} of the first on {n} host devices")
        ranked, hw, refined = refine(ranked, tcfg, hw, n, devices, within)
    return Plan(ranked, refused + counts["refused"], over, capacity, priced, cached, workers,
                time.perf_counter() - t0, hw, refined, counts["derived"], names, left_out,
                counts["pruned"], top, counts.get("deferred", 0))

