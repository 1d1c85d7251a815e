"""Best-first pricing: programs in the order of their lower bound (engine/planner/bound.py),
priced in batches, until no program left can reach the ranking's top.

After each batch, with K the ranking asked for: once the K-th fastest priced step (and
the first's times 1 + `within`, the margin `search.refine` prices again) is below the
smallest bound left, every program left is slower than all of those (its every
candidate's step is at least its bound) and is pruned unpriced. The top K is then the
top K of pricing every program. The first batch runs in this process; a pool of
workers starts only when more is needed.
"""
from __future__ import annotations

# programs of the first batch, priced here before any worker starts
FIRST = 2


def settled(steps: list, top: int, within: float, next_bound: float) -> bool:
    """Whether no candidate of step >= `next_bound` can enter the `top` fastest of
    `steps` or come within `within` of the fastest."""
    if len(steps) < top:
        return False
    ranked = sorted(steps)
    return max(ranked[top - 1], ranked[0] * (1 + within)) < next_bound


def best_first(groups: list, jobs_of, take, steps, tcfg, hw, top: int, within: float,
               workers: int, executor=None, progress=None, counts: dict | None = None) -> int:
    """Price the programs `groups` (lists of one program's candidates) best-first by
    their lower bound: `jobs_of(groups)` makes a batch's jobs, `take(results)` receives
    `search._run`'s results, `steps()` the priced steps so far. The first batch of
    `FIRST` programs runs in this process, the rest in batches of two a worker in a
    pool of `workers` (or `executor`): the bound is checked after each. Sets
    counts["pruned"] to the candidates never priced; returns the workers used."""
    from engine.planner.bound import lower_bound
    from engine.planner.search import Pool, _run

    progress = progress or (lambda done, total: None)
    bounds = [lower_bound(g[0], tcfg, hw) for g in groups]
    order = sorted(range(len(groups)), key=bounds.__getitem__)
    pool, own, used, done, i, batch = executor, None, 1, 0, 0, FIRST
    try:
        while i < len(order) and not settled(steps(), top, within, bounds[order[i]]):
            part = order[i:i + batch]
            i += len(part)
            if pool is None and workers > 1 and done:
                pool = own = Pool(workers)
            if pool is not None:
                used = pool.workers
            jobs = jobs_of([groups[j] for j in part])
            if len(jobs) < used:  # one structure's programs: spread over the workers
                jobs = [job for j in part for job in jobs_of([groups[j]])]
            take(_run(jobs, 1, pool,
                      lambda d, _, before=done: progress(before + d, len(order))))
            done += len(part)
            batch = max(FIRST, 2 * used)  # a check every program or two a worker
    finally:
        if own is not None:
            own.shutdown()
    if counts is not None:
        counts["pruned"] = sum(len(groups[j]) for j in order[i:])
    return used
