"""The pipeline's slots: the buffers a stage keeps between ticks (engine/parallel/pipeline.py).

Each buffer is [K, ...] with K slots from the tick table (engine/parallel/schedules.py
`Plan`), item i held in slot i % K but in the stash, whose slot the table gives for each
stage and item (`Plan.stash_slot_PI`: as many slots as the stage holds items at once):

    x       the activations [B, L, D] received from the previous stage (`Plan.x_slots`)
    ct      the cotangents received from the next stage (`Plan.ct_slots`)
    stash   what a forward unit leaves its backward (`Plan.stash_slots`): the leaves of
            its `jax.vjp` pullback (`pullback_parts`) but those made of the params
            alone, which the backward rebuilds (`params_only`), or under a cp ring its
            input
    head    the head's pullback leaves of the last stage's last-chunk items, where the
            head's vjp runs apart from the unit's (`Plan.head_slots`)
    wstash  under a split plan, what W reads of B from B's tick to its own
            (`Plan.w_slots`); W reads the residuals from the stash slot

A buffer of pullback leaves is a list of [K, ...] arrays, one a leaf, each varying over
the mesh axes its leaf varies over (read off the unit's one trace of what it stashes,
`trace_residuals`, or while tracing the head: `slots_for`) and over pp: each stage's
slots hold its own units' values. A write under a uniform plan keeps the slot's old
value where this stage's unit ran only to keep the devices' programs alike (`keep`)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public name
from jax.extend import core

import collectives


def like(x: jax.Array, axes) -> jax.Array:
    """`x` made varying over `axes` (it may vary over some already)."""
    return collectives.broadcast(x, tuple(axes))


def keep(active, new, old):
    """`new`, or where this stage's unit is not `active` (a unit a uniform plan runs
    only to keep the devices' programs alike) `old`: the values, or a function making
    them, called only where a unit may be inactive (a slot's read or zeros made only to
    be dropped would cost their trace)."""
    if active is True:
        return new
    old = old() if callable(old) else old
    return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)


def buffer(zero, slots: int) -> jax.Array:
    """[max(slots, 1), *zero.shape] slots of `zero`'s shape, zeros varying as it does."""
    return jnp.broadcast_to(zero, (max(slots, 1), *zero.shape))


def zero_slots(shapes, vary, slots: int, also=()) -> list[jax.Array]:
    """`slots` zero slots of each of `shapes` (shape and dtype), each varying over its
    axes in `vary` and `also`."""
    return [like(jnp.zeros((slots, *s.shape), s.dtype), dict.fromkeys((*a, *also)))
            for s, a in zip(shapes, vary)]


def slots_for(values, slots: int, *example, also=()) -> list[jax.Array]:
    """`zero_slots` for each array `values(*example)` returns, each varying over the axes
    that array varies over (read while tracing) and `also`."""
    vary = []

    def traced(*args):
        out = values(*args)
        vary.extend(tuple(collectives.varying_axes(v)) for v in out)
        return out

    return zero_slots(jax.eval_shape(traced, *example), vary, slots, also)


def read(buffers: list[jax.Array], slot) -> list[jax.Array]:
    return [b[slot] for b in buffers]


def write(buffers: list[jax.Array], slot, values, active=True) -> list[jax.Array]:
    """`buffers` with `values` in `slot` (kept as they were where not `active`)."""
    return [b.at[slot].set(keep(active, v, lambda b=b: b[slot])) for b, v in zip(buffers, values)]


def pullback_parts(f_vjp, params):
    """(leaves, structure) of what a `jax.vjp` pullback of f(params, x) holds but the
    params themselves: the residuals, and x where the backward needs it. The pullback is
    a pytree (public since `jax.vjp` returns one); a leaf that is one of `params`' own
    leaves is left out and put back live by `pullback`."""
    leaves, treedef = jax.tree.flatten(f_vjp)
    param_at = {id(leaf): j for j, leaf in enumerate(jax.tree.leaves(params))}
    where = tuple(param_at.get(id(leaf)) for leaf in leaves)
    return [leaf for leaf, j in zip(leaves, where) if j is None], (treedef, where)


class Residuals(NamedTuple):
    """A unit's forward traced once for the step as a function of (item, params, x):
    `jaxpr`'s inputs are `consts`, the item, the params' `n_params` leaves, then x's;
    its outputs the unit's `lead` outputs (its output x and loss), then its pullback's
    leaves less its params (`pullback_parts`)."""

    jaxpr: core.Jaxpr
    consts: list
    n_params: int
    lead: int

    @property
    def avals(self) -> list:
        """The pullback leaves' avals."""
        return [v.aval for v in self.jaxpr.outvars[self.lead:]]


def trace_residuals(unit, item, params, x, lead: int) -> Residuals:
    """`unit(item, params, x)` (a list of arrays: `lead` outputs, then the pullback's
    leaves) traced once (`Residuals`); the step reads what the pullback holds from the
    jaxpr (`params_only`, the stash's shapes), runs each tick's forward from it
    (`forward`) and rebuilds from it (`rebuild`) rather than tracing the unit's vjp again
    for each."""
    closed = jax.make_jaxpr(unit)(item, params, x)
    return Residuals(pe.convert_constvars_jaxpr(closed.jaxpr), closed.consts,
                     len(jax.tree.leaves(params)), lead)


