"""The decoder block and the scan over stacked blocks, with FSDP gathers and remat."""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers import scopes
from layers.attention import LayerCache, attention
from layers.axes import Axes
from layers.config import ModelConfig
from layers.mlp import mlp
from layers.moe import moe
from layers.norm import rms_norm

# What each remat mode keeps for the backward pass; everything else is recomputed.
# `full`: only the scan carry (the residual stream between blocks), so the backward
# re-gathers each layer's weights over fsdp instead of holding them (ZeRO-3; with
# prefetch the gathered weights are in the carry, so they are held, see `blocks`).
# `dots`: also matmul outputs without batch dims (projections: QKV, out, MLP), so
# only attention scores, norms and activations are recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT = ("none", *REMAT_POLICIES)  # `ModelConfig.remat` values


def gather_weights(p: dict, fsdp_dims: Mapping[str, int | None], axes: Axes, dtype) -> dict:
    """A layer's weights made whole over fsdp, each along the dim the param table shards,
    as `axes.weights` says: ZeRO-3 all-gathers them in one collective, cast to `dtype`
    first (`layers.axes.GatherWeights`); ZeRO-2's weights are already whole
    (`engine.optim.ResidentWeights`). Weights not sharded over fsdp pass through in f32."""
    return axes.gather_weights(p, fsdp_dims, dtype)


def block(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes,
          cache: LayerCache | None = None):
    """Pre-norm decoder block; p gathered over fsdp. x: [B, L, D] -> [B, L, D] replicated
    over tp (axes.tp_comm allreduce) or [B, L_tp, D] -> [B, L_tp, D] (sequence, ring).
    cache (decoding): the attention reads and writes this layer's KV cache, and the block
    returns (x, cache)."""
    x_BLD, cache, _ = block_stats(x_BLD, p, cfg, axes, cache)
    return x_BLD if cache is None else (x_BLD, cache)


def block_stats(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes,
                cache: LayerCache | None = None):
    """`block` returning (x, cache, the MLP's router sums): `layers.moe.moe`'s local sums
    with experts, {} for the dense MLP."""
    # sequence, ring: the norms run on x's sequence shard, so their scales' grads are
    # partial sums over tp, all-reduced by the broadcast's bwd
    seq_tp = axes.seq_tp
    with jax.named_scope(scopes.ATTENTION):
        scale_D = collectives.broadcast(p["attn_norm"], seq_tp)
        h_BLD = rms_norm(x_BLD, scale_D, cfg.norm_eps)
        if cache is None:
            x_BLD = x_BLD + attention(h_BLD, p, cfg, axes)
        else:
            y_BLD, cache = attention(h_BLD, p, cfg, axes, cache)
            x_BLD = x_BLD + y_BLD
    with jax.named_scope(scopes.MLP):
        scale_D = collectives.broadcast(p["mlp_norm"], seq_tp)
        h_BLD = rms_norm(x_BLD, scale_D, cfg.norm_eps)
        if cfg.moe:
            y_BLD, stats = moe(h_BLD, p, cfg, axes)
        else:
            y_BLD, stats = mlp(h_BLD, p, cfg, axes), {}
        x_BLD = x_BLD + y_BLD
    return x_BLD, cache, stats


def blocks(x_BLD: jax.Array, stacked: dict, fsdp_dims: Mapping[str, int | None],
           cfg: ModelConfig, axes: Axes) -> tuple[jax.Array, dict]:
    """`lax.scan` over N stacked blocks. stacked: {name: [N, ...local shard...]}.
    Returns (x, the blocks' router sums stacked over layers: {name: [N, ...]}, {} dense).

    axes.prefetch: layer i+1's gather is issued in the scan body before layer i's compute,
    which does not wait for it, so the two can overlap. Layer 0 is gathered before the
    scan, the carry holds the gathered weights of the layer the body computes, the scan
    runs over layers 1..N-1 (gathering each for the next iteration) and the last layer
    is computed after it: each weight is gathered exactly N times in the forward, as
    without prefetch. Only the block is rematted, so its gathered weights (the carry)
    are saved for the backward: N layers' whole weights in the compute dtype, and no
    re-gather in the backward (without prefetch, remat re-gathers instead). The last
    layer is not rematted: its backward follows its forward at once, and XLA would
    merge the recompute into the forward (dropping the recompute's collectives)."""

    def gather(p_layer):
        with jax.named_scope(scopes.GATHER_PARAMS):
            return gather_weights(p_layer, fsdp_dims, axes, cfg.compute_dtype)

    def remat(f):
        if cfg.remat == "none":
            return f
        return jax.checkpoint(f, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)

    def one(x_BLD, p):
        x_BLD, _, stats = block_stats(x_BLD, p, cfg, axes)
        return x_BLD, stats

    if not axes.prefetch:
        body = remat(lambda x_BLD, p_layer: one(x_BLD, gather(p_layer)))
        return lax.scan(body, x_BLD, stacked)

    layer = remat(one)

    def prefetch_body(carry, p_next):
        x_BLD, p = carry
        p_next = gather(p_next)  # layer i+1's weights, for the next iteration
        x_BLD, stats = layer(x_BLD, p)
        return (x_BLD, p_next), stats

    first = jax.tree.map(lambda w: w[0], stacked)
    rest = jax.tree.map(lambda w: w[1:], stacked)
    (x_BLD, p_last), stats = lax.scan(prefetch_body, (x_BLD, gather(first)), rest)
    x_BLD, last = one(x_BLD, p_last)
    return x_BLD, jax.tree.map(lambda s, l: jnp.concatenate([s, l[None]]), stats, last)
