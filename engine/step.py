"""One training step = one `jax.jit(jax.shard_map(step))`; every collective is in the code.

`parallel.zero` picks what the fsdp axis shards (params / grads / optimizer state): a
strategy from engine/zero.py (storage and grad specs, what the model sees, the loss's
reduction, the update). `parallel.tp_comm`, `parallel.cp_comm` and `parallel.prefetch`
reach the layers through `layers.axes.Axes`. Under cp the tokens are replicated over cp
and each rank cuts its load-balanced chunks at the start of the loss (layers/context.py).
The step body below is the same for every setting.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import collectives
from engine import optim, zero
from engine.config import ParallelConfig, TrainConfig
from engine.layout import Layout
from engine.params import activation_spec, fsdp_dims, init_params, param_shapes, param_specs
from engine.validate import check
from layers import context, model, moe, scopes
from layers.config import ModelConfig


class Trainer:
    """The model, layout and optimizer bound to a mesh.

    train_step(params, opt_state, tokens) -> (params, opt_state, {"loss", "grad_norm",
        and with experts the router metrics of `layers.moe.router_losses` and "ce_loss"})
    loss(params, tokens) -> cross-entropy                        (evaluation)
    loss_and_grads(params, tokens) -> (loss, grads, grad_norm)   (for tests and tools)
    tokens: [B, L+1] int32, global; params stored as `specs`, the optimizer state as
    `opt_specs`, grads returned as `grad_specs`. `parallel` says how the layout's axes
    are used (ZeRO level, prefetch, tp-comm); settings that cannot run together raise
    one `ConfigError` line here (`engine.validate`), before anything is traced.
    """

    def __init__(self, cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, mesh,
                 parallel: ParallelConfig = ParallelConfig()):
        check(cfg, tcfg, parallel, layout)
        self.cfg, self.tcfg, self.layout, self.mesh = cfg, tcfg, layout, mesh
        self.parallel = parallel
        self.axes = layout.role_axes(tp_comm=collectives.TP_COMMS[parallel.tp_comm],
                                     cp_comm=parallel.cp_comm, prefetch=parallel.prefetch)
        self.zero = zero.level(parallel.zero, self.axes.fsdp)
        self.shard_specs = param_specs(cfg, layout)  # sharded over fsdp as the table says
        self.specs = self.zero.storage_specs(self.shard_specs, self.axes.fsdp)  # between steps
        self.grad_specs = self.zero.grad_specs(self.specs, self.shard_specs)
        self.tx = optim.make_optimizer(tcfg)
        self.opt_specs = optim.opt_state_specs(self.tx, param_shapes(cfg), self.shard_specs)
        self.batch_spec = activation_spec("tokens", layout)
        self._dims = fsdp_dims()
        self._model_axes = self.zero.model_axes(self.axes)  # what the model sees
        shard = functools.partial(jax.shard_map, mesh=mesh)  # check_vma stays on
        self.train_step = jax.jit(
            shard(self._train_step, in_specs=(self.specs, self.opt_specs, self.batch_spec),
                  out_specs=(self.specs, self.opt_specs, P())),
            donate_argnums=(0, 1))
        self.loss = jax.jit(
            shard(self._loss, in_specs=(self.specs, self.batch_spec), out_specs=P()))
        self.loss_and_grads = jax.jit(
            shard(self._loss_and_grads, in_specs=(self.specs, self.batch_spec),
                  out_specs=(P(), self.grad_specs, P())))

    # -- per-shard bodies -------------------------------------------------------------
    def _objective(self, params, tokens_BL):
        """(the loss differentiated, metrics): the cross-entropy plus, with experts, the
        router losses (`layers.moe.router_losses`, over every data axis of the layout)."""
        # cp: tokens arrive replicated over cp (int32, L+1 per row: small next to the
        # activations) and each rank cuts its two load-balanced chunks of inputs and
        # targets here, once, with local slices; the batch format, put_batch and every
        # caller of it stay as they are
        inputs_BL, targets_BL = (context.shard_sequence(x_BL, self.axes)
                                 for x_BL in (tokens_BL[:, :-1], tokens_BL[:, 1:]))
        loss, stats = model.loss_and_stats(params, inputs_BL, targets_BL, self._dims,
                                           self.cfg, self._model_axes)
        loss = self.zero.finish_loss(loss, self.axes)
        if not stats:
            return loss, {}
        router, metrics = moe.router_losses(stats, inputs_BL.size * self.axes.data_size,
                                            self.cfg, self.axes.data)
        return loss + router, {"ce_loss": loss, **metrics}

    def _loss(self, params, tokens_BL):
        loss, metrics = self._objective(params, tokens_BL)
        return metrics.get("ce_loss", loss)  # evaluation: the cross-entropy

    def _loss_and_grads(self, params, tokens_BL, with_metrics=False):
        diff, seen = self.zero.differentiate(params, self.specs, self.shard_specs, self.axes,
                                             self.cfg.compute_dtype)
        (loss, metrics), grads = jax.value_and_grad(
            lambda d: self._objective(seen(d), tokens_BL), has_aux=True)(diff)
        with jax.named_scope(scopes.REDUCE_GRADS):
            grads = optim.all_reduce_grads(grads, self.grad_specs, self.axes)
            grad_norm = optim.global_norm(grads, self.grad_specs)
        if with_metrics:
            return loss, grads, grad_norm, metrics
        return loss, grads, grad_norm

    def _train_step(self, params, opt_state, tokens_BL):
        loss, grads, grad_norm, metrics = self._loss_and_grads(params, tokens_BL, True)
        with jax.named_scope(scopes.OPTIMIZER):
            grads = optim.clip_by_norm(grads, grad_norm, self.tcfg.clip_norm)
            params, opt_state = self.zero.update(self.tx, grads, opt_state, params,
                                                 self.shard_specs, self.axes.fsdp)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}

    # -- host side --------------------------------------------------------------------
    def init(self, seed: int):
        """(params, opt_state), sharded; params are layout-invariant for a seed."""
        params = init_params(self.cfg, self.layout, self.mesh, seed, self.zero.level)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.opt_specs)
        opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        return params, opt_state

    def put_batch(self, tokens: np.ndarray) -> jax.Array:
        """Global host tokens [B, L+1] -> a device array sharded over the batch axes."""
        return jax.device_put(tokens, NamedSharding(self.mesh, self.batch_spec))
