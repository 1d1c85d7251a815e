"""The whole model per shard: embedding -> scanned blocks -> norm -> vocab-parallel loss."""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

import collectives
from layers import vocab
from layers.axes import Axes
from layers.block import blocks
from layers.config import ModelConfig
from layers.norm import rms_norm


def loss(params: dict, tokens_BL: jax.Array, fsdp_dims: Mapping, cfg: ModelConfig,
         axes: Axes) -> jax.Array:
    """Mean next-token cross-entropy over the global batch (a scalar, the same on every device).

    params: local shards as stored (see engine/params.py); tokens: [B_batch, L+1] with the
    batch sharded over `axes.batch`; position t predicts token t+1. fsdp_dims: for every
    param, the dim sharded over fsdp (None if replicated), in per-layer coordinates.
    Between the embedding and the loss the residual stream is [B, L, D] replicated over
    tp (axes.tp_comm allreduce) or [B, L_tp, D] (sequence, ring).
    """
    inputs_BL, targets_BL = tokens_BL[:, :-1], tokens_BL[:, 1:]
    with jax.named_scope("embed"):
        embed_VD = collectives.gather(params["embed"], axes.fsdp, dim=fsdp_dims["embed"])
        x_BLD = vocab.embed(inputs_BL, embed_VD, axes, axes.tp_comm)
    x_BLD = blocks(x_BLD, params["blocks"], fsdp_dims["blocks"], cfg, axes)
    with jax.named_scope("loss"):
        # sequence, ring: x is [B, L_tp, D], so the scale's grad is a partial sum over tp,
        # all-reduced by the broadcast's bwd (allreduce: x replicated, nothing to reduce)
        seq_tp = axes.seq_tp
        h_BLD = rms_norm(x_BLD, collectives.broadcast(params["final_norm"], seq_tp),
                         cfg.norm_eps)
        unembed_DV = collectives.gather(params["unembed"].astype(cfg.compute_dtype), axes.fsdp,
                                        dim=fsdp_dims["unembed"])
        loss_BL = vocab.cross_entropy(h_BLD, unembed_DV, targets_BL, axes, cfg.compute_dtype,
                                      axes.tp_comm)
        n_tokens = loss_BL.size * axes.batch_size
        return collectives.all_reduce(jnp.sum(loss_BL), axes.batch) / n_tokens
