"""Grad reductions and fsdp slicing that follow the param table: param broadcast and grad
all-reduce over the batch axes a param is replicated on, a global grad norm that counts
every param once, and ZeRO-1/2's slicing of a whole param to its fsdp shard and the
gather back."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import collectives
from layers import roles
from layers.axes import Axes


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
