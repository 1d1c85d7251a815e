"""AdamW (optax) on local shards, with the sharding-aware pieces written out:
param broadcast / grad all-reduce over the batch axes a param is replicated on, and a
global grad norm that counts every param once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import collectives
from engine.config import TrainConfig
from layers.axes import Axes


def schedule(tcfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at the last step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tcfg.lr, warmup_steps=tcfg.warmup,
        decay_steps=max(tcfg.steps, tcfg.warmup + 1), end_value=tcfg.lr * tcfg.min_lr_ratio)


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


def replicated_batch_axes(spec: P, axes: Axes) -> tuple[str, ...]:
    """Batch axes a param is stored replicated over: its grads need an all-reduce there."""
    return tuple(a for a in axes.batch if a not in spec_axes(spec))


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
