"""AdamW (optax) on local shards, with the sharding-aware pieces written out:
param broadcast / grad all-reduce over the batch axes a param is replicated on, a
global grad norm that counts every param once, and the ZeRO-1/2 pieces (slice a whole
param to its fsdp shard, gather updated shards back, ZeRO-2's resident gather)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import collectives
from engine import roles
from engine.config import TrainConfig
from layers.axes import Axes


def schedule(tcfg: TrainConfig) -> optax.Schedule:
    """Learning rate of update `count` (step count + 1): linear warmup lr * (count + 1) /
    warmup, so step 1 already trains and step `warmup` runs at the peak `lr`; then cosine
    decay to `lr * min_lr_ratio` at the last step. A function of the count only, which the
    optimizer state carries, so a resumed run follows the same schedule."""
    warmup = max(tcfg.warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=tcfg.lr / warmup, peak_value=tcfg.lr, warmup_steps=warmup - 1,
        decay_steps=max(tcfg.steps - 1, warmup, 1), end_value=tcfg.lr * tcfg.min_lr_ratio)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW; no weight decay on norm scales. Clipping happens before, in `clip_by_norm`,
    because optax's own global norm would only see the local shard."""

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(path[-1].key).endswith("norm"), params)

    return optax.adamw(schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay,
                       mask=decay_mask)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Mesh axes named anywhere in a PartitionSpec."""
    out = []
    for entry in spec:
        out.extend((entry,) if isinstance(entry, str) else (entry or ()))
    return tuple(out)


def grad_axes(axes: Axes) -> tuple[str, ...]:
    """The data axes of the layout (the role registry's `data` roles, present in `axes`):
    devices along them see different tokens with the same params."""
    return tuple(a for a in (getattr(axes, r) for r in roles.data_roles()) if a is not None)


def replicated_batch_axes(spec: P, axes: Axes) -> tuple[str, ...]:
    """Data axes a param is stored replicated over: its grads need an all-reduce there."""
    return tuple(a for a in grad_axes(axes) if a not in spec_axes(spec))


def broadcast_params(params, specs, axes: Axes):
    """Mark each param per-device over the batch axes it is replicated on, so that its
    grad comes out per-device too and is reduced once, in `all_reduce_grads`."""
    return jax.tree.map(lambda p, s: collectives.broadcast(p, replicated_batch_axes(s, axes)),
                        params, specs)


def all_reduce_grads(grads, specs, axes: Axes):
    """Sum each grad over the batch axes its param is replicated on (dp, and fsdp for
    params FSDP does not shard). FSDP-sharded grads were already reduce-scattered by the
    transpose of their gather."""
    return jax.tree.map(lambda g, s: collectives.all_reduce(g, replicated_batch_axes(s, axes)),
                        grads, specs)


def global_norm(grads, specs) -> jax.Array:
    """sqrt of the sum of squares of all grads, each element counted once: a leaf's local
    sum is all-reduced over exactly the axes its spec shards it over."""
    sq = jax.tree.map(lambda g, s: collectives.all_reduce(jnp.sum(jnp.square(g)), spec_axes(s)),
                      grads, specs)
    return jnp.sqrt(sum(jax.tree.leaves(sq)))


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads)


def opt_state_specs(tx: optax.GradientTransformation, param_shapes, param_specs):
    """The optimizer state's PartitionSpecs: like the params for per-param leaves, P()
    (replicated) for the rest (step counts)."""
    state_shapes = jax.eval_shape(tx.init, param_shapes)
    return optax.tree_map_params(tx, lambda _, spec: spec, state_shapes, param_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


# -- ZeRO-1 / ZeRO-2: params stored whole on every fsdp device, optimizer state sharded ----
def fsdp_dim(spec: P, axis: str | None) -> int | None:
    """The dim `spec` shards over `axis` (None if it does not, or there is no axis)."""
    if axis is None:
        return None
    return next((d for d, entry in enumerate(spec) if entry == axis), None)


def fsdp_shards(tree, shard_specs, axis: str | None):
    """This device's fsdp shard of every whole leaf: `[.., X, ..] -> [.., X_fsdp, ..]`,
    the slice at its index along `axis` on the dim `shard_specs` shards (leaves they do
    not shard over `axis` pass through). Moves nothing."""

    def shard(x, spec):
        dim = fsdp_dim(spec, axis)
        if dim is None:
            return x
        size = x.shape[dim] // collectives.axis_size(axis)
        return lax.dynamic_slice_in_dim(x, collectives.axis_index(axis) * size, size, axis=dim)

    return jax.tree.map(shard, tree, shard_specs)


def gather_shards(tree, shard_specs, axis: str | None):
    """The inverse of `fsdp_shards`: all-gather every sharded leaf over `axis`, typed
    replicated (the whole params every fsdp device stores under ZeRO-1/2)."""

    def whole(x, spec):
        dim = fsdp_dim(spec, axis)
        return x if dim is None else collectives.gather(x, axis, dim, replicated=True)

    return jax.tree.map(whole, tree, shard_specs)


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
