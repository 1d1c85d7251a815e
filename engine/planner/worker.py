"""A plan's workers: each program's memory, ledger and price, in a pool of processes.

`price_structure` takes the programs of one structure (engine/planner/ledgers.py: they
differ only in axis sizes), checks each one's memory (`fitting`: engine/cost/fit.py,
retried at more microbatches where it is over), reads, derives or traces each ledger
(`ledgers.program_ledgers`) and prices every order of its axes (`priced`), all in the
worker, so the planning process (engine/planner/search.py, best-first by
engine/planner/best.py) only hands out structures and ranks what comes back. `run`
sends a list of such jobs to a `Pool` in `chunks`.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from engine.cost.ledger import paused_gc
from engine.planner.space import accumulated


def fitting(cands: list, tcfg, hw, capacity, grow: bool) -> tuple[list, list, dict, bool]:
    """The memory phase of one program: each candidate's peak memory
    (engine/cost/fit.py). With `grow`, a step without pp over memory is retried with 2,
    4, ... microbatches (`accumulated`, the program of the next M) while they divide its
    batch. Returns (the candidates: the given, or the microbatched ones they grew into,
    [peak bytes] per candidate, {parallel: memory prediction}, whether every one is over
    `capacity`)."""
    from engine.cost import fit

    mem_of: dict = {}  # memory depends on the sizes and switches, not the axis order
    for c in cands:
        if c.parallel not in mem_of:
            mem_of[c.parallel] = fit.predicted(c.cfg, tcfg, c.parallel, c.layout, hw)
    peaks = [None if mem_of[c.parallel] is None else mem_of[c.parallel].peak for c in cands]
    if capacity is not None and all(p is not None and p > capacity for p in peaks):
        # engine.parallel.validate reads axis sizes, not their order: a program grows as a whole
        grown = [accumulated(c, tcfg) for c in cands] if grow else [None]
        if all(g is not None for g in grown):
            return fitting(grown, tcfg, hw, capacity, grow)
        return cands, peaks, mem_of, True
    return cands, peaks, mem_of, False


def priced(rows: list, cands: list, peaks: list, mem_of: dict, hw, capacity) -> list:
    """[(step, compute, comm, exposed comm, mapped bytes), or None when over memory] of
    each candidate of one program priced from its ledger `rows`, once per class of axis
    orders that put every collective's group on the same links. On a shared host a step
    also pays the page faults of the temporaries it maps anew (`fit.mapped_bytes` of its
    memory prediction)."""
    from engine.cost import fit
    from engine.cost.pipeline import predict_step

    # a collective's price reads the order of the axes only through which devices of
    # its group share a fast domain (`price.domain_share`): orders alike in that for
    # every group of the ledger price alike, so each such class is priced once
    from engine.cost.price import domain_share

    groups = sorted({r.axes for r in rows if r.kind == "collective" and r.axis_size > 1})
    out, seen = [], {}
    for c, peak in zip(cands, peaks):
        if capacity is not None and peak is not None and peak > capacity:
            out.append(None)
            continue
        axes = c.layout.mesh_axes()
        key = (c.parallel, tuple(domain_share(hw, axes, g) for g in groups))
        if key not in seen:
            mapped = fit.mapped_bytes(mem_of[c.parallel], hw)
            p = predict_step(rows, hw, c.layout, c.parallel, mapped, itemized=False)[0]
            seen[key] = (p.step_s, p.compute_s, p.comm_s, p.exposed_comm_s, mapped)
        out.append(seen[key])
    return out


@paused_gc()  # as a trace is: its memory checks and pricing allocate as much
def price_structure(job) -> list:
    """The programs of one structure (engine/planner/ledgers.py: they differ only in
    axis sizes): `fitting` each, the ledgers of those that fit from the cache, derived
    from shapes or traced (`ledgers.program_ledgers`), each priced (`priced`), here in
    the worker, so the pool never waits on a round of microbatch retries. Returns per
    program (`priced`'s list, how its ledger came: one of ledgers.HOW, or "none" when
    every candidate is over memory, or "deferred" when its bound as it will run
    (`bound.order_bound`) exceeds the job's cutoff, [peak bytes] per candidate (for a
    "failed" program, whose step does not trace, why, per candidate; for a "deferred"
    one, its bound), the candidates priced: the job's, or the microbatched ones they
    grew into)."""
    from engine.planner.bound import order_bound
    from engine.planner.ledgers import program_ledgers

    groups, tcfg, hw, capacity, grow, shapes, planned, cutoff = job
    fitted = [fitting(g, tcfg, hw, capacity, grow) for g in groups]
    # bounded again as it will run (grown into more microbatches, each gathering the
    # weights and running its collectives again; its axes in their least costly
    # order): above `cutoff` it goes back to the best-first queue at that bound
    # instead of being traced now
    later = [cutoff is not None and not over
             and (b := order_bound(cands, tcfg, hw)) > cutoff and b
             for cands, _, _, over in fitted]
    need = [f[0][0] for f, b in zip(fitted, later) if not f[3] and not b]
    got = iter(program_ledgers(need, tcfg, hw.bf16_collectives_in_f32, shapes, planned))
    out = []
    for (cands, peaks, mem_of, over), b in zip(fitted, later):
        if over:
            out.append(([None] * len(cands), "none", peaks, cands))
            continue
        if b:  # "deferred": in place of the peaks, its bound as it will run
            out.append(([None] * len(cands), "deferred", b, cands))
            continue
        rows, how = next(got)
        if how == "failed":  # `rows` says why: in place of the peaks, refused in `price`
            out.append(([None] * len(cands), how, [rows] * len(cands), cands))
            continue
        out.append((priced(rows, cands, peaks, mem_of, hw, capacity), how, peaks, cands))
    return out


class Pool(ProcessPoolExecutor):
    """A process pool of `workers` spawned processes (fresh interpreters: safe whatever
    jax backend this process started). Each imports jax and the traced step once, then
    takes jobs. Workers forked from a forkserver that had imported them traced slower
    (bench/results/2026-11-26-plan-speed-cpu.md), so spawn."""

    def __init__(self, workers: int):
        super().__init__(workers, mp_context=multiprocessing.get_context("spawn"))
        self.workers = workers


# what a worker imports for its jobs: this module (to unpickle them), jax, the traced
# step, the cost model
WORKER_MODULES = ("engine.planner.worker", "engine.cost.cache", "engine.cost.ledger",
                  "engine.cost.price", "engine.cost.fit", "engine.cost.memory",
                  "engine.planner.bound", "engine.planner.ledgers", "engine.run.step")


def warm() -> None:
    """Import `WORKER_MODULES`, so a pool started ahead of its first job has paid for
    them."""
    import importlib

    for name in WORKER_MODULES:
        importlib.import_module(name)


def price_structures(jobs: list) -> list:
    """`price_structure` of each job in turn (one chunk, in one worker), its results
    one list."""
    return [r for j in jobs for r in price_structure(j)]


# the longest run of programs one worker takes at a time: a run's results (and the
# plan's progress line) come back when all of it is priced, ~1 s per program traced
LONGEST_RUN = 8


def chunks(n: int, workers: int, longest: int = LONGEST_RUN) -> list[range]:
    """Jobs 0..n-1 cut into runs of consecutive ones for `workers` processes, largest
    first: each run is the jobs left over 2·workers (at least 1, at most `longest`), so
    the runs at the end are single jobs and no worker waits long for the last (guided
    scheduling), and results come back every few programs however many there are.
    Consecutive jobs in one worker reuse jax's tracing caches."""
    out, start = [], 0
    while start < n:
        size = max(1, min(longest, (n - start) // (2 * max(workers, 1))))
        out.append(range(start, start + size))
        start += size
    return out


def run(jobs: list, workers: int, executor=None, progress=None) -> list:
    """`price_structure` over jobs, its results one list: in `executor` (a `Pool`) if
    given, else in a `Pool` of `workers` (here when 1). Jobs (one structure each) go out
    in their order, in `chunks` of consecutive ones, largest first: a worker tracing
    programs of the same shapes in a row reuses jax's tracing caches, and the single
    jobs at the end keep every worker busy to the last
    (bench/results/2026-11-26-plan-speed-cpu.md). `progress(done, total)` is
    called as results come in."""
    progress = progress or (lambda done, total: None)
    total = sum(len(j[0]) for j in jobs)  # programs

    def collect(batches):  # lists of results, as they come in
        out = []
        for batch in batches:
            out.extend(batch)
            progress(len(out), total)
        return out

    if executor is None and workers <= 1:
        return collect(price_structure(j) for j in jobs)

    def submit(ex: Pool):
        return [ex.submit(price_structures, jobs[r.start:r.stop])
                for r in chunks(len(jobs), ex.workers)]

    if executor is None:
        with Pool(workers) as ex:
            return collect(f.result() for f in submit(ex))
    return collect(f.result() for f in submit(executor))
