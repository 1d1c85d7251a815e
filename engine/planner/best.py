"""Best-first pricing: programs in the order of their lower bound (engine/planner/bound.py),
priced a few at a time, until no program left can reach the ranking's top.

As results come in, with K the ranking asked for: once the K-th fastest priced step (and
the first's times 1 + `within`, the margin `search.refine` prices again) is below the
smallest bound left, every program left is slower than all of those (its every
candidate's step is at least its bound) and is pruned unpriced. The top K is then the
top K of pricing every program. A program waits in the queue at its compute bound
alone until it first reaches the front, where its whole bound is taken. A program
that fits (grown into more microbatches where it must: its weights gathered and its
collectives run once per microbatch) is bounded again before its trace, with its
collectives on the order of its axes least costly for them (`bound.order_bound`), and
goes back into the queue at that bound when it is not the smallest left.

The first programs are priced in this process while a pool of workers starts (its
imports); then each worker has one batch in flight at a time, and the next goes out
as soon as one comes back, so no worker waits on another's trace.
"""
from __future__ import annotations

import heapq
import math

# programs of the first batch, priced here before any worker starts
FIRST = 2
# the largest batch, reached while no program of a batch is priced (all over memory)
MOST = 256


def settled(steps: list, top: int, within: float, next_bound: float) -> bool:
    """Whether no candidate of step >= `next_bound` can enter the `top` fastest of
    `steps` or come within `within` of the fastest."""
    if len(steps) < top:
        return False
    ranked = sorted(steps)
    return max(ranked[top - 1], ranked[0] * (1 + within)) < next_bound


def best_first(groups: list, jobs_of, take, steps, tcfg, hw, top: int, within: float,
               workers: int, executor=None, progress=None, counts: dict | None = None) -> int:
    """Price the programs `groups` (each one program's candidates) best-first by their
    lower bound (`bound.compute_bound` alone until a program first reaches the front of
    the queue, then `bound.lower_bound`): `jobs_of(groups, cutoff)` makes a batch's
    jobs, `take(results)` receives `worker.price_structure`'s results and returns the
    programs deferred, `steps()` the priced steps so far. Before tracing a program that
    fits (grown into more microbatches where it must), the worker bounds it again as it
    will run (`bound.order_bound`: its microbatches, its axes in the order least costly
    for its collectives); above `cutoff`, the smallest bound left in the queue when its
    batch went out, it comes back untraced and goes back into the queue at that bound.
    The first batch of `FIRST` programs runs in this process while a pool of `workers`
    (or `executor`) starts; then one batch per worker is in flight, `FIRST` programs
    while the last batch priced one, twice as many as the last (up to `MOST`) while
    every one came back over memory or deferred. `progress(done, total, front)` is
    called per program priced or over memory, `front()` giving (top, the top-th best
    step so far or None, the least bound left). Sets counts["pruned"] to the
    candidates never priced and counts["deferred"] to the programs put back; returns
    the workers used."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from engine.planner.bound import compute_bound, lower_bound
    from engine.planner.worker import Pool, price_structures, warm

    progress = progress or (lambda done, total, front=None: None)
    groups = list(groups)
    total = len(groups)
    # every program enters the queue at its compute bound alone (microseconds), and
    # gets its whole bound (the collectives too) when it first reaches the front
    queue = [(compute_bound(g[0].cfg, tcfg, g[0].layout, g[0].parallel, hw), j)
             for j, g in enumerate(groups)]
    heapq.heapify(queue)
    whole: set = set()  # programs queued at their whole bound

    def front():
        """The queue with its first program at its whole bound."""
        while queue and queue[0][1] not in whole:
            _, j = heapq.heappop(queue)
            whole.add(j)
            heapq.heappush(queue, (lower_bound(groups[j][0], tcfg, hw), j))
        return queue

    def more() -> bool:
        return bool(front()) and not settled(steps(), top, within, queue[0][0])

    def batch_of(size: int) -> tuple[list, list]:
        """(the next `size` programs of the queue, their jobs)."""
        part = []
        while len(part) < size and front():
            part.append(heapq.heappop(queue)[1])
        cutoff = front()[0][0] if front() else math.inf
        return part, jobs_of([groups[j] for j in part], cutoff)

    done, deferred = 0, 0

    def record(part: list, results: list) -> bool:
        """Take a batch's results; put the deferred back. Whether it priced one."""
        nonlocal done, deferred
        before = len(steps())
        back = take(results)
        for grown, bound in back:
            groups.append(grown)
            whole.add(len(groups) - 1)
            heapq.heappush(queue, (bound, len(groups) - 1))
        deferred += len(back)
        for _ in range(len(part) - len(back)):  # once per program priced or over memory
            done += 1
            progress(done, total, where)
        return len(steps()) > before

    def where() -> tuple:
        """(top, the top-th best step so far or None, the least bound left)."""
        ranked = sorted(steps())
        return (top, ranked[top - 1] if len(ranked) >= top else None,
                front()[0][0] if front() else math.inf)

    pool, own = executor, None
    if pool is None and workers > 1 and len(groups) > FIRST:
        pool = own = Pool(workers)
        for _ in range(workers):  # its imports, while the first batch runs here
            pool.submit(warm)
    try:
        while more():  # here: the first batch, or every batch without a pool
            part, jobs = batch_of(FIRST)
            record(part, price_structures(jobs))
            if pool is not None:
                break
        if pool is None:
            return 1
        size, flight = FIRST, {}
        while flight or more():
            while len(flight) < pool.workers and more():
                part, jobs = batch_of(size)
                flight[pool.submit(price_structures, jobs)] = part
            finished, _ = wait(flight, return_when=FIRST_COMPLETED)
            for f in finished:
                priced = record(flight.pop(f), f.result())
                # while every one comes back over memory or deferred (no trace:
                # milliseconds each), twice the last, so a round trip is not paid per pair
                size = FIRST if priced else min(2 * size, MOST)
        return pool.workers
    finally:
        if own is not None:
            own.shutdown()
        if counts is not None:
            counts["pruned"] = sum(len(groups[j]) for _, j in queue)
            counts["deferred"] = deferred
