"""ZeRO levels as strategies: what the fsdp axis shards (params / grads / optimizer state).

    zero 3   params sharded, gathered per layer in the scan; grads reduce-scattered by
             the gathers' transpose; the update runs on the shards.
    zero 2   params stored whole; the step differentiates each param's fsdp shard and the
             forward uses the stored whole through `Resident` (no gather), whose
             backward reduce-scatters the grad per layer; the update runs on the shards,
             which are then all-gathered back to whole params.
    zero 1   params stored whole; grads all-reduced over fsdp (as over dp), then sliced to
             the shard; update and all-gather as zero 2.

The optimizer state is sharded as `param_specs` says under every level. Without an fsdp
axis the three are the same program (zero 3's): `level` picks zero 3 then.

Each level answers, for the step in engine/run/step.py:
    storage_specs  how params are stored between steps
    grad_specs     how the grads come out of `loss_and_grads`
    model_axes     what the model sees of the layout (under zero 1/2 fsdp is only a batch
                   axis the model does not know: it would gather over it)
    differentiate  what the step differentiates, and how the model's params are made
                   from it
    finish_loss    the loss averaged over the batch axes the model did not see
    update         the optimizer update on the shards, and params back as stored
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import optax
from jax.sharding import PartitionSpec as P

import collectives
from engine.parallel.grads import broadcast_params, fsdp_dim, fsdp_shards, gather_shards
from layers import scopes
from layers.axes import Axes


# -- ZeRO-2's weights: the stored whole param, differentiated through its fsdp shard --
@functools.partial(jax.tree_util.register_dataclass, data_fields=["shard", "whole"],
                   meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class Resident:
    """A ZeRO-2 param: `shard`, this device's fsdp slice (what the step differentiates),
    and `whole`, the stored param it was sliced from, already on every device. One
    pytree, so per-layer slices of both travel through the scan over layers together;
    `ResidentWeights` calls `gather` where ZeRO-3 all-gathers a shard."""

    shard: jax.Array
    whole: jax.Array
    axis: str

    def gather(self, dim: int, dtype=None, grad_reduce: str = "compute") -> jax.Array:
        """`whole`, typed per-device like `collectives.gather(shard)`'s result, with no
        bytes moved; the backward reduce-scatters the cotangent onto `shard` over `axis`
        along `dim`, as the transpose of that gather would. Both cast to `dtype` first;
        grad_reduce "f32": only `whole`, the cotangent cast back to the shard's f32
        before the reduce-scatter (`layers.axes.Axes.grad_reduce`)."""
        if dtype is None:
            shard, whole = self.shard, self.whole
        elif grad_reduce == "f32":
            shard, whole = self.shard, self.whole.astype(dtype)
        else:
            shard, whole = self.shard.astype(dtype), self.whole.astype(dtype)
        return _resident_gather(self.axis, dim, shard.dtype)(shard, whole)



def _mark_like(shard, whole):
    return collectives.broadcast(whole, tuple(collectives.varying_axes(shard)))



@functools.cache
def _resident_gather(axis: str, dim: int, dtype):
    """custom_vjp (shard, whole) -> whole; cotangent -> reduce_scatter onto the shard,
    in the shard's `dtype` (`whole` is a constant of the step: its cotangent is zero)."""
    def reduce(ct):
        return collectives.reduce_scatter(ct if ct.dtype == dtype else ct.astype(dtype),
                                          axis, dim)

    gather = jax.custom_vjp(_mark_like)
    gather.defvjp(lambda shard, whole: (_mark_like(shard, whole), None),
                  lambda _, ct: (reduce(ct), None))
    return gather



@dataclasses.dataclass(frozen=True)
class ResidentWeights:
    """How ZeRO-2's layer weights are made whole (`layers.axes.Axes.weights`): each
    weight the param table shards over fsdp is a `Resident`, whose `gather` returns the
    stored whole without moving bytes; the others (norm scales) pass through in f32."""

    def __call__(self, p: dict, fsdp_dims, axis, dtype, grad_reduce: str = "compute") -> dict:
        return {name: w if fsdp_dims[name] is None
                else w.gather(fsdp_dims[name], dtype, grad_reduce) for name, w in p.items()}


RESIDENT = ResidentWeights()



