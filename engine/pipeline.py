"""Pipeline parallelism over the `pp` axis: GPipe and 1F1B as explicit per-tick work.

Stage s owns layers [s·N/pp, (s+1)·N/pp) (the param table shards the stacked blocks
over pp) and scans them as `layers.block.blocks` does. The local batch [B, L+1] is cut
into M microbatches [B/M, L+1]. A schedule is a static table, built on the host by
`plan`: at tick t stage s does one unit of work, idle, the forward of microbatch m or
the backward of microbatch m. Every stage runs the same program (`lax.scan` over the
ticks), picks its unit with `lax.switch` on its row of the table, then sends its
forward output x [B/M, L, D] to stage s+1 and its input cotangent to stage s−1 with one
`ppermute` each (`collectives.ring_shift`); what arrives waits in a small buffer until
the table says it is used.

The backward of a microbatch is its own `jax.vjp` of the stage, run at its tick, not
the transpose of a forward scan: the forward stores the stage's input x (the stage's
residual; the stage forward is recomputed under the vjp, like remat at stage
granularity, and the last stage runs the head and loss there only) in a stash of `Plan.stash_slots` microbatches. GPipe (all forwards, then
all backwards) needs M slots; 1F1B (stage s runs at most pp − s microbatches ahead of
its backwards) needs pp. Parameter grads are accumulated over the microbatches in the
scan carry and reduced once after it.

The embedding runs on the first stage only and the head and loss on the last only
(`lax.cond` on the stage index; the other stages' grads of those params stay zero and
the all-reduce over pp after the scan sums the one nonzero copy). Computing them on
every stage and discarding the unused results (`jnp.where`) was slower on this CPU:
`loss_and_grads` of the small preset with V=8192, pp4xfsdp2, batch 16, seq 128, M=4, 1f1b
took 9.0 s (median of 6) with the branches against 15.5 s computing on all stages
(2 cores shared with other jobs, so only the ratio means much).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import collectives
from engine import optim
from layers import scopes
from layers.axes import Axes

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a rule for each stage at each tick.

    prefer_backward: run a ready backward before a ready forward (1F1B) or a forward
                     before a backward (GPipe).
    one_ahead:       a stage holds at most pp − s forwarded microbatches whose backward
                     has not run (1F1B); else up to M (GPipe).
    """

    name: str
    prefer_backward: bool
    one_ahead: bool
    doc: str

    def in_flight(self, stage: int, pp: int, microbatches: int) -> int:
        return pp - stage if self.one_ahead else microbatches


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", prefer_backward=False, one_ahead=False,
             doc="every forward, then every backward: M microbatches stashed per stage"),
    Schedule("1f1b", prefer_backward=True, one_ahead=True,
             doc="one forward, one backward in the steady state: at most pp stashed"),
)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule unrolled for pp stages and M microbatches.

    kind_TP, microbatch_TP: [T, pp] int32, the unit (IDLE / FORWARD / BACKWARD) and its
    microbatch for every tick and stage. *_slots: buffer sizes such that microbatch m
    in slot m % slots never meets another microbatch still held there."""

    kind_TP: np.ndarray
    microbatch_TP: np.ndarray
    stash_slots: int
    x_slots: int
    ct_slots: int

    @property
    def ticks(self) -> int:
        return self.kind_TP.shape[0]

    def bubble(self) -> float:
        """Fraction of stage-ticks idle."""
        return float(np.mean(self.kind_TP == IDLE))


def _slots(intervals: list[tuple[int, int, int, int]]) -> int:
    """The fewest slots K such that a stage's items (s, m, written at the end of tick a,
    read in tick b) sharing slot m % K are never held at the same time."""
    for k in range(1, len(intervals) + 1):
        held: dict[tuple, list] = {}
        for s, m, a, b in intervals:
            if any(a < b2 and a2 < b for a2, b2 in held.get((s, m % k), [])):
                break
            held.setdefault((s, m % k), []).append((a, b))
        else:
            return k
    return max(len(intervals), 1)


def plan(schedule: Schedule, pp: int, microbatches: int, backward: bool = True) -> Plan:
    """Simulate `schedule` tick by tick: a unit runs once its input was sent at an
    earlier tick (the forward of the previous stage; the backward of the next stage, or
    on the last stage its own forward). Forward only when not `backward`."""
    M = microbatches
    fwd_tick: dict = {}
    bwd_tick: dict = {}
    next_f, next_b = [0] * pp, [0] * pp
    kinds, mbs = [], []
    t = 0
    while any(n < M for n in (next_b if backward else next_f)):
        kind, mb = [IDLE] * pp, [0] * pp
        for s in range(pp):
            m, k = next_f[s], next_b[s]
            limit = schedule.in_flight(s, pp, M) if backward else M
            can_f = (m < M and (s == 0 or fwd_tick.get((m, s - 1), t) < t)
                     and m - k < limit)
            can_b = backward and k < m and (
                fwd_tick[(k, s)] < t if s == pp - 1 else bwd_tick.get((k, s + 1), t) < t)
            if can_b and (schedule.prefer_backward or not can_f):
                kind[s], mb[s] = BACKWARD, k
            elif can_f:
                kind[s], mb[s] = FORWARD, m
        for s in range(pp):
            if kind[s] == FORWARD:
                fwd_tick[(mb[s], s)] = t
                next_f[s] += 1
            elif kind[s] == BACKWARD:
                bwd_tick[(mb[s], s)] = t
                next_b[s] += 1
        kinds.append(kind)
        mbs.append(mb)
        t += 1
    stash = [(s, m, fwd_tick[m, s], bwd_tick[m, s]) for (m, s) in bwd_tick]
    xs = [(s, m, fwd_tick[m, s - 1], fwd_tick[m, s]) for (m, s) in fwd_tick if s > 0]
    cts = [(s, m, bwd_tick[m, s + 1], bwd_tick[m, s]) for (m, s) in bwd_tick if s < pp - 1]
    return Plan(np.asarray(kinds, np.int32), np.asarray(mbs, np.int32),
                _slots(stash) if backward else 0, _slots(xs), _slots(cts) if backward else 0)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The model cut for a pipeline, each part per shard on params as the model sees
    them: embed(p, inputs [B, L]) -> x [B, L, D]; blocks(p, x) -> x (this stage's
    layers); head_loss(p, x, targets [B, L]) -> the loss of the microbatch, a scalar."""

    embed: Callable
    blocks: Callable
    head_loss: Callable


