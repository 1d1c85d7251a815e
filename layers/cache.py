"""Per-shard decoding with a KV cache: the training layers' math over a static-size cache.

Letter key as in layers/attention.py, plus C cache length (static) and R = H/G. One
layer's cache is k, v [B, C, G_tp, K]; stacked over layers [N, B, C, G_tp, K]. When
tp > G each tp rank caches the one kv head its query heads read (G_tp = 1).

Row b holds its tokens at cache slots [0, n_b). A forward over L new tokens starting
at slot start_b writes slots start_b + [0, L) and RoPE-rotates them at those positions;
query l sees slots <= start_b + l. Slots not yet written, and slots holding a
right-padded prompt's padding (overwritten before any query can see them), are masked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers import vocab
from layers.attention import out_projection, qkv_projections
from layers.axes import Axes
from layers.block import gather_weights
from layers.common import einsum
from layers.config import ModelConfig
from layers.mlp import mlp
from layers.norm import rms_norm
from layers.rope import rope


class KVCache(NamedTuple):
    """Keys (after RoPE) and values of every layer, in the compute dtype."""

    k_NBCGK: jax.Array
    v_NBCGK: jax.Array


def rope_rows(x_BLHK: jax.Array, start_B: jax.Array, theta: float) -> jax.Array:
    """RoPE with row b's tokens at positions start_B[b] + [0, L). [B, L, H, K] -> same."""
    return jax.vmap(lambda x_LHK, s: rope(x_LHK[None], s, theta)[0])(x_BLHK, start_B)


def write_rows(cache_BCGK: jax.Array, new_BLGK: jax.Array, start_B: jax.Array) -> jax.Array:
    """Row b of `new` into cache slots start_B[b] + [0, L) (callers keep them inside C)."""
    write = lambda c_CGK, n_LGK, s: lax.dynamic_update_slice_in_dim(c_CGK, n_LGK, s, axis=0)
    return jax.vmap(write)(cache_BCGK, new_BLGK.astype(cache_BCGK.dtype), start_B)


def masked_attention(q_BLHK, k_BCGK, v_BCGK, start_B) -> jax.Array:
    """Softmax attention over the cache, f32 scores; query l of row b (position
    start_B[b] + l) sees slots <= its position. GQA: query head h reads kv head h // R.

    q: [B, L, H, K]; k, v: [B, C, G, K] -> o: [B, L, H, K] in q's dtype."""
    B, L, H, K = q_BLHK.shape
    C, G = k_BCGK.shape[1], k_BCGK.shape[2]
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    s_BGRLC = jnp.einsum("BLGRK,BCGK->BGRLC", q_BLGRK, k_BCGK,
                         preferred_element_type=jnp.float32) / math.sqrt(K)
    pos_BL = start_B[:, None] + jnp.arange(L)
    seen_BLC = jnp.arange(C)[None, None, :] <= pos_BL[:, :, None]
    s_BGRLC = jnp.where(seen_BLC[:, None, None], s_BGRLC, jnp.finfo(jnp.float32).min)
    p_BGRLC = jax.nn.softmax(s_BGRLC, axis=-1)
    o_BLGRK = jnp.einsum("BGRLC,BCGK->BLGRK", p_BGRLC.astype(v_BCGK.dtype), v_BCGK,
                         preferred_element_type=jnp.float32)
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)


def cached_attention(x_BLD, p: dict, k_BCGK, v_BCGK, start_B, cfg: ModelConfig, axes: Axes):
    """Megatron attention (layers/attention.py) for L new tokens per row, reading and
    writing one layer's cache. x: [B, L, D] replicated over tp ->
    (y [B, L, D] replicated over tp, k and v [B, C, G_tp, K] with the new tokens)."""
    dt = cfg.compute_dtype
    q_BLHK, k_BLGK, v_BLGK = qkv_projections(x_BLD, p, cfg, axes)
    q_BLHK = rope_rows(q_BLHK, start_B, cfg.rope_theta)
    k_BLGK = rope_rows(k_BLGK, start_B, cfg.rope_theta)
    k_BCGK, v_BCGK = write_rows(k_BCGK, k_BLGK, start_B), write_rows(v_BCGK, v_BLGK, start_B)
    o_BLHK = masked_attention(q_BLHK.astype(dt), k_BCGK, v_BCGK, start_B)
    return out_projection(o_BLHK, p, cfg, axes), k_BCGK, v_BCGK


def cached_block(x_BLD, p: dict, k_BCGK, v_BCGK, start_B, cfg: ModelConfig, axes: Axes):
    """layers/block.py's pre-norm block with cached attention -> (x, k, v)."""
    with jax.named_scope("attention"):
        y_BLD, k_BCGK, v_BCGK = cached_attention(rms_norm(x_BLD, p["attn_norm"], cfg.norm_eps),
                                                 p, k_BCGK, v_BCGK, start_B, cfg, axes)
        x_BLD = x_BLD + y_BLD
    with jax.named_scope("mlp"):
        x_BLD = x_BLD + mlp(rms_norm(x_BLD, p["mlp_norm"], cfg.norm_eps), p, cfg, axes)
    return x_BLD, k_BCGK, v_BCGK


def forward(params: dict, cache: KVCache, tokens_BL, start_B, last_B,
            fsdp_dims: Mapping, cfg: ModelConfig, axes: Axes):
    """L new tokens per row through the model, each layer's weights gathered over fsdp
    inside the scan as in training -> (logits [B, V_tp] of token last_B[b] of each row,
    the cache with the new tokens written).

    params: local shards as stored (engine/params.py); tokens: [B, L]; start_B: the
    cache slot of each row's first new token; last_B: index in [0, L). Decoding always
    keeps activations replicated over tp (tp_comm allreduce): a step has one token per row.
    """
    axes = dataclasses.replace(axes, tp_comm=collectives.TP_COMMS["allreduce"])
    with jax.named_scope("embed"):
        embed_VD = collectives.gather(params["embed"], axes.fsdp, dim=fsdp_dims["embed"])
        x_BLD = vocab.embed(tokens_BL, embed_VD, axes)

    def body(x_BLD, layer):
        p_layer, k_BCGK, v_BCGK = layer
        with jax.named_scope("gather_params"):
            p = gather_weights(p_layer, fsdp_dims["blocks"], axes, cfg.compute_dtype)
        x_BLD, k_BCGK, v_BCGK = cached_block(x_BLD, p, k_BCGK, v_BCGK, start_B, cfg, axes)
        return x_BLD, (k_BCGK, v_BCGK)

    x_BLD, (k_NBCGK, v_NBCGK) = lax.scan(body, x_BLD, (params["blocks"], *cache))
    with jax.named_scope("logits"):
        x_BD = jnp.take_along_axis(x_BLD, last_B[:, None, None], axis=1)[:, 0]
        h_BD = rms_norm(x_BD, params["final_norm"], cfg.norm_eps)
        unembed_DV = collectives.gather(params["unembed"].astype(cfg.compute_dtype), axes.fsdp,
                                        dim=fsdp_dims["unembed"])
        h_BD = collectives.broadcast(h_BD, axes.tp)
        logits_BV = einsum("BD,DV->BV", h_BD, unembed_DV, dtype=cfg.compute_dtype)
    return logits_BV, KVCache(k_NBCGK, v_NBCGK)
