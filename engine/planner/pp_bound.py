"""A lower bound on a pipelined step along its schedule's table (engine/cost/pipeline.py).

engine/cost/pipeline.py prices a pp step as the sum over ticks of the tick's lock-step
length (`Plan.lockstep_T` of each unit's priced time on each stage) plus the stage
shifts and the rows outside the ticks. `Plan.lockstep_T` is a max and a sum of the
units' times, so it never falls when a unit's time rises: with each unit's time bounded
from below on every stage, the lock-step of those bounds along the same table bounds
the ticks. That puts the schedule's bubble on every part of a unit's work (matmuls,
attention, its exposed collectives, zero 3's gathers), not on the matmuls alone as
`bound.compute_bound` does.

One unit (one microbatch through one chunk of N / (pp V) layers, on one device), each
part as `engine.cost.price.predict` prices the unit's rows:
- compute: the blocks' matmul FLOPs and attention of the whole step
  (`bound.matmul_flops`, `bound.attention_phases`) over the devices and the M V units of
  each, forward 2 of 6 (8 under remat `full`) per param per token, the backward the rest;
- collectives (`bound.unit_rows`): tp's and cp's per layer, zero 3's weight gathers
  (forward) and grad reduce-scatters (backward), each priced by `price.collective_seconds`
  at the fastest link tier any order gives it (`bound._seconds`);
- with overlap, the hideable ones (`price.hideable`) combined with the blocks' compute
  as `price.predict` does: hidden up to the compute, `hidden_comm_share` of what hides
  left exposed. predict's unit time, compute + exposed, rises with both the compute and
  the hideable time, so bounds of each bound it.
Outside the ticks: the grad all-reduces and global norm (`bound.exposed_rows`' update
rows). Not on a shared host (a tick there costs the stages' mean work, not the max) nor
under a split schedule (zb1: how the backward divides into B and W is the trace's).
"""
from __future__ import annotations

import numpy as np

from engine.cost import price
from engine.parallel import pipeline
from layers import scopes


def unit_bounds(cfg, tcfg, layout, parallel, hw) -> tuple[float, float]:
    """(forward, backward) lower bounds of one unit's priced time on any stage (module
    doc)."""
    from engine.planner import bound

    n, units = layout.size, parallel.microbatches * parallel.pp_virtual
    block, _ = bound.matmul_flops(cfg, tcfg)
    passes = 8 if cfg.remat == "full" else 6
    rate = bound.best_matmul_rate(hw)
    attention = bound.attention_phases(cfg, tcfg, hw,
                                       bound.dense_tiles(cfg, layout, parallel))
    compute = {"fwd": block * 2 / passes / rate + attention["fwd"],
               "bwd": block * (passes - 2) / passes / rate + attention["bwd"]
               + attention["recompute"]}
    out = []
    for phase in ("fwd", "bwd"):
        c = compute[phase] / (n * units)
        exposed = hidable = 0.0
        for r in bound.unit_rows(cfg, tcfg, layout, parallel, phase):
            t = bound._seconds(r, hw) * r.count
            if hw.overlap and price.hideable(r, parallel.prefetch):
                hidable += t
            else:
                exposed += t * (1 + hw.beside_cost
                                if price.hideable(r, parallel.prefetch) else 1.0)
        hidden_frac = min(1.0, c / hidable) if hidable else 0.0
        left = 1 - hidden_frac + hidden_frac * hw.hidden_comm_share
        out.append(c + exposed + hidable * left)
    return out[0], out[1]


def pipeline_bound(cfg, tcfg, layout, parallel, hw, rows: list | None = None) -> float:
    """A lower bound on the pp step of every order of `layout` (module doc); 0 where it
    does not apply (no pp axis, a shared host, a split schedule). rows: the step's
    `bound.exposed_rows`, when the caller has them."""
    from engine.planner import bound

    pp = layout.degree("pp")
    if pp <= 1 or hw.shared_host:
        return 0.0
    the_plan = bound.table(pp, parallel.pp_schedule, parallel.microbatches,
                           parallel.pp_virtual, pipeline.uniform_units(layout, parallel))
    if the_plan.split:
        return 0.0
    forward, backward = unit_bounds(cfg, tcfg, layout, parallel, hw)
    ticks = the_plan.lockstep_T(np.full(pp, forward), np.full(pp, backward)).sum()
    rows = bound.exposed_rows(cfg, tcfg, layout, parallel) if rows is None else rows
    outside = sum(bound._seconds(r, hw) * r.count for r in rows
                  if r.scope == scopes.REDUCE_GRADS)
    return float(ticks) + outside
