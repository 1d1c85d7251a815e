"""Pipeline parallelism over the `pp` axis: GPipe, 1F1B and interleaved as explicit per-tick work.

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
granularity, and the last stage runs the head and loss there only) in a stash of
`Plan.stash_slots` microbatches. GPipe (all forwards, then all backwards) needs M slots; 1F1B (stage s runs at most pp − s microbatches ahead of
its backwards) needs pp. Parameter grads are accumulated over the microbatches in the
scan carry and reduced once after it.

Interleaved (circular, `--pp-virtual V`): the model is cut into pp·V chunks of
N/(pp·V) layers and device s runs chunks s, s + pp, ..., so a microbatch goes round the
ring V times (the ring shift wraps: the last device feeds the first). The stacked blocks
are stored in that order (`storage_order`: device s's rows of the pp-sharded stack are
its chunks), a unit takes its chunk's rows, and `Trainer.store` / `unstore` map to and
from the model's order for `init` and checkpoints. Forwards run in GPipe order, pp
microbatches at a time chunk by chunk: (V·M + pp − 1) ticks of forwards then as many of
backwards, each unit 1/V of a stage's, so the idle fraction is (pp − 1)/(V·M + pp − 1)
when pp divides M, at the cost of V·M chunk inputs stashed per device.

A uniform plan (`uniform_units`: a tp or cp ring, whose collective-permutes inside a
unit every device must run at once) replaces the switch: each tick runs the forward
unit where any stage's row holds a forward, then the backward likewise, on every stage
(the predicates are the tick's, the same on every device), and a stage keeps what a
unit computed only where its row says so; the embedding and the head are computed on
every stage and selected.

The embedding runs on the first stage only and the head and loss on the last only
(`lax.cond` on the stage index; the other stages' grads of those params stay zero and
the all-reduce over pp after the scan sums the one nonzero copy). Computing them on
every stage and discarding the unused results (`jnp.where`) was slower on the CPU
(bench/results/2026-11-23-pipeline-branches-cpu.md).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import collectives
from engine.parallel.grads import spec_axes
from layers import scopes
from layers.axes import Axes

IDLE, FORWARD, BACKWARD = 0, 1, 2
FORWARDS, BACKWARDS, BOTH = 0, 1, 2  # a tick's phase under a uniform plan (Plan.phase_T)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a rule for each stage at each tick.

    prefer_backward: run a ready backward before a ready forward (1F1B) or a forward
                     before a backward (GPipe).
    one_ahead:       a stage holds at most pp − s forwarded microbatches whose backward
                     has not run (1F1B); else up to all of them (GPipe).
    circular:        the stage's layers are cut into `virtual` chunks and device s runs
                     chunks s, s + pp, ... (the model passes round the ring `virtual`
                     times); forwards in groups of pp microbatches, chunk by chunk.
    """

    name: str
    prefer_backward: bool
    one_ahead: bool
    doc: str
    circular: bool = False

    def in_flight(self, stage: int, pp: int, units: int) -> int:
        return pp - stage if self.one_ahead else units


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", prefer_backward=False, one_ahead=False,
             doc="every forward, then every backward: M microbatches stashed per stage"),
    Schedule("1f1b", prefer_backward=True, one_ahead=True,
             doc="one forward, one backward in the steady state: at most pp stashed"),
    Schedule("interleaved", prefer_backward=False, one_ahead=False, circular=True,
             doc="--pp-virtual V chunks per device, circular (device s runs chunks s, "
                 "s+pp, ...), GPipe order: bubble (pp-1)/(V·M+pp-1), V·M chunk inputs "
                 "stashed per device"),
)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule unrolled for pp devices, V chunks each, and M microbatches.

    kind_TP, microbatch_TP, chunk_TP: [T, pp] int32, the unit (IDLE / FORWARD /
    BACKWARD), its microbatch and its chunk v on the device (the model's chunk v·pp + s)
    for every tick and device. recv_x_TP, recv_ct_TP: [T, pp] the slot where the
    activation / cotangent arriving at the end of the tick is kept, -1 for none.
    *_slots: buffer sizes such that item (m, v) in slot (m·V + v) % slots never meets
    another item still held there."""

    kind_TP: np.ndarray
    microbatch_TP: np.ndarray
    stash_slots: int
    x_slots: int
    ct_slots: int
    chunk_TP: np.ndarray | None = None
    recv_x_TP: np.ndarray | None = None
    recv_ct_TP: np.ndarray | None = None
    virtual: int = 1
    uniform: bool = False

    @property
    def phase_T(self) -> np.ndarray:
        """[T] what the units of tick t are across the stages: FORWARDS (forwards and
        idles), BACKWARDS (backwards and idles) or BOTH (1F1B's mixed ticks)."""
        has_f = (self.kind_TP == FORWARD).any(axis=1)
        has_b = (self.kind_TP == BACKWARD).any(axis=1)
        return np.where(has_f & has_b, BOTH, np.where(has_b, BACKWARDS, FORWARDS)).astype(np.int32)

    @property
    def ticks(self) -> int:
        return self.kind_TP.shape[0]

    def bubble(self) -> float:
        """Fraction of stage-ticks idle."""
        return float(np.mean(self.kind_TP == IDLE))


def _slots(intervals: list[tuple[int, int, int, int]]) -> int:
    """The fewest slots K such that a device's items (s, i, written at the end of tick
    a, read in tick b) sharing slot i % K are never held at the same time."""
    for k in range(1, len(intervals) + 1):
        held: dict[tuple, list] = {}
        for s, m, a, b in intervals:
            if any(a < b2 and a2 < b for a2, b2 in held.get((s, m % k), [])):
                break
            held.setdefault((s, m % k), []).append((a, b))
        else:
            return k
    return max(len(intervals), 1)


def _orders(pp: int, M: int, V: int) -> tuple[list, list]:
    """(forward order, backward order) of one device's units (m, v): microbatches in
    groups of pp, each group through chunk 0, 1, ... forward and back down backward."""
    groups = [range(g, min(g + pp, M)) for g in range(0, M, pp)]
    fwd = [(m, v) for grp in groups for v in range(V) for m in grp]
    bwd = [(m, v) for grp in groups for v in reversed(range(V)) for m in grp]
    return fwd, bwd


def plan(schedule: Schedule, pp: int, microbatches: int, backward: bool = True,
         virtual: int = 1, uniform: bool = False) -> Plan:
    """Simulate `schedule` tick by tick: a unit runs once its input was sent at an
    earlier tick (the forward of the previous chunk; the backward of the next chunk,
    or on the model's last chunk its own forward). Forward only when not `backward`.
    `uniform`: every device runs the same program each tick (`run`)."""
    M, V = microbatches, virtual
    C = pp * V
    order_f, order_b = _orders(pp, M, V)
    fwd_tick: dict = {}
    bwd_tick: dict = {}
    next_f, next_b = [0] * pp, [0] * pp
    kinds, mbs, chunks = [], [], []
    t = 0
    while any(n < M * V for n in (next_b if backward else next_f)):
        kind, mb, ch = [IDLE] * pp, [0] * pp, [0] * pp
        for s in range(pp):
            limit = schedule.in_flight(s, pp, M * V) if backward else M * V
            can_f = can_b = False
            if next_f[s] < M * V:
                m, v = order_f[next_f[s]]
                c = v * pp + s
                can_f = ((c == 0 or fwd_tick.get((m, c - 1), t) < t)
                         and next_f[s] - next_b[s] < limit)
            if backward and next_b[s] < next_f[s]:
                mb_b, v_b = order_b[next_b[s]]
                c_b = v_b * pp + s
                can_b = (fwd_tick.get((mb_b, c_b), t) < t if c_b == C - 1
                         else bwd_tick.get((mb_b, c_b + 1), t) < t)
            if can_b and (schedule.prefer_backward or not can_f):
                kind[s], mb[s], ch[s] = BACKWARD, mb_b, v_b
            elif can_f:
                kind[s], mb[s], ch[s] = FORWARD, m, v
        for s in range(pp):
            if kind[s] == FORWARD:
                fwd_tick[(mb[s], ch[s] * pp + s)] = t
                next_f[s] += 1
            elif kind[s] == BACKWARD:
                bwd_tick[(mb[s], ch[s] * pp + s)] = t
                next_b[s] += 1
        kinds.append(kind)
        mbs.append(mb)
        chunks.append(ch)
        t += 1
    item = lambda m, c: m * V + c // pp  # noqa: E731  (the buffers' index of (m, chunk c))
    stash = [(c % pp, item(m, c), fwd_tick[m, c], bwd_tick[m, c]) for (m, c) in bwd_tick]
    xs = [(c % pp, item(m, c), fwd_tick[m, c - 1], fwd_tick[m, c]) for (m, c) in fwd_tick
          if c > 0]
    cts = [(c % pp, item(m, c), bwd_tick[m, c + 1], bwd_tick[m, c]) for (m, c) in bwd_tick
           if c < C - 1]
    x_slots = _slots(xs)
    ct_slots = _slots(cts) if backward else 0
    recv_x, recv_ct = np.full((t, pp), -1, np.int32), np.full((t, pp), -1, np.int32)
    for (m, c), a in fwd_tick.items():  # sent to the device of chunk c + 1
        if c < C - 1:
            recv_x[a, (c + 1) % pp] = item(m, c + 1) % x_slots
    for (m, c), a in bwd_tick.items():  # sent to the device of chunk c - 1
        if c > 0:
            recv_ct[a, (c - 1) % pp] = item(m, c - 1) % ct_slots
    return Plan(np.asarray(kinds, np.int32), np.asarray(mbs, np.int32),
                _slots(stash) if backward else 0, x_slots, ct_slots,
                np.asarray(chunks, np.int32), recv_x, recv_ct, V, uniform)


def uniform_units(layout, parallel) -> bool:
    """Whether the stages' units hold collective-permutes of their own (a ring over tp
    or cp), so that every device must run the same units' program each tick."""
    return any(comm == "ring" and layout.degree(role) > 1
               for role, comm in (("tp", parallel.tp_comm), ("cp", parallel.cp_comm)))


def step_plan(layout, parallel, backward: bool = True) -> Plan | None:
    """The table a training step under `layout` and `parallel` runs (forward only when
    not `backward`: evaluation); None without a pp axis."""
    pp = layout.degree("pp")
    if pp <= 1:
        return None
    return plan(SCHEDULES[parallel.pp_schedule], pp, parallel.microbatches, backward,
                parallel.pp_virtual, uniform_units(layout, parallel))


def storage_order(n_layers: int, pp: int, virtual: int) -> np.ndarray:
    """The model's layer kept at each row of the stacked blocks as a circular schedule
    stores them: device s (rows [s·N/pp, (s+1)·N/pp) of the pp-sharded stack) holds its
    chunks s, s + pp, ..., each N/(pp·V) consecutive layers. Identity for V = 1."""
    n = n_layers // (pp * virtual)
    return np.asarray([(v * pp + s) * n + j for s in range(pp) for v in range(virtual)
                       for j in range(n)])


def reorder_blocks(tree, index):
    """`tree` (params, grads or an optimizer state) with every leaf under 'blocks'
    taken at rows `index` of its first dim (numpy or jax arrays alike)."""
    def take(path, x):
        return x[index] if "['blocks']" in jax.tree_util.keystr(path) else x

    return jax.tree_util.tree_map_with_path(take, tree)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The model cut for a pipeline, each part per shard on params as the model sees
    them: embed(p, inputs [B, L]) -> x [B, L, D]; blocks(p, x, docs) -> x (this stage's
    layers; docs: the microbatch's packed documents, `layers.documents`, or None); head_loss(p, x, targets [B, L]) -> the loss of the microbatch, a scalar."""

    embed: Callable
    blocks: Callable
    head_loss: Callable


def _like(x: jax.Array, axes) -> jax.Array:
    return collectives.broadcast(x, tuple(axes))


def run(stages: Stages, params, inputs_MBL, targets_MBL, x_shape, x_axes, axes: Axes,
        the_plan: Plan, seen=lambda p: p, x_dtype=jnp.float32, docs_M=None):
    """The pipelined loss (mean over the microbatches), and with a backward plan the
    grads of `params` (summed over pp for params the stages share).

    params: as differentiated (`seen` makes the model's params of them); inputs,
    targets: [M, B, L] this device's microbatches; x_shape, x_axes, x_dtype: the
    residual stream's local shape [B, L, D], the axes it varies over and its dtype.
    docs_M: the microbatches' packed documents (`layers.documents.Documents` of [M, B, ...]
    arrays) or None; every stage indexes the ones of the microbatch it runs, as it
    indexes the inputs (nothing is sent)."""
    M, V = inputs_MBL.shape[0], the_plan.virtual
    pp, n = axes.pp, axes.pp_size
    stage = collectives.axis_index(pp)
    backward = the_plan.stash_slots > 0
    params = jax.tree.map(lambda w: collectives.broadcast(w, pp), params)
    x_axes = tuple(x_axes) + (pp,)
    kind_TP, mb_TP, v_TP, recv_x_TP, recv_ct_TP = (jnp.asarray(a) for a in (
        the_plan.kind_TP, the_plan.microbatch_TP, the_plan.chunk_TP, the_plan.recv_x_TP,
        the_plan.recv_ct_TP))

    def chunk(model_p, v):
        """The model's params with only chunk v of this device's stacked blocks (rows
        [v·N/(pp·V), (v+1)·N/(pp·V)) of its shard: `storage_order`)."""
        if V == 1:
            return model_p
        take = lambda w: lax.dynamic_index_in_dim(  # noqa: E731
            w.reshape(V, w.shape[0] // V, *w.shape[1:]), v, keepdims=False)
        return dict(model_p, blocks=jax.tree.map(take, model_p["blocks"]))

    uniform = the_plan.uniform

    def either(pred, f, g):
        """f() where `pred`, else g(): a `lax.cond`, or under a uniform plan both computed
        and one kept, so that every device runs the same collectives."""
        if not uniform:
            return lax.cond(pred, f, g)
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), f(), g())

    def unit(p, x_BLD, inputs_BL, targets_BL, v, with_loss=True, docs=None):
        """One chunk on one microbatch: (output x [B, L, D], the loss on the model's
        last chunk, else 0). Only the first chunk embeds, only the last runs the head
        and loss (not at all without `with_loss`)."""
        model_p = chunk(seen(p), v)
        first, last = (stage == 0) & (v == 0), (stage == n - 1) & (v == V - 1)

        def embed():
            with jax.named_scope(scopes.PP_FIRST):
                return _like(stages.embed(model_p, inputs_BL), x_axes)

        def head():
            with jax.named_scope(scopes.PP_LAST):
                return _like(stages.head_loss(model_p, y_BLD, targets_BL), (pp,))

        x_BLD = either(first, embed, lambda: x_BLD)
        y_BLD = _like(stages.blocks(model_p, x_BLD, docs), x_axes)
        if not with_loss:
            return y_BLD, loss0
        return y_BLD, either(last, head, lambda: loss0)

    zeros_x = _like(jnp.zeros(x_shape, x_dtype), x_axes)
    buffer = lambda k: jnp.broadcast_to(zeros_x, (max(k, 1), *x_shape))
    loss0 = _like(jnp.float32(0), (pp,))
    carry = dict(x=buffer(the_plan.x_slots), loss=loss0)
    if backward:
        carry.update(ct=buffer(the_plan.ct_slots), stash=buffer(the_plan.stash_slots),
                     grads=jax.tree.map(collectives.zeros_like, params))
    phase_T = jnp.asarray(the_plan.phase_T)

    def keep(active, new, old):
        """`new`, or where this stage's unit is not `active` (a unit a uniform plan runs
        only to keep the devices' programs alike) `old`."""
        if active is True:
            return new
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)

    @jax.named_scope(scopes.PP_TICK)
    def tick(c, t):
        kind, m, v = kind_TP[t, stage], mb_TP[t, stage], v_TP[t, stage]
        i = m * V + v  # the buffers' index of (microbatch, chunk)
        inputs_BL, targets_BL = inputs_MBL[m], targets_MBL[m]
        docs = None if docs_M is None else jax.tree.map(lambda x: x[m], docs_M)

        def idle(c):
            return zeros_x, zeros_x, c

        @jax.named_scope(scopes.PP_FORWARD)
        def forward(c, active=True):
            # training: the loss is taken in the backward, which recomputes the stage
            x_BLD = c["x"][i % the_plan.x_slots]
            y_BLD, loss = unit(params, x_BLD, inputs_BL, targets_BL, v,
                               with_loss=not backward, docs=docs)
            c = dict(c, loss=c["loss"] + keep(active, loss, 0.0))
            if backward:
                slot = i % the_plan.stash_slots
                c["stash"] = c["stash"].at[slot].set(keep(active, x_BLD, c["stash"][slot]))
            return y_BLD, zeros_x, c

        @jax.named_scope(scopes.PP_BACKWARD)
        def backward_(c, active=True):
            x_BLD = c["stash"][i % the_plan.stash_slots]
            last = (stage == n - 1) & (v == V - 1)
            ct_BLD = jnp.where(last, 0.0, c["ct"][i % the_plan.ct_slots])
            (_, loss), vjp = jax.vjp(lambda p, x: unit(p, x, inputs_BL, targets_BL, v,
                                                       docs=docs), params, x_BLD)
            d_params, dx_BLD = vjp((ct_BLD, _like(jnp.float32(1 / M), (pp,))))
            grads = jax.tree.map(jnp.add, c["grads"], d_params)
            return zeros_x, dx_BLD, dict(c, grads=keep(active, grads, c["grads"]),
                                         loss=c["loss"] + keep(active, loss, 0.0))

        if uniform:
            # a ring's permutes inside a unit must meet the same permutes on every
            # device: every stage runs each kind of unit the tick holds (the same
            # predicate on every device) and keeps only its own
            phase = phase_T[t]
            y_BLD, dx_BLD, c = lax.cond(phase != BACKWARDS,
                                        lambda c: forward(c, kind == FORWARD), idle, c)
            if backward:
                _, dx_BLD, c = lax.cond(phase != FORWARDS,
                                        lambda c: backward_(c, kind == BACKWARD), idle, c)
        else:
            branches = [idle, forward] + ([backward_] if backward else [])
            y_BLD, dx_BLD, c = lax.switch(kind, branches, c)
        # what the neighbours sent this tick, kept where the table says it is read
        # (the ring wraps: under a circular schedule the last device feeds the first)
        y_in = collectives.ring_shift(y_BLD, pp, 1)
        slot = recv_x_TP[t, stage]
        arrived, slot = slot >= 0, jnp.maximum(slot, 0)
        c = dict(c, x=c["x"].at[slot].set(jnp.where(arrived, y_in, c["x"][slot])))
        if backward:
            ct_in = collectives.ring_shift(dx_BLD, pp, -1)
            slot = recv_ct_TP[t, stage]
            arrived, slot = slot >= 0, jnp.maximum(slot, 0)
            c = dict(c, ct=c["ct"].at[slot].set(jnp.where(arrived, ct_in, c["ct"][slot])))
        return c, None

    carry, _ = lax.scan(tick, carry, jnp.arange(the_plan.ticks))
    loss = collectives.all_reduce(carry["loss"], pp) / M
    if not backward:
        return loss
    return loss, carry["grads"]


def reduce_shared(grads, specs, axes: Axes):
    """Sum over pp the grads of params every stage holds (embedding, head, final norm):
    each stage computed its own share (zero where it does not own the part)."""
    return jax.tree.map(lambda g, s: g if axes.pp in spec_axes(s)
                        else collectives.all_reduce(g, axes.pp), grads, specs)
