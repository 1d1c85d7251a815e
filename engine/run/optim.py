"""AdamW (optax) on local shards and its learning-rate schedule; the grad reductions that
precede it are in engine/parallel/grads.py."""
from __future__ import annotations

import functools

import jax
import optax
from jax.sharding import PartitionSpec as P

from engine.config import TrainConfig
from engine.parallel.params import param_shapes


def schedule(tcfg: TrainConfig) -> optax.Schedule:
    """Learning rate of update `count` (step count + 1): linear warmup lr * (count + 1) /
    warmup, so step 1 already trains and step `warmup` runs at the peak `lr`; then
    `tcfg.schedule` (engine.config.LR_SCHEDULES) down to `lr * min_lr_ratio` at step
    `tcfg.horizon` (`--steps`, or `--lr-schedule-steps`), then flat. A function of the
    count only, which the optimizer state carries, so a resumed run with the same horizon
    follows the same schedule."""
    warmup = max(tcfg.warmup, 1)
    total = max(tcfg.horizon - 1, warmup, 1)  # the count of the horizon's step
    return SHAPES[tcfg.schedule](tcfg, warmup, total)


def _cosine(tcfg: TrainConfig, warmup: int, total: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=tcfg.lr / warmup, peak_value=tcfg.lr, warmup_steps=warmup - 1,
        decay_steps=total, end_value=tcfg.lr * tcfg.min_lr_ratio)


def _after_warmup(tcfg: TrainConfig, warmup: int, after: optax.Schedule) -> optax.Schedule:
    """Linear warmup to the peak at count warmup - 1, then `after` (counted from there)."""
    ramp = optax.linear_schedule(tcfg.lr / warmup, tcfg.lr, warmup - 1)
    return optax.join_schedules([ramp, after], [warmup - 1])


def _linear(tcfg: TrainConfig, warmup: int, total: int) -> optax.Schedule:
    return _after_warmup(tcfg, warmup, optax.linear_schedule(
        tcfg.lr, tcfg.lr * tcfg.min_lr_ratio, total - (warmup - 1)))


def _constant(tcfg: TrainConfig, warmup: int, total: int) -> optax.Schedule:
    return _after_warmup(tcfg, warmup, optax.constant_schedule(tcfg.lr))


def _warmup_stable_decay(tcfg: TrainConfig, warmup: int, total: int) -> optax.Schedule:
    after = total - (warmup - 1)
    decay = min(max(round(tcfg.decay_fraction * (total + 1)), 1), after)
    return _after_warmup(tcfg, warmup, optax.join_schedules(
        [optax.constant_schedule(tcfg.lr),
         optax.linear_schedule(tcfg.lr, tcfg.lr * tcfg.min_lr_ratio, decay)],
        [after - decay]))


# the decay after warmup of each of engine.config.LR_SCHEDULES (where their docs are)
SHAPES = {"cosine": _cosine, "linear": _linear, "constant": _constant,
          "warmup-stable-decay": _warmup_stable_decay}


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW; no weight decay on norm scales. Clipping happens before, in `clip_by_norm`,
    because optax's own global norm would only see the local shard."""

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(path[-1].key).endswith("norm"), params)

    return optax.adamw(schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                       weight_decay=tcfg.weight_decay, mask=decay_mask)


def state_shapes(tcfg: TrainConfig, cfg):
    """The optimizer state's shapes for the params of `cfg` (a ModelConfig): one
    `jax.eval_shape` of the optimizer's init, a trace, once per optimizer and param
    shapes (every layout and switch the planner prices shares it)."""
    shapes = param_shapes(cfg)
    leaves, tree = jax.tree_util.tree_flatten(shapes)
    return _state_shapes(tcfg, tree, tuple((x.shape, x.dtype) for x in leaves))


@functools.lru_cache(maxsize=16)
def _state_shapes(tcfg: TrainConfig, tree, leaves: tuple):
    shapes = jax.tree_util.tree_unflatten(tree, [jax.ShapeDtypeStruct(*x) for x in leaves])
    return jax.eval_shape(make_optimizer(tcfg).init, shapes)


def opt_state_specs(tcfg: TrainConfig, cfg, param_specs):
    """The optimizer state's PartitionSpecs: like the params for per-param leaves, P()
    (replicated) for the rest (step counts). Once per optimizer, param shapes and specs."""
    leaves, tree = jax.tree_util.tree_flatten(param_specs, is_leaf=lambda x: isinstance(x, P))
    return _opt_state_specs(tcfg, cfg, tree, tuple(leaves))


@functools.lru_cache(maxsize=1024)
def _opt_state_specs(tcfg: TrainConfig, cfg, tree, leaves: tuple):
    param_specs = jax.tree_util.tree_unflatten(tree, leaves)
    return optax.tree_map_params(make_optimizer(tcfg), lambda _, spec: spec,
                                 state_shapes(tcfg, cfg), param_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))