def _drop_axis(specs, axis: str | None):
    """Every spec with `axis` replaced by None (the leaf stored whole over it)."""
    if axis is None:
        return specs
    return jax.tree.map(lambda spec: P(*(None if e == axis else e for e in spec)), specs,
                        is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class ZeroLevel:
    """A ZeRO level; the methods here are zero 3's (params, grads and optimizer state
    sharded over fsdp), which zero 1 and 2 override where they differ. doc: one line
    for `--help` and the docs."""

    level: int = 3
    doc: str = ("params, grads and optimizer state sharded over fsdp; each layer's params "
                "all-gathered inside the scan, grads reduce-scattered by the gather's transpose")

    def storage_specs(self, shard_specs, fsdp: str | None):
        return shard_specs

    def grad_specs(self, storage_specs, shard_specs):
        return shard_specs

    def model_axes(self, axes: Axes) -> Axes:
        return axes

    def differentiate(self, params, storage_specs, shard_specs, axes: Axes, dtype):
        """(the pytree differentiated, a function seen(diff, rows=None) from it to the
        params the model sees): params marked per-device over the data axes they are
        replicated on. rows: given where `diff`'s stacked blocks are some of the stored
        ones' rows (a pipeline's chunk), the function that takes those rows of a stored
        stacked leaf."""
        return broadcast_params(params, storage_specs, axes), lambda diff, rows=None: diff

    def finish_loss(self, loss, axes: Axes):
        return loss

    def update(self, tx, grads, opt_state, params, shard_specs, fsdp: str | None):
        """One optimizer update; (params as stored, opt_state)."""
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


@dataclasses.dataclass(frozen=True)
class Zero3(ZeroLevel):
    """Params, grads and optimizer state sharded over fsdp."""


class _Replicated(ZeroLevel):
    """Zero 1 and 2: params stored whole on every fsdp device, optimizer state sharded,
    the update run on this device's shard and gathered back."""

    def storage_specs(self, shard_specs, fsdp):
        return _drop_axis(shard_specs, fsdp)

    def model_axes(self, axes):
        return dataclasses.replace(axes, fsdp=None, fsdp_size=1)

    def finish_loss(self, loss, axes):
        with jax.named_scope(scopes.LOSS):  # the model averaged over dp only; now over fsdp
            return collectives.all_reduce(loss, axes.fsdp) / axes.fsdp_size

    def _shard_grads(self, grads, shard_specs, fsdp):
        return grads

    def update(self, tx, grads, opt_state, params, shard_specs, fsdp):
        grads = self._shard_grads(grads, shard_specs, fsdp)
        local = fsdp_shards(params, shard_specs, fsdp)
        updates, opt_state = tx.update(grads, opt_state, local)
        params = optax.apply_updates(local, updates)
        return gather_shards(params, shard_specs, fsdp), opt_state


@dataclasses.dataclass(frozen=True)
class Zero2(_Replicated):
    """Grads reduce-scattered per layer (by `Resident`'s backward), params whole."""

    level: int = 2
    doc: str = ("grads and optimizer state sharded over fsdp, params stored whole; grads "
                "reduce-scattered per layer, updated shards all-gathered back")

    def model_axes(self, axes):
        return dataclasses.replace(super().model_axes(axes), weights=RESIDENT)

    def differentiate(self, params, storage_specs, shard_specs, axes, dtype):
        """The fsdp shards, each marked per-device over the data axes its shard is
        replicated on (dp; dp and fsdp for the norm scales); the model sees `Resident`
        weights (whole as stored, differentiated as the shard): block weights are made
        whole per layer by `ResidentWeights` inside the scan, embed / unembed here, in
        the dtype `model.loss` gathers them in. Others (norm scales) are the shards."""
        fsdp = axes.fsdp
        diff = broadcast_params(fsdp_shards(params, shard_specs, fsdp),
                                      shard_specs, axes)

        def one(rows, path, shard, whole, spec):
            dim = fsdp_dim(spec, fsdp)
            if dim is None:
                return shard
            name = jax.tree_util.keystr(path)
            if name.startswith("['blocks']"):
                return Resident(shard, whole if rows is None else rows(whole), fsdp)
            resident = Resident(shard, whole, fsdp)
            with jax.named_scope(scopes.EMBED if name == "['embed']" else scopes.LOSS):
                return resident.gather(dim, dtype if name == "['unembed']" else None,
                                       axes.grad_reduce)

        return diff, lambda shards, rows=None: jax.tree_util.tree_map_with_path(
            functools.partial(one, rows), shards, params, shard_specs)


@dataclasses.dataclass(frozen=True)
class Zero1(_Replicated):
    """Grads all-reduced over fsdp as over dp, then sliced to the shard for the update."""

    level: int = 1
    doc: str = ("optimizer state sharded over fsdp; grads all-reduced as over dp, then "
                "sliced to the shard; updated shards all-gathered back")

    def grad_specs(self, storage_specs, shard_specs):
        return storage_specs

    def _shard_grads(self, grads, shard_specs, fsdp):
        return fsdp_shards(grads, shard_specs, fsdp)


ZERO_LEVELS: dict[int, ZeroLevel] = {z.level: z for z in (Zero1(), Zero2(), Zero3())}
ZERO = tuple(ZERO_LEVELS)


def level(zero: int, fsdp: str | None) -> ZeroLevel:
    """The strategy of ZeRO level `zero`; zero 3's without an fsdp axis (the same
    program under every level)."""
    return ZERO_LEVELS[zero if fsdp is not None else 3]
