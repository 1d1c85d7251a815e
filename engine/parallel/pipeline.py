"""Pipeline parallelism over the `pp` axis: the schedules' tick tables run as one program.

Stage s owns layers [s·N/pp, (s+1)·N/pp) (the param table shards the stacked blocks
over pp) and scans them as `layers.block.blocks` does. The local batch [B, L+1] is cut
into M microbatches [B/M, L+1]. A schedule is a static table (engine/parallel/schedules.py):
at tick t stage s runs the forward of one item (microbatch, chunk) and the backward of
another, either slot possibly empty. Every stage runs the same program (`lax.scan` over
the ticks): a `lax.cond` on its forward slot, one on its backward slot, then it sends
its forward output x [B/M, L, D] to stage s+1 and its input cotangent to stage s−1 with
one `ppermute` each (`collectives.ring_shift`); what arrives waits in a small buffer
until the table says it is used. A shift runs only on the ticks where some stage sends
(`Plan.send_x_T`, `send_ct_T`): a `lax.cond` on the tick, which every device takes
alike, so every device runs the same collectives in the same order; on a shared CPU
host a ppermute's rendezvous costs about a millisecond even when it moves nothing
(bench/results/2026-11-28-pipeline-cpu.md).

This module runs the ticks; the units a tick's slots run are engine/parallel/
pipeline_units.py's, and the buffers they leave each other between ticks (the slots
and the stash) engine/parallel/pipeline_stash.py's.

The backward of a unit is the vjp of the unit, run at its tick. The forward unit runs
`jax.vjp` and stashes its residuals (`stash_residuals`) in the slot the table gives its
stage and item (`Plan.stash_slot_PI`; `Plan.stash_slots` slots, as many as the stage
holds at once), and the backward applies them, so no forward runs twice: what the
blocks' remat policy saves per layer (`full`: each layer's input, as Megatron-LM's
pipelines keep; `dots`: also the named matmul outputs; `none`: everything). The last
chunk takes the head's vjp apart and keeps its residuals in the last stage's own slots
(`Plan.head_slots`). The residuals are the leaves of the `jax.vjp` pullbacks (their
primal params, made outside the vjp by `own`, are not stashed: the backward puts the
live ones back; nor what is made of the params alone, the weights cast or gathered as
the unit uses them: the backward rebuilds it, `pipeline_stash.params_only`). Under a cp
ring the stash holds each unit's input instead and the backward recomputes the unit
under `jax.vjp`; zb1 keeps the head's residuals in its units' stash.

Parameter grads are accumulated over the microbatches in the scan carry and reduced
once after it: the blocks' as differentiated (an interleaved unit's into its chunk's
rows), the others' as the model sees them, made once before the ticks (`seen`'s
transpose, ZeRO-2's fsdp reduce-scatter, runs once after them).

A split schedule (zb1) runs each backward as two units (engine/parallel/backward_split.py
cuts the pullback's jaxpr by dependency): B, at the backward's tick, gives the input
cotangent (and, where the unit's input is stashed, the loss); W, in a third slot after
the tick's shifts, at B's tick or a later one, the params' grads. B leaves W what W
reads of it (the crossing values, and the cotangent B received where W reads it) in
`Plan.w_slots` slots; the residuals (or the unit's input) W reads stay in the unit's
stash slot, which the table holds until W's tick.

Interleaved (circular, `--pp-virtual V`): the model is cut into pp·V chunks of
N/(pp·V) layers and device s runs chunks s, s + pp, ..., so a microbatch goes round the
ring V times (the ring shift wraps: the last device feeds the first). The stacked blocks
are stored in that order (`storage_order`: device s's rows of the pp-sharded stack are
its chunks), a unit takes its chunk's rows, and `Trainer.store` / `unstore` map to and
from the model's order for `init` and checkpoints.

A uniform plan (`uniform_units`: a tp or cp ring, whose collective-permutes inside a
unit every device must run at once) runs each slot's unit on every stage where any
stage's slot holds one (the predicates are the tick's, the same on every device), and a
stage keeps what a unit computed only where its own slot says so; the embedding and the
head are computed on every stage and selected.

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
from jax import lax

import collectives
from engine.parallel import pipeline_stash, shifts
from engine.parallel.grads import spec_axes
from engine.parallel.pipeline_units import Units
from engine.parallel.schedules import (  # noqa: F401  (the schedules' names, re-exported)
    NONE,
    SCHEDULES,
    Plan,
    Schedule,
    plan,
    storage_order,
)
from layers import scopes
from layers.axes import Axes


def stash_residuals(layout, parallel) -> bool:
    """Whether a pipeline stashes the units' vjp residuals (under every remat policy)
    rather than their inputs, recomputed in the backward. Under a cp ring the inputs:
    the pullback replayed in the backward unit fails XLA's verifier there (a broadcast in
    the head's norm, jax 0.10.2)."""
    return not (parallel.cp_comm == "ring" and layout.degree("cp") > 1)


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


