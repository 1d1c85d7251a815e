"""Price a pipelined step (engine/parallel/pipeline.py) tick by tick from its schedule's table.

The pipelined step is a scan over T ticks; in each, every stage runs its forward slot
and its backward slot (each a `lax.cond`: the unit or idle), then shifts its outputs to
its neighbours. The ledger walks every branch on every tick (an upper bound: T forwards
and T backwards per device); the rows carry the pipeline scopes (`Row.pp`,
layers/scopes.py) that say which unit runs them and which parts only the first stage
(the embedding) or the last (head and loss) runs. Here:

    unit(k, s)  = `price.predict` of the rows of unit k (forward / backward) as stage s
                  runs them, once (trip count over T), with its own overlap model; a
                  slot of the pipeline's buffers is read and written in place
    work(t, s)  = unit(forward, s) if s has a forward at t, + unit(backward, s) likewise
                  (+ unit(weight, s) under a split schedule: zb1's backward is B, and
                  its W a unit of its own)
    tick(t)     = max over stages s of work(t, s)      (accelerators: lock-step ticks)
                  + the tick's own rows (buffer writes, and the stage shifts'
                  ppermutes, with their all-gathers over tp where the value is
                  replicated over tp, on the ticks that run them: a shift runs only on
                  the ticks where some stage sends, `Plan.send_x_T` / `send_ct_T`)
                  - the forward shift's part hidden under the tick's backward
                  (`hidden_shift_T`: accelerators, whose collectives are async)
    step        = sum over ticks of tick(t) + the rows outside the scan (grad
                  reductions, optimizer)

The max is the ticks' lock-step: every stage waits for its neighbour's shift before the
next tick. GPipe's ticks are all forwards or all backwards and 1F1B's (fused) steady
ticks one forward and one backward on every stage, so with units equal across stages
both take (M + p - 1) x (forward + backward) and idle a stage (p - 1) / (M + p - 1) of
the time (`Plan.bubble()`), whatever the backward's cost next to the forward's. A
uniform plan runs the tick's slowest forward and slowest backward on every stage
(`Plan.lockstep_T`). On a shared host (forced CPU devices, `hw.shared_host`) a stage's
idle devices leave their cores to the busy ones: a tick costs the mean over stages of
their work (each unit priced as if every device ran it) and idle slots cost no time.

The forward unit runs the unit's `jax.vjp` and the backward applies the stashed residuals
(the backward's rows are the transpose's, with the per-layer recompute of `full`
inside); under a cp ring the backward recomputes the unit. Both are read off the traced
rows.

`bubble` = 1 - (stage time in units) / (pp x the lock-step pipeline's time), the
fraction of its time a stage waits, next to the schedule's idle fraction. On a shared
host the devices wait just as much (bench/pipeline.py reads it off a profile), but the
step's wall clock does not pay the wait in full, so there the bubble is not a fraction
of the predicted step.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from engine.cost.ledger import COLLECTIVES, Row
from engine.cost.price import Prediction, fault_seconds, predict, with_faults
from engine.parallel import pipeline
from layers import scopes

FORWARD, BACKWARD, WEIGHT = 0, 1, 2  # rows of `PipelinePrediction.unit_s`
UNITS = {FORWARD: scopes.PP_FORWARD, BACKWARD: scopes.PP_BACKWARD, WEIGHT: scopes.PP_WEIGHT}
EDGES = {scopes.PP_FIRST, scopes.PP_LAST}  # the first stage's and the last stage's parts


@dataclasses.dataclass(frozen=True)
class PipelinePrediction:
    """A pipelined step's prediction, seconds.

    prediction: as `price.predict`'s, its rows each unit's rows run M times (the first
        stage's and the last stage's parts included) and the rest as traced; step_s is
        the pipelined step (below), not compute + exposed communication.
    unit_s: [3, pp] one unit (FORWARD, BACKWARD, WEIGHT: zeros but under a split
        schedule) on each stage.
    tick_s: [T] each tick: its stages' work (max, or mean on a shared host) + shift_T.
    shift_s: a tick's own rows (buffer writes) with both its shifts.
    shift_T: [T] each tick's own rows: buffer writes and the shifts it runs.
    outside_s: the rows outside the tick scan (grad reductions, optimizer).
    bubble: the fraction of a stage's time spent waiting, ticks in lock-step.
    schedule_bubble: the table's idle fraction, units of equal length (`Plan.bubble()`).
    uniform: every stage runs each tick's units (`Plan.uniform`).
    hidden_shift_s: the forward shifts' time hidden under backward slots, all ticks
        (`hidden_shift_T`; tick_s is net of it)."""

    prediction: Prediction
    unit_s: np.ndarray
    tick_s: np.ndarray
    shift_s: float
    outside_s: float
    bubble: float
    schedule_bubble: float
    uniform: bool = False
    hidden_shift_s: float = 0.0
    shift_T: np.ndarray | None = None

    @property
    def step_s(self) -> float:
        return self.prediction.step_s


def _once(rows: list[Row]) -> list[Row]:
    """The rows inside the tick scan with its trip count taken out (one execution per
    tick; the ledger prices the buffers' slots read and written in place). The trip
    count is the one the rows were traced with, the gcd of their counts (the shifts run
    once a tick): a ledger traced under one schedule prices along another's table with
    the same units (gpipe and 1f1b, `engine.planner.space.SHARED_TRACE`)."""
    ticks = math.gcd(*(r.count for r in rows))
    return [r.replace(count=r.count // ticks) for r in rows]


def unit_rows(rows: list[Row], kind: int, stage: int, pp: int,
              uniform: bool = False) -> list[Row]:
    """The rows unit `kind` runs on `stage`: its branch's, less the first stage's
    embedding elsewhere than stage 0 and the head and loss elsewhere than the last
    (under a uniform plan every stage runs both)."""
    return _on_stage([r for r in rows if unit_of(r) == kind], stage, pp, uniform)


def _on_stage(rows: list[Row], stage: int, pp: int, uniform: bool) -> list[Row]:
    """`rows` (one unit's) less the first stage's embedding elsewhere than stage 0 and
    the head and loss elsewhere than the last (`unit_rows`)."""
    if uniform:
        return rows
    skip = ({scopes.PP_FIRST} if stage > 0 else set()) | (
        {scopes.PP_LAST} if stage < pp - 1 else set())
    return [r for r in rows if not skip.intersection(r.pp)] if skip else rows


def unit_of(row: Row) -> int | None:
    """The unit (FORWARD, BACKWARD) that runs `row`, None outside both. A row carrying
    both units' scopes is a transpose traced inside the forward unit's `jax.vjp` and
    applied by the backward one (the pullback's rows keep the forward's name, e.g. the
    reduce-scatter of a ZeRO-2 embedding's grad): it runs in the backward unit, where its
    phase is "bwd"."""
    units = [k for k, scope in UNITS.items() if scope in row.pp]
    if len(units) == 2:
        return BACKWARD if row.phase == "bwd" else FORWARD
    return units[0] if units else None


def _shifts(rows: list[Row]) -> tuple[list[Row], list[list[Row]]]:
    """(the tick's own rows but its shifts, [the activation shift's rows, the
    cotangent's]) of `rows` (a tick's rows outside its units): a shift is one of the
    tick's ppermutes, traced in that order (engine/parallel/pipeline.py `tick`), with
    the collectives that follow it: the all-gather over tp of its slices where the
    value is replicated over tp (engine/parallel/shifts.py), priced on tp's links;
    no cotangent shift without a backward."""
    own, shifts = [], []
    for r in rows:
        if r.primitive == "ppermute":
            shifts.append([r])
        elif shifts and r.kind == "collective" and COLLECTIVES.get(r.primitive):
            shifts[-1].append(r)
        else:
            own.append(r)
    assert len(shifts) <= 2, "a tick shifts x and the cotangent, nothing else"
    return own, shifts


def _parts(rows: list[Row], T: int, M: int, pp: int, hw, mesh_axes, prefetch: bool,
           uniform: bool, virtual: int = 1, sends=(), itemized: bool = True):
    """(unit_s [3, pp], the tick's own rows' seconds (buffer writes, each shift's), the
    rows outside the ticks' Prediction, the report's flat Prediction) of `rows` priced
    with (hw, mesh_axes, prefetch), module doc. With V chunks per stage a unit's first-
    and last-stage parts count 1/V: a chunk's mean. sends: the ticks each shift runs
    on ([T] bool each; default all). itemized False: the report's Prediction without
    its rows (`price.predict`)."""
    seconds = lambda rs: (predict(rs, hw, mesh_axes, prefetch, itemized=False).step_s  # noqa: E731
                          if rs else 0.0)
    outside, of_kind, writes, shifts, shown = _split(rows, T, M, sends)
    unit_s = np.zeros((len(UNITS), pp))
    alike: dict = {}  # stages between the first and the last run the same rows
    for kind in UNITS:
        for s in range(pp):
            same = (kind, uniform or s == 0, uniform or s == pp - 1)
            if same in alike:
                unit_s[kind, s] = alike[same]
                continue
            part = _on_stage(of_kind[kind], s, pp, uniform)  # of_kind: by `unit_of`
            unit_s[kind, s] = seconds(part)
            if virtual > 1 and not uniform:  # embedding, head: in one of a stage's V chunks
                body = [r for r in part if not EDGES & set(r.pp)]
                edge_s = unit_s[kind, s] - seconds(body)
                unit_s[kind, s] -= edge_s * (virtual - 1) / virtual
            alike[same] = unit_s[kind, s]
    own_s = (seconds(writes), [seconds(rs) for rs in shifts])
    out = predict(outside, hw, mesh_axes, prefetch, itemized=False)
    return unit_s, own_s, out, predict(shown, hw, mesh_axes, prefetch, itemized)


# the last ledger `_split` split: (rows, key, split); the planner prices one ledger in
# many axis orders and schedules, which split it alike
_LAST_SPLIT: list = [None]


def _split(rows: list[Row], T: int, M: int, sends=()) -> tuple:
    """(the rows outside the tick scan, those of each unit once {kind: rows}, the tick's
    own rows but its shifts (buffer writes), each shift's rows, the report's rows: every
    unit's M times, each shift's on the ticks it runs (`sends`, default all), the buffer
    writes T times, the rest as traced)."""
    key = (T, M, tuple(int(np.sum(s)) for s in sends))
    last = _LAST_SPLIT[0]
    if last is not None and last[0] is rows and last[1] == key:
        return last[2]
    inside = [r for r in rows if scopes.PP_TICK in r.pp]
    outside = [r for r in rows if scopes.PP_TICK not in r.pp]
    once = _once(inside)
    of_kind = {kind: [r for r in once if unit_of(r) == kind] for kind in UNITS}
    writes, shifts = _shifts([r for r in once if not set(UNITS.values()) & set(r.pp)])
    runs = key[2] or (T,) * len(shifts)
    shown = [r.replace(count=r.count * M) for r in once if set(UNITS.values()) & set(r.pp)]
    shown += [r.replace(count=r.count * T) for r in writes] + outside
    shown += [r.replace(count=r.count * n) for rs, n in zip(shifts, runs) for r in rs]
    split = (outside, of_kind, writes, shifts, shown)
    _LAST_SPLIT[0] = (rows, key, split)
    return split


def hidden_shift_T(the_plan: pipeline.Plan, backward_P, x_shift_s: float, hw) -> np.ndarray:
    """[T] seconds of each tick's forward shift hidden under its backward slot. The tick
    shifts the forward slot's output x to the next stage before the backward slot's
    cotangent (engine/parallel/pipeline.py `run`); nothing in the backward slot reads x,
    so with async collectives and XLA's latency-hiding scheduler (`hw.overlap`) the x
    shift runs while the tick's backward computes: min(x shift, the tick's slowest
    backward) of it hides, less the share the compute it hides under runs slower
    (`Hardware.hidden_comm_share`). The cotangent's shift follows the backward that
    makes it and is read by the next tick: exposed. On a shared host both are."""
    if not hw.overlap or not x_shift_s:
        return np.zeros(the_plan.ticks)
    none_P = np.zeros_like(backward_P)
    backward_T = the_plan.lockstep_T(none_P, backward_P, none_P)
    return np.minimum(x_shift_s, backward_T) * (1 - hw.hidden_comm_share)


def predict_pipeline(rows: list[Row], hw, mesh_axes, the_plan: pipeline.Plan,
                     prefetch: bool = False, itemized: bool = True) -> PipelinePrediction:
    """Price `rows` (the ledger of a pp step) tick by tick along `the_plan` (module doc).
    itemized False: its `prediction` without rows (`price.predict`)."""
    T, pp = the_plan.forward_TP.shape
    M = the_plan.units  # units of each kind per device: M x V
    sends = (the_plan.send_x_T, the_plan.send_ct_T)
    unit_s, (writes_s, shifts_s), out, flat = _parts(
        rows, T, M, pp, hw, mesh_axes, prefetch, the_plan.uniform, the_plan.virtual, sends,
        itemized)
    shift_T = np.full(T, writes_s) + sum(
        (s * np.asarray(runs, float) for s, runs in zip(shifts_s, sends)), np.zeros(T))
    work_TP = the_plan.work_TP(unit_s[FORWARD], unit_s[BACKWARD], unit_s[WEIGHT])
    lockstep_T = the_plan.lockstep_T(unit_s[FORWARD], unit_s[BACKWARD], unit_s[WEIGHT])
    units_T = (work_TP.mean(axis=1) if hw.shared_host and not the_plan.uniform
               else lockstep_T)
    hidden_T = (hidden_shift_T(the_plan, unit_s[BACKWARD], shifts_s[0] if shifts_s else 0.0, hw)
                * np.asarray(the_plan.send_x_T, float))  # the x shift, where it runs
    tick_s = units_T + shift_T - hidden_T
    bubble = 1.0 - work_TP.sum() / (pp * lockstep_T.sum()) if lockstep_T.sum() else 0.0
    step_s = float(tick_s.sum()) + out.step_s
    return PipelinePrediction(dataclasses.replace(flat, step_s=step_s), unit_s, tick_s,
                              writes_s + sum(shifts_s), out.step_s, float(bubble),
                              the_plan.bubble(), the_plan.uniform,
                              hidden_shift_s=float(hidden_T.sum()), shift_T=shift_T)


def predict_step(rows: list[Row], hw, layout, parallel, mapped_bytes: float = 0.0,
                 itemized: bool = True):
    """(`Prediction` of the step, its `PipelinePrediction` or None): `price.predict`,
    or with a pp axis `predict_pipeline` along the step's schedule. mapped_bytes: each
    device's temporaries mapped anew every step (engine/run/host.py `mapped_each_step`, known
    once the step is compiled), whose page faults the step pays (`price.fault_seconds`).
    itemized False: the Prediction's totals without its rows (`price.predict`)."""
    fault_s = fault_seconds(hw, layout.size, mapped_bytes)
    the_plan = pipeline.step_plan(layout, parallel)
    if the_plan is None:
        pred = predict(rows, hw, layout.mesh_axes(), parallel.prefetch, itemized)
        return with_faults(pred, fault_s), None
    pipe = predict_pipeline(rows, hw, layout.mesh_axes(), the_plan, parallel.prefetch,
                            itemized)
    pipe = dataclasses.replace(pipe, prediction=with_faults(pipe.prediction, fault_s))
    return pipe.prediction, pipe


# -- memory --------------------------------------------------------------------------------
