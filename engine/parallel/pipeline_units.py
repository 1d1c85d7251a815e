"""The pipeline's units: what a stage runs in a tick's forward, backward and W slots
(engine/parallel/pipeline.py runs them along the tick table, engine/parallel/
pipeline_stash.py keeps what they leave each other).

A unit is item i = m·V + v: microbatch m through the device's chunk v. The forward runs
`jax.vjp` of the chunk (the embedding on the model's first chunk, the head and loss on
its last) and stashes the pullback's leaves but the weights as it uses them (rebuilt by
the backward from the params, `pipeline_stash.params_only`). The vjp is traced once a
step (`Units.trace_stash`): each tick's forward binds that trace's equations
(`pipeline_stash.forward`) and the backward rebuilds from it. The backward applies the
leaves to the cotangent from the next stage (or the loss's seed) and adds the params'
grads to the carry. Under a cp ring the forward stashes its input and the backward
recomputes the unit under `jax.vjp`. A split plan (zb1) runs each backward as B (the
input cotangent) and W (the params' grads) from the pullback's jaxpr cut by
engine/parallel/backward_split.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from engine.parallel import backward_split, pipeline_stash as slots
from engine.parallel.schedules import Plan
from layers import scopes
from layers.axes import Axes


class Units:
    """The units of one pipelined step, per shard (module doc); built inside the step's
    shard_map, where `stage` is this device's pp index.

    params: as differentiated (`seen(p, rows)` makes the model's params of them, `rows`
    taking a chunk's rows of a stored stacked leaf: `ZeroLevel.differentiate`); inputs,
    targets: [M, B, L] this device's microbatches; x_shape, x_axes, x_dtype: the
    residual stream's local shape [B, L, D], the axes it varies over and its dtype;
    docs_M: the microbatches' packed documents ([M, B, ...] arrays) or None; residuals:
    stash the units' vjp residuals instead of their inputs."""

    def __init__(self, stages, params, inputs_MBL, targets_MBL, x_shape, x_axes,
                 axes: Axes, the_plan: Plan, seen, x_dtype, docs_M, residuals: bool):
        self.stages, self.inputs_MBL, self.targets_MBL = stages, inputs_MBL, targets_MBL
        self.plan, self.seen, self.docs_M = the_plan, seen, docs_M
        self.M, self.V = inputs_MBL.shape[0], the_plan.virtual
        self.pp, self.n = axes.pp, axes.pp_size
        self.stage = collectives.axis_index(self.pp)
        self.backward = the_plan.stash_slots > 0
        self.residuals = residuals and self.backward
        self.params = jax.tree.map(lambda w: collectives.broadcast(w, self.pp), params)
        self.x_axes = tuple(x_axes) + (self.pp,)
        self.split = self.backward and the_plan.split
        self.uniform = the_plan.uniform
        self.apart = self.residuals and not self.split  # the head's residuals apart

        # The params outside the stacked blocks as the model sees them, made once before
        # the ticks: the units differentiate these, their grads sum over the microbatches
        # (f32) and `seen`'s transpose (ZeRO-2's fsdp reduce-scatter) runs once after.
        params = self.params
        self.rest_diff = {k: w for k, w in params.items() if k != "blocks"}
        self.rest_model, self.rest_transpose = jax.vjp(lambda rest: {
            k: w for k, w in seen(dict(rest, blocks=params["blocks"])).items()
            if k != "blocks"}, self.rest_diff)
        self.zeros_x = slots.like(jnp.zeros(x_shape, x_dtype), self.x_axes)
        self.loss0 = slots.like(jnp.float32(0), (self.pp,))
        self.seed = slots.like(jnp.float32(1 / self.M), (self.pp,))  # d(mean) / d(one's)
        self.traced = {}  # the structures of the forward's pullbacks, for the backward
        if self.backward:  # this device's row of the plan's stash slots
            self.stash_slot_I = jnp.asarray(the_plan.stash_slot_PI)[self.stage]

    def rows(self, v):
        """Chunk v's rows of a stacked leaf [N/pp, ...] -> [N/(pp·V), ...] (rows
        [v·N/(pp·V), (v+1)·N/(pp·V)) of its shard: `storage_order`)."""
        V = self.V
        return lambda w: lax.dynamic_slice_in_dim(w, v * (w.shape[0] // V), w.shape[0] // V)

    def own(self, p, i):
        """What item i's unit takes its `jax.vjp` over, (blocks, pins, rest): blocks, the
        rows of `p`'s stacked blocks its chunk holds; pins, the chunk's rows of the stored
        leaves `seen` reads beside them (ZeRO-2's whole weights; none under the other
        levels); rest, the other params as the model sees them. All made outside the vjp:
        primals, not stashed residuals; the blocks' cotangent is chunk-sized."""
        if self.V == 1:
            return p["blocks"], [], self.rest_model
        pins = []
        self.seen(p, lambda w: pins.append(self.rows(i % self.V)(w)) or pins[-1])
        return jax.tree.map(self.rows(i % self.V), p["blocks"]), pins, self.rest_model

    def add_own(self, grads, d_own, i, active=True):
        """`grads` (blocks', rest's) plus unit i's `d_own` (`own`'s shapes; zero where not
        `active`): the blocks' into their chunk's rows only, the rest's in f32."""
        d_blocks, _, d_rest = slots.keep(active, d_own,
                                       lambda: jax.tree.map(jnp.zeros_like, d_own))
        blocks, rest = grads
        rest = jax.tree.map(lambda g, d: g + d.astype(g.dtype), rest, d_rest)
        if self.V == 1:
            return jax.tree.map(jnp.add, blocks, d_blocks), rest

        def add_rows(g, d):
            start = (i % self.V) * d.shape[0]
            return lax.dynamic_update_slice_in_dim(
                g, lax.dynamic_slice_in_dim(g, start, d.shape[0]) + d, start, 0)

        return jax.tree.map(add_rows, blocks, d_blocks), rest

    def either(self, pred, f, g):
        """f() where `pred`, else g(): a `lax.cond`, or under a uniform plan both computed
        and one kept, so that every device runs the same collectives."""
        if not self.uniform:
            return lax.cond(pred, f, g)
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), f(), g())

    def unit(self, p, x_BLD, i, with_loss=True, with_head=True):
        """Item i (microbatch i // V through chunk i % V) from its input x [B, L, D] under
        `own(params, i)` p: (output x [B, L, D], its share of the microbatch's loss: the
        head's on the model's last chunk, plus in training the chunk's auxiliary loss).
        Only the first chunk embeds, only the last runs the head and loss (no loss at all
        without `with_loss`; no head's without `with_head`: `head_of` runs it apart)."""
        V, stage, n = self.V, self.stage, self.n
        m, v = i // V, i % V
        inputs_BL, targets_BL = self.inputs_MBL[m], self.targets_MBL[m]
        docs = None if self.docs_M is None else jax.tree.map(lambda x: x[m], self.docs_M)
        blocks, pins, rest = p
        pinned = iter(pins)
        stored = dict(self.rest_diff, blocks=blocks)  # the rest's `seen` here is dead code
        blocks = (self.seen(stored) if V == 1
                  else self.seen(stored, lambda w: next(pinned)))["blocks"]
        model_p = dict(rest, blocks=blocks)
        first, last = (stage == 0) & (v == 0), (stage == n - 1) & (v == V - 1)

        def embed():
            with jax.named_scope(scopes.PP_FIRST):
                return slots.like(self.stages.embed(model_p, inputs_BL), self.x_axes)

        def head():
            with jax.named_scope(scopes.PP_LAST):
                return slots.like(self.stages.head_loss(model_p, y_BLD, targets_BL),
                                  (self.pp,))

        x_BLD = self.either(first, embed, lambda: x_BLD)
        y_BLD, aux = self.stages.blocks(model_p, x_BLD, docs)
        y_BLD = slots.like(y_BLD, self.x_axes)
        if not with_loss:
            return y_BLD, self.loss0
        loss = self.either(last, head, lambda: self.loss0) if with_head else self.loss0
        if aux is None or not self.backward:  # evaluation: the cross-entropy alone
            return y_BLD, loss
        return y_BLD, loss + slots.like(aux, (self.pp,))

    def head_of(self, rest, y_BLD, i):
        """The head's loss of item i's microbatch from the last chunk's output y."""
        with jax.named_scope(scopes.PP_LAST):
            return slots.like(self.stages.head_loss(rest, y_BLD, self.targets_MBL[i // self.V]),
                              (self.pp,))

    def pullback_leaves(self, i, q, x_BLD):
        """[unit i's output x, its loss, the leaves of its pullback from (q, x) less the
        params q (`own`'s)]."""
        (y_BLD, loss), f_vjp = jax.vjp(
            lambda q, x: self.unit(q, x, i, with_head=not self.apart), q, x_BLD)
        held, self.traced["structure"] = slots.pullback_parts(f_vjp, q)
        return [y_BLD, loss, *held]

    def trace_stash(self, i):
        """The avals of what a unit's forward stashes, traced once on item i (one
        varying over pp, as the ticks' items do): its pullback's leaves, less the params
        and less what is made of the params alone (`pipeline_stash.params_only`: the
        weights as the unit uses them), which the backward rebuilds from the same trace.
        Each tick's forward runs from this trace too (`forward`), not from a vjp of its
        own: the same equations, the unit's linearization traced once for the step."""
        self.traced["residuals"] = traced = slots.trace_residuals(
            self.pullback_leaves, i, self.own(self.params, i), self.zeros_x, lead=2)
        self.traced["which"] = slots.params_only(traced)
        return slots.split(traced.avals, self.traced["which"])[0]

    def pullback_of(self, stashed, q, i):
        """Unit i's pullback from its stash slot's leaves and the live `own` q."""
        which = self.traced["which"]
        rebuilt = slots.rebuild(self.traced["residuals"], which, i, q, self.zeros_x)
        return slots.pullback(self.traced["structure"], slots.join(stashed, rebuilt, which), q)

    def pullback_and_loss(self, stashed, q, i):
        """(unit i's pullback, the loss its backward takes) from its stash slot `stashed`
        and the live `own` q: the stashed residuals' (the loss was taken in the forward),
        or under a stashed input the unit recomputed under `jax.vjp` (its loss here)."""
        if self.residuals:
            return self.pullback_of(stashed, q, i), self.loss0
        (_, loss), f_vjp = jax.vjp(lambda q, x: self.unit(q, x, i), q, stashed)
        return f_vjp, loss

    def head_parts(self, y_BLD, i):
        """The leaves the head's pullback of item i holds (its slot's, under `apart`)."""
        leaves, self.traced["head"] = slots.pullback_parts(
            jax.vjp(lambda r, y: self.head_of(r, y, i), self.rest_model, y_BLD)[1],
            self.rest_model)
        return leaves

    def pullback_flat(self, stashed, p, ct_BLD, i):
        """The backward of unit i from what its forward stashed: [*grads of p's leaves,
        the input cotangent, the loss (taken here when the unit's input is stashed)].
        p: `own`'s, of a split plan (no chunks: V = 1, no pins)."""
        f_vjp, loss = self.pullback_and_loss(stashed, p, i)
        d_params, dx_BLD = f_vjp((ct_BLD, self.seed))
        return [*jax.tree.leaves(d_params), dx_BLD, loss]

    def split_backward(self, example, n_params: int):
        """Cut the backward into B and W (traced once on `example`, `pullback_flat`'s
        arguments; `n_params` leaves in its `own`); returns what W is handed as a
        function of B's flat inputs: B's crossing values and the inputs W reads itself."""
        flat_example = jax.tree.leaves(example)
        n_stashed = len(jax.tree.leaves(example[0]))
        self.n_params = n_params
        self.live = list(range(n_stashed, n_stashed + n_params)) + [len(flat_example) - 1]
        self.the_split = backward_split.split(self.pullback_flat, *example,
                                              b_out=[False] * n_params + [True, True])
        w_own = [k for k, m in enumerate(self.the_split.w_reads) if m and k not in self.live]
        # W reads the stashed ones from the unit's stash slot (held until W's tick:
        # `Plan.stash_slot_PI`), the others (the cotangent B received) from its W slot
        self.w_stashed = [k for k in w_own if k < n_stashed]
        self.w_held = [k for k in w_own if k >= n_stashed]

        def w_inputs(flat):
            _, cross = self.the_split.b(flat)
            return [*cross, *(flat[k] for k in self.w_held)]

        return w_inputs

    @jax.named_scope(scopes.PP_FORWARD)
    def forward(self, c, i, active=True):
        """The forward of item i from its input's slot: (its output, the carry with
        the stash (and the head's slot) written and the loss added)."""
        plan, V = self.plan, self.V
        x_BLD = c["x"][i % plan.x_slots]
        if not self.backward:
            y_BLD, loss = self.unit(self.own(self.params, i), x_BLD, i)
            return y_BLD, dict(c, loss=c["loss"] + slots.keep(active, loss, 0.0))
        slot = self.stash_slot_I[i]
        if not self.residuals:  # the loss is taken in the backward, which recomputes it
            y_BLD, _ = self.unit(self.own(self.params, i), x_BLD, i, with_loss=False)
            return y_BLD, dict(c, stash=c["stash"].at[slot].set(
                slots.keep(active, x_BLD, lambda: c["stash"][slot])))
        # the unit's forward and the leaves its pullback holds, from its one trace
        # (`trace_stash`, outside the ticks' scopes: the backward's transposed equations
        # are not named as this forward's), less those the backward rebuilds
        (y_BLD, loss), leaves = slots.forward(self.traced["residuals"], self.traced["which"],
                                              i, self.own(self.params, i), x_BLD)
        assert [(r.shape, r.dtype) for r in leaves] == [
            (b.shape[1:], b.dtype) for b in c["stash"]], "the stash's residuals are the unit's"
        stash = slots.write(c["stash"], slot, leaves, active)
        if self.apart:  # the head's vjp on the last chunk, its residuals into its slot
            h_slot = (i // V) % plan.head_slots

            def head(write):
                loss, h_vjp = jax.vjp(lambda r, y: self.head_of(r, y, i), self.rest_model,
                                      y_BLD)
                held, self.traced["head"] = slots.pullback_parts(h_vjp, self.rest_model)
                return loss, [write(b, h) for b, h in zip(c["head"], held)]

            ends = (self.stage == self.n - 1) & (i % V == V - 1) & active
            if self.uniform:  # both computed: select one slot's values, not the buffers
                head_loss, held = self.either(
                    ends, lambda: head(lambda b, h: h),
                    lambda: (self.loss0, slots.read(c["head"], h_slot)))
                held = [b.at[h_slot].set(h) for b, h in zip(c["head"], held)]
            else:
                head_loss, held = lax.cond(
                    ends, lambda: head(lambda b, h: b.at[h_slot].set(h)),
                    lambda: (self.loss0, c["head"]))
            c, loss = dict(c, head=held), loss + head_loss
        return y_BLD, dict(c, stash=stash, loss=c["loss"] + slots.keep(active, loss, 0.0))

    def stash_leaves(self, c) -> list:
        """The stash's buffers, one per flat leaf of what a slot holds (the pullback's
        stashed leaves, or under a cp ring the unit's input)."""
        return c["stash"] if self.residuals else [c["stash"]]

    def add_flat(self, grads, d_flat):
        """`grads` plus a part's grads, given as params' leaves (None: none from it)."""
        return jax.tree.unflatten(jax.tree.structure(grads), [
            g if d is None else g + d for g, d in zip(jax.tree.leaves(grads), d_flat)])

    @jax.named_scope(scopes.PP_BACKWARD)
    def backward_(self, c, i, active=True):
        """The backward of item i (under a split plan its B alone) from its stash slot
        and the cotangent's: (its input cotangent, the carry with the grads added)."""
        plan, V = self.plan, self.V
        slot, v = self.stash_slot_I[i], i % V
        last = (self.stage == self.n - 1) & (v == V - 1)
        ct_BLD = jnp.where(last, 0.0, c["ct"][i % plan.ct_slots])
        if self.split:  # B: the input cotangent now, what W needs into its slot
            # B's flat inputs (`split_backward`'s): of the stash slot only the leaves B
            # reads (W reads its own from the slot at its tick)
            stashed = [b[slot] if m else None
                       for b, m in zip(self.stash_leaves(c), self.the_split.b_reads)]
            flat = [*stashed, *jax.tree.leaves(self.own(self.params, i)), ct_BLD, i]
            outs, cross = self.the_split.b(flat)
            n_params = self.n_params
            dx_BLD, loss = outs[n_params], outs[n_params + 1]
            grads = c["grads"]
            if any(self.the_split.need_b[:n_params]):  # grads B gives (embedding's, head's)
                grads = self.add_flat(grads, outs[:n_params])
            c = dict(c, grads=slots.keep(active, grads, c["grads"]))
            wstash = slots.write(c["wstash"], i % plan.w_slots,
                                 [*cross, *(flat[k] for k in self.w_held)], active)
            return dx_BLD, dict(c, wstash=wstash,
                                loss=c["loss"] + slots.keep(active, loss, 0.0))
        stashed = slots.read(c["stash"], slot) if self.residuals else c["stash"][slot]
        if self.apart:  # the head's pullback from its slot gives the last chunk's ct
            def head():
                held = slots.read(c["head"], (i // V) % plan.head_slots)
                return slots.pullback(self.traced["head"], held, self.rest_model)(self.seed)

            d_head, ct_BLD = self.either(last, head, lambda: (
                jax.tree.map(jnp.zeros_like, self.rest_model), ct_BLD))
        f_vjp, loss = self.pullback_and_loss(stashed, self.own(self.params, i), i)
        (d_blocks, d_pins, d_rest), dx_BLD = f_vjp((ct_BLD, self.seed))
        if self.apart:
            d_rest = jax.tree.map(jnp.add, d_rest, d_head)
        d_params = d_blocks, d_pins, d_rest
        return dx_BLD, dict(c, grads=self.add_own(c["grads"], d_params, i, active),
                            loss=c["loss"] + slots.keep(active, loss, 0.0))

    @jax.named_scope(scopes.PP_WEIGHT)
    def weight_(self, c, i, active=True):
        """W: the params' grads of unit i from what its B left in its W slot and the
        stash slot its forward left (both held until this tick)."""
        held = slots.read(c["wstash"], i % self.plan.w_slots)
        n_cross = len(held) - len(self.w_held)
        flat = [None] * len(self.the_split.w_reads)
        for k, value in zip(self.live, [*jax.tree.leaves(self.own(self.params, i)), i]):
            flat[k] = value
        for k, value in zip(self.w_held, held[n_cross:]):
            flat[k] = value
        if self.w_stashed:
            slot = self.stash_slot_I[i]
            buffers = self.stash_leaves(c)
            for k in self.w_stashed:  # the slot's leaves W reads, no others
                flat[k] = buffers[k][slot]
        grads = self.add_flat(c["grads"],
                              self.the_split.w(flat, held[:n_cross])[:self.n_params])
        return self.zeros_x, dict(c, grads=slots.keep(active, grads, c["grads"]))
