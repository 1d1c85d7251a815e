"""One training step = one `jax.jit(jax.shard_map(step))`; every collective is in the code.

`cfg.zero` picks what the fsdp axis shards (params / grads / optimizer state):

    zero 3   params sharded, gathered per layer in the scan; grads reduce-scattered by
             the gathers' transpose; the update runs on the shards.
    zero 2   params stored whole; the step differentiates each param's fsdp shard and the
             forward uses the stored whole through `optim.Resident` (no gather), whose
             backward reduce-scatters the grad per layer; the update runs on the shards,
             which are then all-gathered back to whole params.
    zero 1   params stored whole; grads all-reduced over fsdp (as over dp), then sliced to
             the shard; update and all-gather as zero 2.

The optimizer state is sharded as `param_specs` says under every level. Without an fsdp
axis the three are the same program (zero 3's).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import collectives
from engine import host, optim
from engine.config import TrainConfig
from engine.layout import Layout
from engine.params import fsdp_dims, init_params, param_shapes, param_specs, storage_specs
from layers import model
from layers.config import ModelConfig


class Trainer:
    """The model, layout and optimizer bound to a mesh.

    train_step(params, opt_state, tokens) -> (params, opt_state, {"loss", "grad_norm"})
    loss(params, tokens) -> loss                                 (evaluation)
    loss_and_grads(params, tokens) -> (loss, grads, grad_norm)   (for tests and tools)
    tokens: [B, L+1] int32, global; params stored as `specs`, the optimizer state as
    `opt_specs`, grads returned as `grad_specs`.
    """

    def __init__(self, cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, mesh):
        layout.check(cfg, tcfg.batch)
        if jax.default_backend() == "cpu":
            host.keep_freed_memory()  # XLA:CPU's step buffers stay mapped between steps
        self.cfg, self.tcfg, self.layout, self.mesh = cfg, tcfg, layout, mesh
        self.axes = layout.role_axes()
        self.zero = cfg.zero if self.axes.fsdp is not None else 3
        self.shard_specs = param_specs(cfg, layout)  # sharded over fsdp as the table says
        self.specs = storage_specs(cfg, layout)  # params between steps
        self.grad_specs = self.specs if self.zero == 1 else self.shard_specs
        self.tx = optim.make_optimizer(tcfg)
        self.opt_specs = optim.opt_state_specs(self.tx, param_shapes(cfg), self.shard_specs)
        self.batch_spec = P(self.axes.batch or None, None)
        self._dims = fsdp_dims()
        # What the model sees: under zero 1/2 fsdp is only a batch axis, and one the model
        # does not know (it would gather over it): `_loss` reduces the loss over it.
        self._model_axes = (self.axes if self.zero == 3 else
                            dataclasses.replace(self.axes, fsdp=None, fsdp_size=1))
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
    def _loss(self, params, tokens_BL):
        loss = model.loss(params, tokens_BL[:, :-1], tokens_BL[:, 1:], self._dims, self.cfg,
                          self._model_axes)
        if self.zero == 3:
            return loss
        with jax.named_scope("loss"):  # the model averaged over dp only; now over fsdp
            return collectives.all_reduce(loss, self.axes.fsdp) / self.axes.fsdp_size

    def _resident(self, shards, params):
        """Zero 2: the params the model sees. fsdp-sharded weights become `Resident`
        (whole as stored, differentiated as the shard): block weights are made whole per
        layer by `gather_weights` inside the scan, embed / unembed here, in the dtype
        `model.loss` gathers them in. Others (norm scales) are the shards themselves."""
        fsdp, compute = self.axes.fsdp, self.cfg.compute_dtype

        def one(path, shard, whole, spec):
            dim = optim.fsdp_dim(spec, fsdp)
            if dim is None:
                return shard
            resident = optim.Resident(shard, whole, fsdp)
            name = jax.tree_util.keystr(path)
            if name.startswith("['blocks']"):
                return resident
            with jax.named_scope("embed" if name == "['embed']" else "loss"):
                return resident.gather(dim, compute if name == "['unembed']" else None)

        return jax.tree_util.tree_map_with_path(one, shards, params, self.shard_specs)

    def _loss_and_grads(self, params, tokens_BL):
        if self.zero == 2:
            # differentiate the fsdp shards, each marked per-device over the batch axes
            # its shard is replicated on (dp; dp and fsdp for the norm scales)
            diff = optim.broadcast_params(
                optim.fsdp_shards(params, self.shard_specs, self.axes.fsdp),
                self.shard_specs, self.axes)
            loss_of = lambda shards: self._loss(self._resident(shards, params), tokens_BL)
        else:
            diff = optim.broadcast_params(params, self.specs, self.axes)
            loss_of = lambda params: self._loss(params, tokens_BL)
        loss, grads = jax.value_and_grad(loss_of)(diff)
        with jax.named_scope("reduce_grads"):
            grads = optim.all_reduce_grads(grads, self.grad_specs, self.axes)
            grad_norm = optim.global_norm(grads, self.grad_specs)
        return loss, grads, grad_norm

    def _train_step(self, params, opt_state, tokens_BL):
        loss, grads, grad_norm = self._loss_and_grads(params, tokens_BL)
        fsdp = self.axes.fsdp
        with jax.named_scope("optimizer"):
            grads = optim.clip_by_norm(grads, grad_norm, self.tcfg.clip_norm)
            if self.zero == 1:
                grads = optim.fsdp_shards(grads, self.shard_specs, fsdp)
            local = params if self.zero == 3 else optim.fsdp_shards(params, self.shard_specs,
                                                                    fsdp)
            updates, opt_state = self.tx.update(grads, opt_state, local)
            params = optax.apply_updates(local, updates)
            if self.zero < 3:
                params = optim.gather_shards(params, self.shard_specs, fsdp)
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