def reorder_blocks(tree, index):
    """`tree` (params, grads or an optimizer state) with every leaf under 'blocks'
    taken at rows `index` of its first dim (numpy or jax arrays alike)."""
    def take(path, x):
        return x[index] if "['blocks']" in jax.tree_util.keystr(path) else x

    return jax.tree_util.tree_map_with_path(take, tree)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The model cut for a pipeline, each part per shard on params as the model sees
    them: embed(p, inputs [B, L]) -> x [B, L, D]; blocks(p, x, docs) -> (x, aux): this
    chunk's layers (docs: the microbatch's packed documents, `layers.documents`, or
    None) and their share of the microbatch's auxiliary loss (a scalar: the router
    losses of a mixture of experts, `layers.moe.router_losses`), None without one;
    head_loss(p, x, targets [B, L]) -> the loss of the microbatch, a scalar."""

    embed: Callable
    blocks: Callable
    head_loss: Callable


def run(stages: Stages, params, inputs_MBL, targets_MBL, x_shape, x_axes, axes: Axes,
        the_plan: Plan, seen=lambda p, rows=None: p, x_dtype=jnp.float32, docs_M=None,
        residuals: bool = False):
    """The pipelined loss (mean over the microbatches), and with a backward plan the
    grads of `params` (summed over pp for params the stages share).

    params: as differentiated (`seen(p, rows)` makes the model's params of them, `rows`
    taking a chunk's rows of a stored stacked leaf: `ZeroLevel.differentiate`); inputs,
    targets: [M, B, L] this device's microbatches; x_shape, x_axes, x_dtype: the
    residual stream's local shape [B, L, D], the axes it varies over and its dtype.
    docs_M: the microbatches' packed documents (`layers.documents.Documents` of [M, B, ...]
    arrays) or None; every stage indexes the ones of the microbatch it runs, as it
    indexes the inputs (nothing is sent). residuals: stash the units' vjp residuals
    instead of their inputs (`stash_residuals`)."""
    u = Units(stages, params, inputs_MBL, targets_MBL, x_shape, x_axes, axes, the_plan,
              seen, x_dtype, docs_M, residuals)
    M, pp, stage, backward, split = u.M, u.pp, u.stage, u.backward, u.split
    fwd_TP, bwd_TP, recv_x_TP, recv_ct_TP = (jnp.asarray(a) for a in (
        the_plan.forward_TP, the_plan.backward_TP, the_plan.recv_x_TP, the_plan.recv_ct_TP))
    any_f_T, any_b_T = jnp.asarray(the_plan.any_forward_T), jnp.asarray(the_plan.any_backward_T)
    send_x_T, send_ct_T = jnp.asarray(the_plan.send_x_T), jnp.asarray(the_plan.send_ct_T)
    if split:
        wgt_TP, any_w_T = jnp.asarray(the_plan.weight_TP), jnp.asarray(the_plan.any_weight_T)
    uniform, zeros_x = the_plan.uniform, u.zeros_x
    forward, backward_, weight_ = u.forward, u.backward_, u.weight_
    carry = pipeline_stash.initial(u, fwd_TP, bwd_TP)

    def slot_unit(c, unit_fn, item, anywhere):
        """Run `unit_fn` on `item` where this stage's slot holds one (NONE: idle), or
        under a uniform plan on every stage where `anywhere` (kept where it holds one)."""
        idle = lambda c: (zeros_x, c)  # noqa: E731
        on = item != NONE
        if uniform:
            return lax.cond(anywhere, lambda c: unit_fn(c, jnp.maximum(item, 0), on), idle, c)
        return lax.cond(on, lambda c: unit_fn(c, item), idle, c)

    x_tp = None if axes.tp in x_axes else axes.tp  # x replicated over tp: sent in slices

    def shift(sends, v_BLD, direction):
        """`v` sent one stage along the ring (`direction` +1: to the next stage), where
        some stage sends (`sends`, alike on every device, which so run the same
        collectives in the same order; elsewhere `v` comes back, unread). Replicated over
        tp, 1/tp from each tp rank, gathered over tp on arrival (engine/parallel/shifts.py)."""
        return lax.cond(sends, lambda v: shifts.stage_shift(v, pp, direction, x_tp),
                        lambda v: v, v_BLD)

    @jax.named_scope(scopes.PP_TICK)
    def tick(c, t):
        y_BLD, c = slot_unit(c, forward, fwd_TP[t, stage], any_f_T[t])
        if backward:
            dx_BLD, c = slot_unit(c, backward_, bwd_TP[t, stage], any_b_T[t])
        # what the neighbours sent this tick, kept where the table says it is read
        # (the ring wraps: under a circular schedule the last device feeds the first)
        y_in = shift(send_x_T[t], y_BLD, 1)
        slot = recv_x_TP[t, stage]
        arrived, slot = slot >= 0, jnp.maximum(slot, 0)
        c = dict(c, x=c["x"].at[slot].set(jnp.where(arrived, y_in, c["x"][slot])))
        if backward:
            ct_in = shift(send_ct_T[t], dx_BLD, -1)
            slot = recv_ct_TP[t, stage]
            arrived, slot = slot >= 0, jnp.maximum(slot, 0)
            c = dict(c, ct=c["ct"].at[slot].set(jnp.where(arrived, ct_in, c["ct"][slot])))
        if split:
            _, c = slot_unit(c, weight_, wgt_TP[t, stage], any_w_T[t])
        return c, None

    carry, _ = lax.scan(tick, carry, jnp.arange(the_plan.ticks))
    loss = collectives.all_reduce(carry["loss"], pp) / M
    if not backward:
        return loss
    blocks, rest = carry["grads"]
    rest, = u.rest_transpose(jax.tree.map(lambda g, m: g.astype(m.dtype), rest, u.rest_model))
    return loss, dict(rest, blocks=blocks)


def reduce_shared(grads, specs, axes: Axes):
    """Sum over pp the grads of params every stage holds (embedding, head, final norm):
    each stage computed its own share (zero where it does not own the part)."""
    return jax.tree.map(lambda g, s: g if axes.pp in spec_axes(s)
                        else collectives.all_reduce(g, axes.pp), grads, specs)
