"""AdamW (optax) on local shards and its learning-rate schedule; the grad reductions that
precede it are in engine/parallel/grads.py."""
from __future__ import annotations

import jax
import optax
from jax.sharding import PartitionSpec as P

from engine.config import TrainConfig


def schedule(tcfg: TrainConfig) -> optax.Schedule:
    """Learning rate of update `count` (step count + 1): linear warmup lr * (count + 1) /
    warmup, so step 1 already trains and step `warmup` runs at the peak `lr`; then cosine
    decay to `lr * min_lr_ratio` at step `tcfg.horizon` (`--steps`, or
    `--lr-schedule-steps`), then flat. A function of the count only, which the optimizer
    state carries, so a resumed run with the same horizon follows the same schedule."""
    warmup = max(tcfg.warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=tcfg.lr / warmup, peak_value=tcfg.lr, warmup_steps=warmup - 1,
        decay_steps=max(tcfg.horizon - 1, warmup, 1), end_value=tcfg.lr * tcfg.min_lr_ratio)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW; no weight decay on norm scales. Clipping happens before, in `clip_by_norm`,
    because optax's own global norm would only see the local shard."""

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(path[-1].key).endswith("norm"), params)

    return optax.adamw(schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay,
                       mask=decay_mask)


def opt_state_specs(tx: optax.GradientTransformation, param_shapes, param_specs):
    """The optimizer state's PartitionSpecs: like the params for per-param leaves, P()
    (replicated) for the rest (step counts)."""
    state_shapes = jax.eval_shape(tx.init, param_shapes)
    return optax.tree_map_params(tx, lambda _, spec: spec, state_shapes, param_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


