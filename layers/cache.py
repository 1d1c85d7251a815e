"""Per-shard decoding with a KV cache: the training model's `embed`, `block` and `head`
over a static-size cache.

Letter key as in layers/attention.py, plus C cache length (static). One layer's cache is
k, v [B, C, G_tp, K]; stacked over layers [N, B, C, G_tp, K]. When tp > G each tp rank
caches the one kv head its query heads read (G_tp = 1).

Row b holds its tokens at cache slots [0, n_b). A forward over L new tokens starting
at slot start_b writes slots start_b + [0, L) and RoPE-rotates them at those positions;
query l sees slots <= start_b + l (`layers.attention.LayerCache`: the dense reference
kernel with one query offset per row). Slots not yet written, and slots holding a
right-padded prompt's padding (overwritten before any query can see them), are masked.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers import model, scopes, vocab
from layers.attention import LayerCache
from layers.axes import Axes
from layers.block import block, gather_weights
from layers.common import einsum
from layers.config import ModelConfig


class KVCache(NamedTuple):
    """Keys (after RoPE) and values of every layer, in the compute dtype."""

    k_NBCGK: jax.Array
    v_NBCGK: jax.Array


def forward(params: dict, cache: KVCache, tokens_BL, start_B, last_B,
            fsdp_dims: Mapping, cfg: ModelConfig, axes: Axes):
    """L new tokens per row through the model, each layer's weights gathered over fsdp
    inside the scan as in training -> (logits [B, V_tp] of token last_B[b] of each row,
    the cache with the new tokens written).

    params: local shards as stored (engine/parallel/params.py); tokens: [B, L]; start_B: the
    cache slot of each row's first new token; last_B: index in [0, L). Decoding always
    keeps activations replicated over tp (tp_comm allreduce): a step has one token per row.
    """
    axes = dataclasses.replace(axes, tp_comm=collectives.TP_COMMS["allreduce"])
    x_BLD = model.embed(params, tokens_BL, fsdp_dims, cfg, axes)

    def body(x_BLD, layer):
        p_layer, k_BCGK, v_BCGK = layer
        with jax.named_scope(scopes.GATHER_PARAMS):
            p = gather_weights(p_layer, fsdp_dims["blocks"], axes, cfg.compute_dtype)
        x_BLD, kv = block(x_BLD, p, cfg, axes, LayerCache(k_BCGK, v_BCGK, start_B))
        return x_BLD, (kv.k_BCGK, kv.v_BCGK)

    x_BLD, (k_NBCGK, v_NBCGK) = lax.scan(body, x_BLD, (params["blocks"], *cache))
    with jax.named_scope(scopes.LOGITS):
        x_B1D = jnp.take_along_axis(x_BLD, last_B[:, None, None], axis=1)
        h_B1D, unembed_DV = model.head(params, x_B1D, fsdp_dims, cfg, axes)
        h_BD = collectives.broadcast(h_B1D[:, 0], axes.tp)
        logits_BV = einsum("BD,DV->BV", h_BD, unembed_DV, dtype=cfg.compute_dtype)
        logits_BV = vocab.mask_padding(logits_BV, model.padding(cfg), axes)
    return logits_BV, KVCache(k_NBCGK, v_NBCGK)
