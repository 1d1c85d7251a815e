"""Pricing a pp ledger in many axis orders, as the planner does, gives the steps of
pricing every stage of every order on its own (engine/cost/pipeline.py `_parts`, `_split`).

The planner prices one ledger once per class of axis orders and per schedule; pipeline
pricing splits the ledger once for all of them and prices a unit once for the stages
that run the same rows (all but the first and the last). The reference here prices
each unit on each stage from a fresh split of the rows, as `_parts` did before: the
steps must be equal bit for bit (the same rows summed in the same order).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.config import ParallelConfig
from engine.cost import hardware, pipeline as pipe_cost
from engine.cost.price import predict
from engine.cost.rows import Row
from engine.parallel import pipeline
from engine.parallel.layout import Layout
from layers import scopes

T_TICKS = 7  # the trip count the synthetic rows were "traced" with


def _row(scope, kind, primitive, nbytes, flops, pp, axes=(), size=1, count=T_TICKS,
         phase="fwd"):
    return Row(scope=scope, phase=phase, kind=kind, primitive=primitive, dtype="bfloat16",
               shape=(64, 64), flops=float(flops), bytes=float(nbytes), count=count,
               axes=axes, axis_size=size, pp=pp)


def ledger(scale: float) -> list:
    """A pp ledger's rows: each unit's body, the first stage's embedding and the last
    stage's head in both units, a tp all-reduce and a stage shift per tick, and the
    grad reduction outside the ticks; `scale` makes two ledgers that price apart."""
    tick = (scopes.PP_TICK,)
    fwd, bwd = (*tick, scopes.PP_FORWARD), (*tick, scopes.PP_BACKWARD)
    rows = []
    for unit, phase in ((fwd, "fwd"), (bwd, "bwd")):
        rows += [
            _row("mlp", "matmul", "dot_general", 3e8 * scale, 4e12 * scale, unit, phase=phase),
            _row("attention", "memory", "exp", 5e9 * scale, 1e9, unit, phase=phase),
            _row("mlp", "collective", "psum", 2e8 * scale, 0, unit, ("tp",), 4, phase=phase),
            _row("embed", "memory", "gather", 7e9 * scale, 0, (*unit, scopes.PP_FIRST),
                 phase=phase),
            _row("loss", "matmul", "dot_general", 1e8, 9e12 * scale, (*unit, scopes.PP_LAST),
                 phase=phase),
        ]
    rows.append(_row("other", "collective", "ppermute", 1e8 * scale, 0, tick, ("pp",), 4))
    rows.append(_row("reduce_grads", "collective", "psum", 4e9 * scale, 0, (), ("fsdp",), 2,
                     count=1, phase="update"))
    return rows


def reference_parts(rows, pp, hw, mesh_axes, prefetch, uniform, virtual):
    """unit_s [3, pp] and shift_s priced stage by stage from a fresh split."""
    inside = [r for r in rows if scopes.PP_TICK in r.pp]
    once = pipe_cost._once(inside)
    unit_s = np.zeros((len(pipe_cost.UNITS), pp))
    for kind in pipe_cost.UNITS:
        for s in range(pp):
            part = pipe_cost.unit_rows(once, kind, s, pp, uniform)
            unit_s[kind, s] = predict(part, hw, mesh_axes, prefetch).step_s if part else 0.0
            if virtual > 1 and not uniform:
                body = [r for r in part if not pipe_cost.EDGES & set(r.pp)]
                edge_s = unit_s[kind, s] - (predict(body, hw, mesh_axes, prefetch).step_s
                                            if body else 0.0)
                unit_s[kind, s] -= edge_s * (virtual - 1) / virtual
    shift = [r for r in once if not set(pipe_cost.UNITS.values()) & set(r.pp)]
    return unit_s, predict(shift, hw, mesh_axes, prefetch).step_s


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_pp_pricing_in_every_order_equals_stage_by_stage(schedule, virtual):
    hw = hardware.get("h100")
    sizes = {"fsdp": 2, "tp": 4, "pp": 4}
    par = ParallelConfig(microbatches=8, pp_schedule=schedule, pp_virtual=virtual)
    a, b = ledger(1.0), ledger(1.7)
    seen = 0
    for order in itertools.permutations(sizes):
        layout = Layout(tuple((r, sizes[r]) for r in order))
        the_plan = pipeline.step_plan(layout, par)
        # the planner prices a, then the next program's b, in one worker: each from its own split
        for rows in (a, b, a):
            got = pipe_cost.predict_pipeline(rows, hw, layout.mesh_axes(), the_plan)
            unit_s, shift_s = reference_parts(rows, 4, hw, layout.mesh_axes(), False,
                                              the_plan.uniform, the_plan.virtual)
            assert np.array_equal(got.unit_s, unit_s)
            assert got.shift_s == shift_s
            # the step as pricing it fresh: a ledger with the same rows in a new list
            fresh = pipe_cost.predict_pipeline(list(rows), hw, layout.mesh_axes(), the_plan)
            assert got.step_s == fresh.step_s
            seen += 1
    assert seen == 18
    # the first and last stages price apart from the middle ones, and the two ledgers
    # apart from each other: a memo that mixed stages or ledgers would fail above
    assert len(set(got.unit_s[pipe_cost.FORWARD])) == (1 if the_plan.uniform else 3)
    other = pipe_cost.predict_pipeline(b, hw, layout.mesh_axes(), the_plan)
    assert other.step_s != got.step_s


@pytest.mark.parametrize("profile", ["h100", "cpu"])
@pytest.mark.parametrize("sizes", [{"fsdp": 2, "tp": 4, "pp": 4}, {"fsdp": 2, "tp": 4}])
def test_totals_without_the_itemized_rows_are_the_same(profile, sizes):
    """The planner prices with `itemized=False` (no `Priced` row objects): the step and
    its compute, communication and exposed communication equal the itemized
    prediction's bit for bit, flat and pipelined, with and without overlap."""
    hw = hardware.get(profile)
    layout = Layout(tuple(sizes.items()))
    par = ParallelConfig(microbatches=8, prefetch=True)
    rows = ledger(1.3) if "pp" in sizes else [r.replace(pp=()) for r in ledger(1.3)
                                               if "pp" not in r.axes]
    full = pipe_cost.predict_step(rows, hw, layout, par, 2e8)[0]
    fast = pipe_cost.predict_step(rows, hw, layout, par, 2e8, itemized=False)[0]
    assert full.rows and not fast.rows
    for field in ("step_s", "compute_s", "comm_s", "exposed_comm_s", "fault_s"):
        assert getattr(fast, field) == getattr(full, field), field
    assert full.exposed_comm_s > 0


def test_a_program_that_does_not_trace_is_refused_not_fatal(monkeypatch):
    """A program whose step jax cannot trace is refused with why (in `Plan.refused`);
    the plan ranks the rest."""
    from engine.config import TrainConfig, model_config
    from engine.cost import cache
    from engine.planner import ledgers, search

    real = ledgers._trace

    def trace(c, tcfg, pack):
        if c.layout.degree("tp") > 1:
            raise TypeError("cond branches must have equal output types\nmore")
        return real(c, tcfg, pack)

    monkeypatch.setattr(ledgers, "_trace", trace)
    monkeypatch.setattr(cache, "lookup", lambda *a, **k: None)
    got = search.plan(model_config("tiny"), TrainConfig(batch=8, seq=16), 2,
                      hardware.get("h100"), pinned={"remat": "none"}, names=("dp", "tp"),
                      top=None)
    failed = [(c, why) for c, why in got.refused if "does not trace" in why]
    assert failed and all(c.layout.degree("tp") > 1 for c, _ in failed)
    assert "TypeError: cond branches must have equal output types)" in failed[0][1]
    assert got.ranked and all(p.candidate.layout.degree("tp") == 1 for p in got.ranked)