def params_only(traced: Residuals) -> tuple[bool, ...]:
    """For each array of the traced residuals (a unit's pullback leaves less the params:
    `pullback_parts`), whether it is made of the params (with the unit's constants and
    item), not of x: the weights as the unit uses them (cast to the compute dtype,
    gathered over fsdp). Such a residual is the same for every microbatch; the backward
    rebuilds it (`rebuild`: the same values, bit for bit) rather than a stash slot holding
    it once per microbatch in flight. One of the constants or the item alone (the RoPE
    tables, the unit's item) stays in the slot: rebuilt, XLA's sin and cos in another
    fusion moved bf16 grads by an ulp."""
    jaxpr, consts, n_params, lead = traced
    n = len(consts) + 1  # the constants and the item
    which = []
    for k in range(lead, len(jaxpr.outvars)):
        _, used = pe.dce_jaxpr(jaxpr, [j == k for j in range(len(jaxpr.outvars))])
        which.append(any(used[n:n + n_params]) and not any(used[n + n_params:]))
    return tuple(which)


def _run(traced: Residuals, outs, item, params, x) -> list[jax.Array]:
    """The traced jaxpr's outputs marked in `outs`, from the live item, params and x:
    the jaxpr cut to the equations they need, its equations bound here (under the
    caller's scopes, each with the scopes it was traced under)."""
    cut, used = pe.dce_jaxpr(traced.jaxpr, list(outs))
    ins = [*traced.consts, item, *jax.tree.leaves(params), *jax.tree.leaves(x)]
    return core.jaxpr_as_fun(core.ClosedJaxpr(cut, ()))(*(v for v, u in zip(ins, used) if u))


def forward(traced: Residuals, which, item, params, x) -> tuple[list, list]:
    """(the unit's `lead` outputs, the pullback leaves `which` does not mark: what its
    stash slot holds) of `item` from the live params and x."""
    got = _run(traced, [True] * traced.lead + [not w for w in which], item, params, x)
    return got[:traced.lead], got[traced.lead:]


def rebuild(traced: Residuals, which, item, params, x) -> list[jax.Array]:
    """The residuals `which` marks (`params_only`) made again from the live `params`
    for `item`: the traced jaxpr cut to the equations they need, which read no x."""
    return _run(traced, [False] * traced.lead + list(which), item, params, x)


def split(leaves, which):
    """(the leaves `which` does not mark: what a stash slot holds, the marked ones)."""
    return ([v for v, w in zip(leaves, which) if not w],
            [v for v, w in zip(leaves, which) if w])


def join(stashed, rebuilt, which) -> list:
    """`split`'s two lists put back in the pullback's order."""
    stashed, rebuilt = iter(stashed), iter(rebuilt)
    return [next(rebuilt) if w else next(stashed) for w in which]


def pullback(structure, leaves, params):
    """The pullback of `structure` (`pullback_parts`, traced by the forward unit) with
    its residuals `leaves` and the live `params` where it held the forward's."""
    treedef, where = structure
    param_leaves, stashed = jax.tree.leaves(params), iter(leaves)
    return jax.tree.unflatten(treedef, [next(stashed) if j is None else param_leaves[j]
                                        for j in where])


def initial(u, fwd_TP, bwd_TP) -> dict:
    """The scan's carry before the first tick for `u` (`pipeline_units.Units`): every
    buffer of the module doc that its plan uses, zero, the loss 0 and, in training, the
    grads 0 (the blocks' as stored, the rest's in f32). fwd_TP, bwd_TP: the plan's
    tables as arrays (an item of them types the example units traced for the shapes)."""
    plan, zeros_x = u.plan, u.zeros_x
    # a stage's slots hold its own units' values, read at its own item (the tables'
    # row `stage`): varying over pp whatever the example traced at a fixed item gives
    # (an int32 residual made from the item, the blocked kernel's key positions, is
    # invariant at a constant item and varies over pp in the tick). The stash's trace
    # takes an item varying over pp, as the ticks' are: the backward rebuilds from it
    if u.residuals:
        kept = u.trace_stash(like(fwd_TP[0, 0], (u.pp,)))
        stash = zero_slots(kept, [collectives.varying_axes(a) for a in kept],
                           plan.stash_slots, also=(u.pp,))
    else:
        stash = buffer(zeros_x, plan.stash_slots)
    carry = dict(x=buffer(zeros_x, plan.x_slots), loss=u.loss0)
    if u.apart:  # the head's residuals: the last stage's head slots, not every stash slot
        carry["head"] = slots_for(u.head_parts, plan.head_slots, zeros_x, fwd_TP[0, 0],
                                  also=(u.pp,))
    if u.backward:
        f32_zeros = lambda w: collectives.zeros_like(w).astype(jnp.float32)  # noqa: E731
        carry.update(ct=buffer(zeros_x, plan.ct_slots), stash=stash, grads=(
            jax.tree.map(collectives.zeros_like, u.params["blocks"]),
            jax.tree.map(f32_zeros, u.rest_model)))
    n_params = len(jax.tree.leaves(u.own(u.params, 0)))
    if u.split:  # the backward cut into B and W, traced once on this level's values
        example = (read(stash, 0) if u.residuals else zeros_x, u.own(u.params, 0), zeros_x,
                   bwd_TP[0, u.stage])  # an item varies over pp
        carry["wstash"] = slots_for(u.split_backward(example, n_params), plan.w_slots,
                                    jax.tree.leaves(example), also=(u.pp,))
    return carry
