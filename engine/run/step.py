"""One training step = one `jax.jit(jax.shard_map(step))`; every collective is in the code.

`parallel.zero` picks what the fsdp axis shards (params / grads / optimizer state): a
strategy from engine/parallel/zero.py (storage and grad specs, what the model sees, the loss's
reduction, the update). `parallel.tp_comm`, `parallel.cp_comm` and `parallel.prefetch`
reach the layers through `layers.axes.Axes`. `parallel.microbatches` splits the local
batch into microbatches whose grads are accumulated in a scan (`Trainer._accumulate`). Under cp the tokens are replicated over cp
and each rank cuts its load-balanced chunks at the start of the loss (layers/context.py).
With `ModelConfig.document_eos` the packed documents' ids are derived from the same
tokens (layers/documents.py) and cut alike.
The step body below is the same for every setting.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import collectives
from engine.config import ParallelConfig, TrainConfig
from engine.parallel import pipeline, zero
from engine.parallel.grads import all_reduce_grads, clip_by_norm, global_norm
from engine.parallel.layout import Layout
from engine.parallel.params import (
    activation_spec,
    fsdp_dims,
    init_params,
    param_specs,
)
from engine.parallel.validate import check
from engine.run import optim
from layers import context, documents, model, moe, scopes
from layers.axes import GatherWeights
from layers.config import ModelConfig


class StateSpecs(NamedTuple):
    """How a step's state is laid out on the mesh: the role axes, the ZeRO level, the
    params' specs as the table shards them over fsdp (`shard_specs`), as stored between
    steps (`specs`), their grads' and the optimizer state's."""

    axes: object
    zero: object
    shard_specs: dict
    specs: dict
    grad_specs: dict
    opt_specs: object


def state_specs(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout,
                parallel: ParallelConfig = ParallelConfig()) -> StateSpecs:
    """The `StateSpecs` of a `Trainer(cfg, tcfg, layout, mesh, parallel)`, without one
    (the memory model reads them for every program a plan checks)."""
    axes = layout.role_axes(tp_comm=collectives.TP_COMMS[parallel.tp_comm],
                            cp_comm=parallel.cp_comm, prefetch=parallel.prefetch,
                            grad_reduce=parallel.grad_reduce)
    level = zero.level(parallel.zero, axes.fsdp)
    shard = param_specs(cfg, layout)  # sharded over fsdp as the table says
    specs = level.storage_specs(shard, axes.fsdp)  # between steps
    return StateSpecs(axes, level, shard, specs, level.grad_specs(specs, shard),
                      optim.opt_state_specs(tcfg, cfg, shard))


class Trainer:
    """The model, layout and optimizer bound to a mesh.

    train_step(params, opt_state, tokens) -> (params, opt_state, {"loss", "grad_norm",
        and with experts the router metrics of `layers.moe.router_losses` and "ce_loss"})
    loss(params, tokens) -> cross-entropy                        (evaluation)
    loss_and_grads(params, tokens) -> (loss, grads, grad_norm)   (for tests and tools)
    tokens: [B, L+1] int32, global; params stored as `specs`, the optimizer state as
    `opt_specs`, grads returned as `grad_specs`. `parallel` says how the layout's axes
    are used (ZeRO level, prefetch, tp-comm); settings that cannot run together raise
    one `ConfigError` line here (`engine.parallel.validate`), before anything is traced. pack:
    whether ZeRO-3's weight gather moves bf16 as uint32 pairs (`collectives.gather_many`);
    None: where the mesh's backend widens bf16 collectives (`collectives.widens_2byte`).
    A trace on an AbstractMesh for another target passes the target's.
    """

    def __init__(self, cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, mesh,
                 parallel: ParallelConfig = ParallelConfig(), pack: bool | None = None):
        check(cfg, tcfg, parallel, layout)
        self.cfg, self.tcfg, self.layout, self.mesh = cfg, tcfg, layout, mesh
        self.parallel = parallel
        (self.axes, self.zero, self.shard_specs, self.specs, self.grad_specs,
         self.opt_specs) = state_specs(cfg, tcfg, layout, parallel)
        self.tx = optim.make_optimizer(tcfg)
        self.batch_spec = activation_spec("tokens", layout)
        self._dims = fsdp_dims()
        self._model_axes = self.zero.model_axes(self.axes)  # what the model sees
        if isinstance(self._model_axes.weights, GatherWeights):  # packed for XLA:CPU only
            pack = collectives.widens_2byte(mesh) if pack is None else pack
            self._model_axes = dataclasses.replace(self._model_axes,
                                                   weights=GatherWeights(pack=pack))
        if self.axes.pp is not None:
            self.plan = pipeline.step_plan(layout, parallel)
            self.forward_plan = pipeline.step_plan(layout, parallel, backward=False)
        # the model's layer at each row of the stored blocks (None: in order). Params,
        # optimizer state and grads are stored so; checkpoints and `init` use the order
        # of the model (`store` / `unstore`)
        self.layer_order = None
        if self.axes.pp is not None and parallel.pp_virtual > 1:
            self.layer_order = pipeline.storage_order(cfg.n_layers, self.axes.pp_size,
                                                      parallel.pp_virtual)
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
        docs = documents.documents(tokens_BL[:, :-1], self.cfg, self.axes)
        loss, stats = model.loss_and_stats(params, inputs_BL, targets_BL, self._dims,
                                           self.cfg, self._model_axes, docs)
        loss = self.zero.finish_loss(loss, self.axes)
        if not stats:
            return loss, {}
        router, metrics = moe.router_losses(stats, inputs_BL.size * self.axes.data_size,
                                            self.cfg, self.axes.data)
        return loss + router, {"ce_loss": loss, **metrics}

    def _differentiate(self, params):
        """(what the step differentiates, seen: it -> the params the model reads) of the
        stored params, as the ZeRO level makes them (`ZeroLevel.differentiate`: under
        zero 2 the model reads `Resident` weights)."""
        return self.zero.differentiate(params, self.specs, self.shard_specs, self.axes,
                                       self.cfg.compute_dtype)

    def _loss(self, params, tokens_BL):
        """The cross-entropy of a batch (evaluation): the params made what the model sees
        as the step makes them (`_differentiate`), nothing differentiated."""
        diff, seen = self._differentiate(params)
        if self.axes.pp is not None:
            return self._pipeline(diff, tokens_BL, self.forward_plan, seen)
        loss, metrics = self._objective(seen(diff), tokens_BL)
        return metrics.get("ce_loss", loss)

    def _loss_and_grads(self, params, tokens_BL, with_metrics=False):
        diff, seen = self._differentiate(params)
        loss, metrics, grads = self._accumulate(diff, seen, tokens_BL)
        with jax.named_scope(scopes.REDUCE_GRADS):
            grads = all_reduce_grads(grads, self.grad_specs, self.axes)
            grad_norm = global_norm(grads, self.grad_specs)
        if with_metrics:
            return loss, grads, grad_norm, metrics
        return loss, grads, grad_norm

    def _accumulate(self, diff, seen, tokens_BL):
        """(loss, metrics, grads of `diff`) of the local batch [B, L+1], as the mean over
        `parallel.microbatches` microbatches [B/M, L+1] each differentiated on its own in a
        `lax.scan` (one microbatch's activations alive at a time); every microbatch's
        loss is a mean over equally many tokens, so the mean of theirs is the batch's
        (metrics too are means over the microbatches)."""
        if self.axes.pp is not None:
            loss, grads = self._pipeline(diff, tokens_BL, self.plan, seen)
            return loss, {}, pipeline.reduce_shared(grads, self.grad_specs, self.axes)
        value_and_grad = jax.value_and_grad(
            lambda d, t_BL: self._objective(seen(d), t_BL), has_aux=True)
        m = self.parallel.microbatches
        if m == 1:
            (loss, metrics), grads = value_and_grad(diff, tokens_BL)
            return loss, metrics, grads
        tokens_MBL = tokens_BL.reshape(m, tokens_BL.shape[0] // m, *tokens_BL.shape[1:])

        def microbatch(carry, t_BL):
            (loss, metrics), grads = value_and_grad(diff, t_BL)
            return jax.tree.map(jnp.add, carry, (loss, grads)), metrics

        zero = jax.tree.map(collectives.zeros_like, (jnp.float32(0), diff))
        (loss, grads), metrics_M = lax.scan(microbatch, zero, tokens_MBL)
        loss, grads = jax.tree.map(lambda x: x / m, (loss, grads))
        return loss, jax.tree.map(lambda x: x.mean(0), metrics_M), grads

    def _pipeline(self, params, tokens_BL, the_plan, seen):
        """The loss (and with a backward plan the grads) over the pp stages
        (engine/parallel/pipeline.py), the local batch cut into `parallel.microbatches`."""
        m = self.parallel.microbatches
        inputs_MBL, targets_MBL = (
            x.reshape(m, x.shape[0] // m, x.shape[1])
            for x in (context.shard_sequence(t_BL, self.axes)
                      for t_BL in (tokens_BL[:, :-1], tokens_BL[:, 1:])))
        ax, dims, cfg = self._model_axes, self._dims, self.cfg
        docs_M = documents.microbatches(
            documents.documents(tokens_BL[:, :-1], cfg, self.axes), m)
        n_tokens = inputs_MBL[0].size * self.axes.data_size  # a microbatch's, global

        def blocks(p, x_BLD, docs):
            """A chunk's layers, and their share of the microbatch's router losses: the
            losses are means over the model's layers of per-layer terms, so a chunk of n
            layers adds its mean times n / N (`_objective` takes them whole)."""
            x_BLD, stats = model.blocks(p, x_BLD, dims, cfg, ax, docs)
            if not stats:
                return x_BLD, None
            router, _ = moe.router_losses(stats, n_tokens, cfg, self.axes.data)
            return x_BLD, router * (stats["zsum"].shape[0] / cfg.n_layers)

        stages = pipeline.Stages(
            embed=lambda p, i_BL: model.embed(p, i_BL, dims, cfg, ax),
            blocks=blocks,
            head_loss=lambda p, x_BLD, t_BL: self.zero.finish_loss(
                model.head_loss(p, x_BLD, t_BL, dims, cfg, ax), self.axes))
        length = inputs_MBL.shape[2] // (self.axes.tp_size if self.axes.seq_tp else 1)
        x_axes = self.axes.data + ((self.axes.tp,) if self.axes.seq_tp else ())
        return pipeline.run(stages, params, inputs_MBL, targets_MBL,
                            (inputs_MBL.shape[1], length, cfg.d_model), x_axes, self.axes,
                            the_plan, seen, cfg.act_dtype, docs_M,
                            pipeline.stash_residuals(self.layout, self.parallel))

    def _train_step(self, params, opt_state, tokens_BL):
        loss, grads, grad_norm, metrics = self._loss_and_grads(params, tokens_BL, True)
        with jax.named_scope(scopes.OPTIMIZER):
            grads = clip_by_norm(grads, grad_norm, self.tcfg.clip_norm)
            params, opt_state = self.zero.update(self.tx, grads, opt_state, params,
                                                 self.shard_specs, self.axes.fsdp)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}

    # -- host side --------------------------------------------------------------------
    def store(self, tree):
        """A tree of device arrays in the model's layer order (params, an optimizer
        state) as this trainer stores it (`layer_order`), on the same shardings."""
        return self._reorder(tree, self.layer_order)

    def unstore(self, tree):
        """The inverse of `store`: the model's layer order (for checkpoints, tests)."""
        return self._reorder(tree, None if self.layer_order is None
                             else np.argsort(self.layer_order))

    def _reorder(self, tree, index):
        if index is None:
            return tree
        shardings = jax.tree.map(lambda x: x.sharding, tree)
        return jax.jit(lambda t: pipeline.reorder_blocks(t, index), out_shardings=shardings)(tree)

    def init(self, seed: int):
        """(params, opt_state), sharded; params are layout-invariant for a seed."""
        params = self.store(init_params(self.cfg, self.layout, self.mesh, seed,
                                        self.zero.level))
        return params, self.init_opt(params)

    def init_opt(self, params):
        """A fresh optimizer state (zero moments, count 0) for `params`, sharded."""
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.opt_specs)
        return jax.jit(self.tx.init, out_shardings=shardings)(params)

    def put_batch(self, tokens: np.ndarray) -> jax.Array:
        """Global host tokens [B, L+1] -> a device array sharded over the batch axes."""
        return jax.device_put(tokens, NamedSharding(self.mesh, self.batch_spec))
