"""One training step = one `jax.jit(jax.shard_map(step))`; every collective is in the code."""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from engine import optim
from engine.config import TrainConfig
from engine.layout import Layout
from engine.params import fsdp_dims, init_params, param_shapes, param_specs
from layers import model
from layers.config import ModelConfig


class Trainer:
    """The model, layout and optimizer bound to a mesh.

    train_step(params, opt_state, tokens) -> (params, opt_state, {"loss", "grad_norm"})
    loss(params, tokens) -> loss                                 (evaluation)
    loss_and_grads(params, tokens) -> (loss, grads, grad_norm)   (for tests and tools)
    tokens: [B, L+1] int32, global; params and opt_state sharded as the param table says.
    """

    def __init__(self, cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, mesh):
        layout.check(cfg, tcfg.batch)
        self.cfg, self.tcfg, self.layout, self.mesh = cfg, tcfg, layout, mesh
        self.axes = layout.role_axes()
        self.specs = param_specs(cfg, layout)
        self.tx = optim.make_optimizer(tcfg)
        self.opt_specs = optim.opt_state_specs(self.tx, param_shapes(cfg), self.specs)
        self.batch_spec = P(self.axes.batch or None, None)
        self._dims = fsdp_dims()
        shard = functools.partial(jax.shard_map, mesh=mesh)  # check_vma stays on
        self.train_step = jax.jit(
            shard(self._train_step, in_specs=(self.specs, self.opt_specs, self.batch_spec),
                  out_specs=(self.specs, self.opt_specs, P())),
            donate_argnums=(0, 1))
        self.loss = jax.jit(
            shard(self._loss, in_specs=(self.specs, self.batch_spec), out_specs=P()))
        self.loss_and_grads = jax.jit(
            shard(self._loss_and_grads, in_specs=(self.specs, self.batch_spec),
                  out_specs=(P(), self.specs, P())))

    # -- per-shard bodies -------------------------------------------------------------
    def _loss(self, params, tokens_BL):
        return model.loss(params, tokens_BL, self._dims, self.cfg, self.axes)

    def _loss_and_grads(self, params, tokens_BL):
        params = optim.broadcast_params(params, self.specs, self.axes)
        loss, grads = jax.value_and_grad(model.loss)(params, tokens_BL, self._dims, self.cfg,
                                                     self.axes)
        with jax.named_scope("reduce_grads"):
            grads = optim.all_reduce_grads(grads, self.specs, self.axes)
            grad_norm = optim.global_norm(grads, self.specs)
        return loss, grads, grad_norm

    def _train_step(self, params, opt_state, tokens_BL):
        loss, grads, grad_norm = self._loss_and_grads(params, tokens_BL)
        with jax.named_scope("optimizer"):
            grads = optim.clip_by_norm(grads, grad_norm, self.tcfg.clip_norm)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    # -- host side --------------------------------------------------------------------
    def init(self, seed: int):
        """(params, opt_state), sharded; params are layout-invariant for a seed."""
        params = init_params(self.cfg, self.layout, self.mesh, seed)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.opt_specs)
        opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        return params, opt_state

    def put_batch(self, tokens: np.ndarray) -> jax.Array:
        """Global host tokens [B, L+1] -> a device array sharded over the batch axes."""
        return jax.device_put(tokens, NamedSharding(self.mesh, self.batch_spec))
