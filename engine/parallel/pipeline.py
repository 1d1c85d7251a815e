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

The backward of a unit is the vjp of the unit, run at its tick. The forward unit runs
`jax.vjp` and stashes its residuals (`stash_residuals`) in `Plan.stash_slots` slots, and
the backward applies them, so no forward runs twice: what the blocks' remat policy saves
per layer (`full`: each layer's input, as Megatron-LM's pipelines keep; `dots`: also the
named matmul outputs; `none`: everything). The last chunk takes the head's vjp apart
and keeps its residuals in the last stage's own slots (`Plan.head_slots`). The
residuals are the leaves of the `jax.vjp` pullbacks (their primal params, made outside
the vjp by `own`, are not stashed: the backward puts the live ones back). Under a cp
ring the stash holds each unit's input instead and the backward recomputes the unit
under `jax.vjp`; zb1 keeps the head's residuals in its units' stash.

Parameter grads are accumulated over the microbatches in the scan carry and reduced
once after it: the blocks' as differentiated (an interleaved unit's into its chunk's
rows), the others' as the model sees them, made once before the ticks (`seen`'s
transpose, ZeRO-2's fsdp reduce-scatter, runs once after them).

A split schedule (zb1) runs each backward as two units (engine/parallel/backward_split.py
cuts the pullback's jaxpr by dependency): B, at the backward's tick, gives the input
cotangent (and, where the unit's input is stashed, the loss); W, in a third slot at a
later tick, the params' grads. B leaves W what W reads of it (the crossing values) and
the inputs W reads itself (residuals, or the unit's input) in `Plan.w_slots` slots.

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
from engine.parallel import backward_split, shifts
from engine.parallel.grads import spec_axes
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


def _like(x: jax.Array, axes) -> jax.Array:
    return collectives.broadcast(x, tuple(axes))


def _pullback_parts(f_vjp, params):
    """(leaves, structure) of what a `jax.vjp` pullback of f(params, x) holds but the
    params themselves: the residuals, and x where the backward needs it. The pullback is
    a pytree (public since `jax.vjp` returns one); a leaf that is one of `params`' own
    leaves is left out and put back live by `_pullback`."""
    leaves, treedef = jax.tree.flatten(f_vjp)
    param_at = {id(leaf): j for j, leaf in enumerate(jax.tree.leaves(params))}
    where = tuple(param_at.get(id(leaf)) for leaf in leaves)
    return [leaf for leaf, j in zip(leaves, where) if j is None], (treedef, where)


def _pullback(structure, leaves, params):
    """The pullback of `structure` (`_pullback_parts`, traced by the forward unit) with
    its residuals `leaves` and the live `params` where it held the forward's."""
    treedef, where = structure
    param_leaves, stashed = jax.tree.leaves(params), iter(leaves)
    return jax.tree.unflatten(treedef, [next(stashed) if j is None else param_leaves[j]
                                        for j in where])


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
    M, V = inputs_MBL.shape[0], the_plan.virtual
    pp, n = axes.pp, axes.pp_size
    stage = collectives.axis_index(pp)
    backward = the_plan.stash_slots > 0
    residuals = residuals and backward
    params = jax.tree.map(lambda w: collectives.broadcast(w, pp), params)
    x_axes = tuple(x_axes) + (pp,)
    fwd_TP, bwd_TP, recv_x_TP, recv_ct_TP = (jnp.asarray(a) for a in (
        the_plan.forward_TP, the_plan.backward_TP, the_plan.recv_x_TP, the_plan.recv_ct_TP))
    any_f_T, any_b_T = jnp.asarray(the_plan.any_forward_T), jnp.asarray(the_plan.any_backward_T)
    send_x_T, send_ct_T = jnp.asarray(the_plan.send_x_T), jnp.asarray(the_plan.send_ct_T)
    split = backward and the_plan.split
    if split:
        wgt_TP, any_w_T = jnp.asarray(the_plan.weight_TP), jnp.asarray(the_plan.any_weight_T)
    uniform = the_plan.uniform
    apart = residuals and not split  # the head's residuals out of the stash (below)

    def rows(v):
        """Chunk v's rows of a stacked leaf [N/pp, ...] -> [N/(pp·V), ...] (rows
        [v·N/(pp·V), (v+1)·N/(pp·V)) of its shard: `storage_order`)."""
        return lambda w: lax.dynamic_slice_in_dim(w, v * (w.shape[0] // V), w.shape[0] // V)

    # The params outside the stacked blocks as the model sees them, made once before the
    # ticks: the units differentiate these, their grads sum over the microbatches (f32)
    # and `seen`'s transpose (ZeRO-2's fsdp reduce-scatter) runs once after the ticks.
    rest_diff = {k: w for k, w in params.items() if k != "blocks"}
    rest_model, rest_transpose = jax.vjp(lambda rest: {
        k: w for k, w in seen(dict(rest, blocks=params["blocks"])).items() if k != "blocks"},
        rest_diff)

    def own(p, i):
        """What item i's unit takes its `jax.vjp` over, (blocks, pins, rest): blocks, the
        rows of `p`'s stacked blocks its chunk holds; pins, the chunk's rows of the stored
        leaves `seen` reads beside them (ZeRO-2's whole weights; none under the other
        levels); rest, the other params as the model sees them. All made outside the vjp:
        primals, not stashed residuals; the blocks' cotangent is chunk-sized."""
        if V == 1:
            return p["blocks"], [], rest_model
        pins = []
        seen(p, lambda w: pins.append(rows(i % V)(w)) or pins[-1])  # only the slices live
        return jax.tree.map(rows(i % V), p["blocks"]), pins, rest_model

    def add_own(grads, d_own, i, active=True):
        """`grads` (blocks', rest's) plus unit i's `d_own` (`own`'s shapes; zero where not
        `active`): the blocks' into their chunk's rows only, the rest's in f32."""
        d_blocks, _, d_rest = keep(active, d_own, jax.tree.map(jnp.zeros_like, d_own))
        blocks, rest = grads
        rest = jax.tree.map(lambda g, d: g + d.astype(g.dtype), rest, d_rest)
        if V == 1:
            return jax.tree.map(jnp.add, blocks, d_blocks), rest

        def add_rows(g, d):
            start = (i % V) * d.shape[0]
            return lax.dynamic_update_slice_in_dim(
                g, lax.dynamic_slice_in_dim(g, start, d.shape[0]) + d, start, 0)

        return jax.tree.map(add_rows, blocks, d_blocks), rest

    def either(pred, f, g):
        """f() where `pred`, else g(): a `lax.cond`, or under a uniform plan both computed
        and one kept, so that every device runs the same collectives."""
        if not uniform:
            return lax.cond(pred, f, g)
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), f(), g())

    def unit(p, x_BLD, i, with_loss=True, with_head=True):
        """Item i (microbatch i // V through chunk i % V) from its input x [B, L, D] under
        `own(params, i)` p:
        (output x [B, L, D], its share of the microbatch's loss: the head's on the
        model's last chunk, plus in training the chunk's auxiliary loss). Only the first
        chunk embeds, only the last runs the head and loss (no loss at all without
        `with_loss`; no head's without `with_head`: `head_of` runs it apart)."""
        m, v = i // V, i % V
        inputs_BL, targets_BL = inputs_MBL[m], targets_MBL[m]
        docs = None if docs_M is None else jax.tree.map(lambda x: x[m], docs_M)
        blocks, pins, rest = p
        pinned = iter(pins)
        stored = dict(rest_diff, blocks=blocks)  # the rest's `seen` here is dead code
        blocks = (seen(stored) if V == 1 else seen(stored, lambda w: next(pinned)))["blocks"]
        model_p = dict(rest, blocks=blocks)
        first, last = (stage == 0) & (v == 0), (stage == n - 1) & (v == V - 1)

        def embed():
            with jax.named_scope(scopes.PP_FIRST):
                return _like(stages.embed(model_p, inputs_BL), x_axes)

        def head():
            with jax.named_scope(scopes.PP_LAST):
                return _like(stages.head_loss(model_p, y_BLD, targets_BL), (pp,))

        x_BLD = either(first, embed, lambda: x_BLD)
        y_BLD, aux = stages.blocks(model_p, x_BLD, docs)
        y_BLD = _like(y_BLD, x_axes)
        if not with_loss:
            return y_BLD, loss0
        loss = either(last, head, lambda: loss0) if with_head else loss0
        if aux is None or not backward:  # evaluation: the cross-entropy alone
            return y_BLD, loss
        return y_BLD, loss + _like(aux, (pp,))

    def head_of(rest, y_BLD, i):
        """The head's loss of item i's microbatch from the last chunk's output y."""
        with jax.named_scope(scopes.PP_LAST):
            return _like(stages.head_loss(rest, y_BLD, targets_MBL[i // V]), (pp,))

    zeros_x = _like(jnp.zeros(x_shape, x_dtype), x_axes)
    buffer = lambda k: jnp.broadcast_to(zeros_x, (max(k, 1), *x_shape))  # noqa: E731
    loss0 = _like(jnp.float32(0), (pp,))
    seed = _like(jnp.float32(1 / M), (pp,))  # d(mean loss) / d(a microbatch's loss)
    traced = {}  # the structure of the forward's pullback, for the backward
    if residuals:
        vary = []  # the axes each residual varies over, read while tracing

        def parts(p, x_BLD, i):  # i traced, as the forward unit's item is
            q = own(p, i)
            leaves, traced["structure"] = _pullback_parts(
                jax.vjp(lambda q, x: unit(q, x, i, with_head=not apart), q, x_BLD)[1], q)
            vary.extend(tuple(collectives.varying_axes(r)) for r in leaves)
            return leaves

        shapes = jax.eval_shape(parts, params, zeros_x, fwd_TP[0, 0])
        stash = [_like(jnp.zeros((the_plan.stash_slots, *s.shape), s.dtype), a)
                 for s, a in zip(shapes, vary)]
    else:
        stash = buffer(the_plan.stash_slots)
    carry = dict(x=buffer(the_plan.x_slots), loss=loss0)
    if apart:  # the head's residuals: the last stage's head slots, not every stash slot
        K_head, head_vary = the_plan.head_slots, []

        def head_parts(y_BLD, i):
            leaves, traced["head"] = _pullback_parts(
                jax.vjp(lambda r, y: head_of(r, y, i), rest_model, y_BLD)[1], rest_model)
            head_vary.extend(tuple(collectives.varying_axes(r)) for r in leaves)
            return leaves

        carry["head"] = [_like(jnp.zeros((K_head, *h.shape), h.dtype), a) for h, a in zip(
            jax.eval_shape(head_parts, zeros_x, fwd_TP[0, 0]), head_vary)]
    if backward:
        f32_zeros = lambda w: collectives.zeros_like(w).astype(jnp.float32)  # noqa: E731
        carry.update(ct=buffer(the_plan.ct_slots), stash=stash, grads=(
            jax.tree.map(collectives.zeros_like, params["blocks"]),
            jax.tree.map(f32_zeros, rest_model)))
    n_params = len(jax.tree.leaves(own(params, 0)))

    def pullback_flat(stashed, p, ct_BLD, i):
        """The backward of unit i from what its forward stashed: [*grads of p's leaves,
        the input cotangent, the loss (taken here when the unit's input is stashed)].
        p: `own`'s, of a split plan (no chunks: V = 1, no pins)."""
        if residuals:
            f_vjp, loss = _pullback(traced["structure"], stashed, p), loss0
        else:
            (_, loss), f_vjp = jax.vjp(lambda p, x: unit(p, x, i), p, stashed)
        d_params, dx_BLD = f_vjp((ct_BLD, seed))
        return [*jax.tree.leaves(d_params), dx_BLD, loss]

    if split:  # the backward cut into B and W, traced once on this level's values
        example = ([buf[0] for buf in stash] if residuals else zeros_x,
                   own(params, 0), zeros_x, bwd_TP[0, stage])  # an item varies over pp
        flat_example = jax.tree.leaves(example)
        n_stashed = len(jax.tree.leaves(example[0]))
        live = list(range(n_stashed, n_stashed + n_params)) + [len(flat_example) - 1]
        the_split = backward_split.split(pullback_flat, *example,
                                         b_out=[False] * n_params + [True, True])
        w_own = [k for k, m in enumerate(the_split.w_reads) if m and k not in live]
        w_vary = []

        def w_inputs(flat):
            """What W is handed: B's crossing values and the inputs W reads itself."""
            _, cross = the_split.b(flat)
            values = [*cross, *(flat[k] for k in w_own)]
            w_vary.extend(tuple(collectives.varying_axes(v)) for v in values)
            return values

        shapes = jax.eval_shape(w_inputs, flat_example)
        # each stage's W slots hold its own units' values: varying over pp, whatever the
        # value (a layer index made from the item may come back invariant or not)
        carry["wstash"] = [_like(jnp.zeros((the_plan.w_slots, *v.shape), v.dtype),
                                 dict.fromkeys((*a, pp)))
                           for v, a in zip(shapes, w_vary)]

    def keep(active, new, old):
        """`new`, or where this stage's unit is not `active` (a unit a uniform plan runs
        only to keep the devices' programs alike) `old`."""
        if active is True:
            return new
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)

    @jax.named_scope(scopes.PP_FORWARD)
    def forward(c, i, active=True):
        x_BLD = c["x"][i % the_plan.x_slots]
        if not backward:
            y_BLD, loss = unit(own(params, i), x_BLD, i)
            return y_BLD, dict(c, loss=c["loss"] + keep(active, loss, 0.0))
        slot = i % the_plan.stash_slots
        if not residuals:  # the loss is taken in the backward, which recomputes the unit
            y_BLD, _ = unit(own(params, i), x_BLD, i, with_loss=False)
            return y_BLD, dict(c, stash=c["stash"].at[slot].set(
                keep(active, x_BLD, c["stash"][slot])))
        q = own(params, i)
        (y_BLD, loss), f_vjp = jax.vjp(lambda q, x: unit(q, x, i, with_head=not apart),
                                       q, x_BLD)
        leaves, traced["structure"] = _pullback_parts(f_vjp, q)
        assert [(r.shape, r.dtype) for r in leaves] == [
            (b.shape[1:], b.dtype) for b in c["stash"]], "the stash's residuals are the unit's"
        stash = [buf.at[slot].set(keep(active, r, buf[slot]))
                 for buf, r in zip(c["stash"], leaves)]
        if apart:  # the head's vjp on the last chunk, its residuals into the head's slot
            h_slot = (i // V) % K_head

            def head(write):
                loss, h_vjp = jax.vjp(lambda r, y: head_of(r, y, i), rest_model, y_BLD)
                held, traced["head"] = _pullback_parts(h_vjp, rest_model)
                return loss, [write(b, h) for b, h in zip(c["head"], held)]

            ends = (stage == n - 1) & (i % V == V - 1) & active
            if uniform:  # both computed: select one slot's values, not the buffers
                head_loss, held = either(ends, lambda: head(lambda b, h: h),
                                         lambda: (loss0, [b[h_slot] for b in c["head"]]))
                held = [b.at[h_slot].set(h) for b, h in zip(c["head"], held)]
            else:
                head_loss, held = lax.cond(ends, lambda: head(lambda b, h: b.at[h_slot].set(h)),
                                           lambda: (loss0, c["head"]))
            c, loss = dict(c, head=held), loss + head_loss
        return y_BLD, dict(c, stash=stash, loss=c["loss"] + keep(active, loss, 0.0))

    def add_flat(grads, d_flat):
        """`grads` plus a part's grads, given as params' leaves (None: none from it)."""
        return jax.tree.unflatten(jax.tree.structure(grads), [
            g if d is None else g + d for g, d in zip(jax.tree.leaves(grads), d_flat)])

    @jax.named_scope(scopes.PP_BACKWARD)
    def backward_(c, i, active=True):
        slot, v = i % the_plan.stash_slots, i % V
        last = (stage == n - 1) & (v == V - 1)
        ct_BLD = jnp.where(last, 0.0, c["ct"][i % the_plan.ct_slots])
        if split:  # B: the input cotangent now, what W needs into its slot
            stashed = [buf[slot] for buf in c["stash"]] if residuals else c["stash"][slot]
            flat = jax.tree.leaves((stashed, own(params, i), ct_BLD, i))
            outs, cross = the_split.b(flat)
            dx_BLD, loss = outs[n_params], outs[n_params + 1]
            grads = c["grads"]
            if any(the_split.need_b[:n_params]):  # grads B gives (the embedding's, head's)
                grads = add_flat(grads, outs[:n_params])
            c = dict(c, grads=keep(active, grads, c["grads"]))
            w_slot = i % the_plan.w_slots
            wstash = [buf.at[w_slot].set(keep(active, value, buf[w_slot])) for buf, value
                      in zip(c["wstash"], [*cross, *(flat[k] for k in w_own)])]
            return dx_BLD, dict(c, wstash=wstash, loss=c["loss"] + keep(active, loss, 0.0))
        if apart:  # the head's pullback from its slot gives the last chunk's cotangent
            def head():
                held = [b[(i // V) % K_head] for b in c["head"]]
                return _pullback(traced["head"], held, rest_model)(seed)

            d_head, ct_BLD = either(last, head, lambda: (
                jax.tree.map(jnp.zeros_like, rest_model), ct_BLD))
        if residuals:
            f_vjp = _pullback(traced["structure"], [buf[slot] for buf in c["stash"]],
                              own(params, i))
            loss = loss0
        else:
            (_, loss), f_vjp = jax.vjp(lambda q, x: unit(q, x, i), own(params, i),
                                       c["stash"][slot])
        (d_blocks, d_pins, d_rest), dx_BLD = f_vjp((ct_BLD, seed))
        if apart:
            d_rest = jax.tree.map(jnp.add, d_rest, d_head)
        d_params = d_blocks, d_pins, d_rest
        return dx_BLD, dict(c, grads=add_own(c["grads"], d_params, i, active),
                            loss=c["loss"] + keep(active, loss, 0.0))

    @jax.named_scope(scopes.PP_WEIGHT)
    def weight_(c, i, active=True):
        """W: the params' grads of unit i from what its B left in its slot."""
        held = [buf[i % the_plan.w_slots] for buf in c["wstash"]]
        n_cross = len(held) - len(w_own)
        flat = [None] * len(the_split.w_reads)
        for k, value in zip(live, [*jax.tree.leaves(own(params, i)), i]):
            flat[k] = value
        for k, value in zip(w_own, held[n_cross:]):
            flat[k] = value
        grads = add_flat(c["grads"], the_split.w(flat, held[:n_cross])[:n_params])
        return zeros_x, dict(c, grads=keep(active, grads, c["grads"]))

    def slot_unit(c, unit_fn, item, anywhere):
        """Run `unit_fn` on `item` where this stage's slot holds one (NONE: idle), or
        under a uniform plan on every stage where `anywhere` (kept where it holds one)."""
        idle = lambda c: (zeros_x, c)  # noqa: E731
        on = item != NONE
        if uniform:
            return lax.cond(anywhere, lambda c: unit_fn(c, jnp.maximum(item, 0), on), idle, c)
        return lax.cond(on, lambda c: unit_fn(c, item), idle, c)

    def shift(sends, v_BLD, direction, tp=None if axes.tp in x_axes else axes.tp):
        """`v` sent one stage along the ring (`direction` +1: to the next stage), where
        some stage sends (`sends`, alike on every device, which so run the same
        collectives in the same order; elsewhere `v` comes back, unread). Replicated over
        tp, 1/tp from each tp rank, gathered over tp on arrival (engine/parallel/shifts.py)."""
        return lax.cond(sends, lambda v: shifts.stage_shift(v, pp, direction, tp),
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
    rest, = rest_transpose(jax.tree.map(lambda g, m: g.astype(m.dtype), rest, rest_model))
    return loss, dict(rest, blocks=blocks)


def reduce_shared(grads, specs, axes: Axes):
    """Sum over pp the grads of params every stage holds (embedding, head, final norm):
    each stage computed its own share (zero where it does not own the part)."""
    return jax.tree.map(lambda g, s: g if axes.pp in spec_axes(s)
                        else collectives.all_reduce(g, axes.pp), grads, specs)
