"""The decoder block and the scan over stacked blocks, with FSDP gathers and remat."""
from __future__ import annotations

from typing import Mapping

import jax
from jax import lax

import collectives
from layers.attention import attention
from layers.axes import Axes
from layers.config import ModelConfig
from layers.mlp import mlp
from layers.norm import rms_norm

# What each remat mode keeps for the backward pass; everything else is recomputed.
# `full`: only the scan carry (the residual stream between blocks), so the backward
# re-gathers each layer's weights over fsdp instead of holding them (ZeRO-3).
# `dots`: also matmul outputs without batch dims (projections: QKV, out, MLP), so
# only attention scores, norms and activations are recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def gather_weights(p: dict, fsdp_dims: Mapping[str, int | None], axes: Axes, dtype) -> dict:
    """All-gather each weight over fsdp along the dim the param table shards.

    Matrices are cast to the compute dtype first, so the gather moves compute-dtype
    bytes; weights not sharded over fsdp (norm scales) pass through in f32."""
    return {
        name: w if fsdp_dims[name] is None
        else collectives.gather(w.astype(dtype), axes.fsdp, dim=fsdp_dims[name])
        for name, w in p.items()
    }


def block(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """Pre-norm decoder block. x: [B, L, D] -> [B, L, D]; p gathered over fsdp."""
    with jax.named_scope("attention"):
        x_BLD = x_BLD + attention(rms_norm(x_BLD, p["attn_norm"], cfg.norm_eps), p, cfg, axes)
    with jax.named_scope("mlp"):
        x_BLD = x_BLD + mlp(rms_norm(x_BLD, p["mlp_norm"], cfg.norm_eps), p, cfg, axes)
    return x_BLD


def blocks(x_BLD: jax.Array, stacked: dict, fsdp_dims: Mapping[str, int | None],
           cfg: ModelConfig, axes: Axes) -> jax.Array:
    """`lax.scan` over N stacked blocks. stacked: {name: [N, ...local shard...]}."""

    def body(x_BLD, p_layer):
        with jax.named_scope("gather_params"):
            p = gather_weights(p_layer, fsdp_dims, axes, cfg.compute_dtype)
        return block(x_BLD, p, cfg, axes), None

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    x_BLD, _ = lax.scan(body, x_BLD, stacked)
    return x_BLD