def _like(x: jax.Array, axes) -> jax.Array:
    return collectives.broadcast(x, tuple(axes))


def run(stages: Stages, params, inputs_MBL, targets_MBL, x_shape, x_axes, axes: Axes,
        the_plan: Plan, seen=lambda p: p):
    """The pipelined loss (mean over the microbatches), and with a backward plan the
    grads of `params` (summed over pp for params the stages share).

    params: as differentiated (`seen` makes the model's params of them); inputs,
    targets: [M, B, L] this device's microbatches; x_shape, x_axes: the residual
    stream's local shape [B, L, D] and the axes it varies over."""
    M = inputs_MBL.shape[0]
    pp, n = axes.pp, axes.pp_size
    stage = collectives.axis_index(pp)
    first, last = stage == 0, stage == n - 1
    backward = the_plan.stash_slots > 0
    params = jax.tree.map(lambda w: collectives.broadcast(w, pp), params)
    x_axes = tuple(x_axes) + (pp,)
    kind_TP, mb_TP = jnp.asarray(the_plan.kind_TP), jnp.asarray(the_plan.microbatch_TP)

    def unit(p, x_BLD, inputs_BL, targets_BL, with_loss=True):
        """One stage on one microbatch: (output x [B, L, D], the loss on the last stage,
        else 0). Only the first stage embeds, only the last runs the head and loss
        (not at all without `with_loss`)."""
        model_p = seen(p)

        def embed():
            with jax.named_scope(scopes.PP_FIRST):
                return _like(stages.embed(model_p, inputs_BL), x_axes)

        def head():
            with jax.named_scope(scopes.PP_LAST):
                return _like(stages.head_loss(model_p, y_BLD, targets_BL), (pp,))

        x_BLD = lax.cond(first, embed, lambda: x_BLD)
        y_BLD = _like(stages.blocks(model_p, x_BLD), x_axes)
        if not with_loss:
            return y_BLD, loss0
        return y_BLD, lax.cond(last, head, lambda: loss0)

    zeros_x = _like(jnp.zeros(x_shape, jnp.float32), x_axes)
    buffer = lambda k: jnp.broadcast_to(zeros_x, (max(k, 1), *x_shape))
    loss0 = _like(jnp.float32(0), (pp,))
    carry = dict(x=buffer(the_plan.x_slots), loss=loss0)
    if backward:
        carry.update(ct=buffer(the_plan.ct_slots), stash=buffer(the_plan.stash_slots),
                     grads=jax.tree.map(collectives.zeros_like, params))

    @jax.named_scope(scopes.PP_TICK)
    def tick(c, t):
        kind, m = kind_TP[t, stage], mb_TP[t, stage]
        inputs_BL, targets_BL = inputs_MBL[m], targets_MBL[m]

        def idle(c):
            return zeros_x, zeros_x, c

        @jax.named_scope(scopes.PP_FORWARD)
        def forward(c):
            # training: the loss is taken in the backward, which recomputes the stage
            x_BLD = c["x"][m % the_plan.x_slots]
            y_BLD, loss = unit(params, x_BLD, inputs_BL, targets_BL, with_loss=not backward)
            c = dict(c, loss=c["loss"] + loss)
            if backward:
                c["stash"] = c["stash"].at[m % the_plan.stash_slots].set(x_BLD)
            return y_BLD, zeros_x, c

        @jax.named_scope(scopes.PP_BACKWARD)
        def backward_(c):
            x_BLD = c["stash"][m % the_plan.stash_slots]
            ct_BLD = jnp.where(last, 0.0, c["ct"][m % the_plan.ct_slots])
            (_, loss), vjp = jax.vjp(lambda p, x: unit(p, x, inputs_BL, targets_BL),
                                     params, x_BLD)
            d_params, dx_BLD = vjp((ct_BLD, _like(jnp.float32(1 / M), (pp,))))
            return zeros_x, dx_BLD, dict(c, grads=jax.tree.map(jnp.add, c["grads"], d_params),
                                         loss=c["loss"] + loss)

        branches = [idle, forward] + ([backward_] if backward else [])
        y_BLD, dx_BLD, c = lax.switch(kind, branches, c)
        # what the neighbours sent this tick, kept where the table says it is read
        y_in = collectives.ring_shift(y_BLD, pp, 1)
        prev = jnp.maximum(stage - 1, 0)
        keep = (stage > 0) & (kind_TP[t, prev] == FORWARD)
        slot = mb_TP[t, prev] % the_plan.x_slots
        c = dict(c, x=c["x"].at[slot].set(jnp.where(keep, y_in, c["x"][slot])))
        if backward:
            ct_in = collectives.ring_shift(dx_BLD, pp, -1)
            nxt = jnp.minimum(stage + 1, n - 1)
            keep = (stage < n - 1) & (kind_TP[t, nxt] == BACKWARD)
            slot = mb_TP[t, nxt] % the_plan.ct_slots
            c = dict(c, ct=c["ct"].at[slot].set(jnp.where(keep, ct_in, c["ct"][slot])))
        return c, None

    carry, _ = lax.scan(tick, carry, jnp.arange(the_plan.ticks))
    loss = collectives.all_reduce(carry["loss"], pp) / M
    if not backward:
        return loss
    return loss, carry["grads"]


def reduce_shared(grads, specs, axes: Axes):
    """Sum over pp the grads of params every stage holds (embedding, head, final norm):
    each stage computed its own share (zero where it does not own the part)."""
    return jax.tree.map(lambda g, s: g if axes.pp in optim.spec_axes(s)
                        else collectives.all_reduce(g, axes.pp), grads, specs)
