"""Megatron GQA attention per shard: QKV column-parallel over heads, output row-parallel.

Letter key: B batch, L query length, S key length, D model, H query heads, G kv heads,
R = H/G query heads per kv head, K head dim. Shapes are per shard unless noted.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers.axes import Axes
from layers.common import einsum
from layers.config import ModelConfig
from layers.flash_blocked import blocked_attention
from layers.flash_chunked import chunked_attention
from layers.flash_pallas import pallas_attention
from layers.rope import rope

# Sequences at least this long use the blocked flash path under `attention="auto"`: from
# there on dense O(L^2) scores dominate memory (bench/attention.py). Shorter ones use
# `chunked`: dense scores, causal tiles skipped, flash backward (the fastest kernel on
# CPU at L = 256: README, "Performance").
AUTO_BLOCKED_FROM = 1024


def reference_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True) -> jax.Array:
    """Dense softmax attention, f32 scores. GQA: query head h reads kv head h // R.

    q: [B, L, H, K]; k, v: [B, S, G, K] -> o: [B, L, H, K] in q's dtype.
    """
    B, L, H, K = q_BLHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                         preferred_element_type=jnp.float32) / math.sqrt(K)
    if causal:
        mask_LS = jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
        s_BGRLS = jnp.where(mask_LS, s_BGRLS, jnp.finfo(jnp.float32).min)
    p_BGRLS = jax.nn.softmax(s_BGRLS, axis=-1)
    o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p_BGRLS.astype(v_BSGK.dtype), v_BSGK,
                         preferred_element_type=jnp.float32)
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)


KERNELS = {"reference": reference_attention, "chunked": chunked_attention,
           "blocked": blocked_attention, "pallas": pallas_attention}


def resolve_attention(name: str, seq: int) -> str:
    """The kernel `ModelConfig.attention` names for sequences of `seq` tokens: `auto` is
    `blocked` from AUTO_BLOCKED_FROM tokens on, else `chunked`."""
    if name == "auto":
        return "blocked" if seq >= AUTO_BLOCKED_FROM else "chunked"
    return name


def attention_kernel(name: str, seq: int):
    return KERNELS[resolve_attention(name, seq)]


def kv_weights_for_rank(w_DGK: jax.Array, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """This tp rank's kv-head weights.

    When tp divides G the table shards kv heads over tp and w is already [D, G_tp, K].
    When tp > G (Megatron's GQA rule) kv weights are replicated over tp: every local query
    head belongs to one kv head g = rank * H_tp // R, sliced here: [D, G, K] -> [D, 1, K].
    """
    if axes.tp_size <= cfg.n_kv_heads:
        return w_DGK
    h_per_rank = cfg.n_heads // axes.tp_size
    g = collectives.axis_index(axes.tp) * h_per_rank // cfg.group
    # the slice differs per rank, so the weight becomes per-rank: its grad is all-reduced over tp
    w_DGK = collectives.broadcast(w_DGK, axes.tp)
    return lax.dynamic_slice_in_dim(w_DGK, g, 1, axis=1)


def qkv_projections(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes):
    """Column-parallel Q, K, V before RoPE, over the whole sequence.

    x: [B, L, D] replicated over tp (tp_comm allreduce) or [B, L_tp, D] (sequence, ring)
    -> q [B, L, H_tp, K], k and v [B, L, G_tp, K] (f32 results of compute-dtype matmuls).
    p (gathered over fsdp): wq [D, H_tp, K], wk/wv [D, G_tp, K]."""
    dt = cfg.compute_dtype
    wq_DHK = p["wq"]
    wk_DGK, wv_DGK = (kv_weights_for_rank(p[w], cfg, axes) for w in ("wk", "wv"))

    def qkv(x_BLD):  # the whole sequence, or (ring) one chunk of it at a time
        return (einsum("BLD,DHK->BLHK", x_BLD, wq_DHK, dtype=dt),
                einsum("BLD,DGK->BLGK", x_BLD, wk_DGK, dtype=dt),
                einsum("BLD,DGK->BLGK", x_BLD, wv_DGK, dtype=dt))

    # allreduce: broadcast (bwd all-reduce dx); sequence: all-gather along L (bwd
    # reduce-scatter dx); ring: the gather as ppermutes interleaved with the matmuls
    return collectives.column_parallel(x_BLD, qkv, axes.tp, dim=1, comm=axes.tp_comm)


def out_projection(o_BLHK: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """Row-parallel output. o: [B, L, H_tp, K], wo [H_tp, K, D] -> [B, L, D] replicated
    over tp (tp_comm allreduce) or [B, L_tp, D] (sequence, ring)."""
    out = lambda o_BLHK: einsum("BLHK,HKD->BLD", o_BLHK, p["wo"], dtype=cfg.compute_dtype)
    # partial sums {U_tp}: all-reduce (allreduce), reduce-scatter along L (sequence),
    # or reduce-scatter as ppermutes interleaved with the matmuls (ring)
    return collectives.row_parallel(o_BLHK, out, axes.tp, dim=1, comm=axes.tp_comm)


def attention(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """x: [B, L, D] replicated over tp -> [B, L, D] replicated over tp (tp_comm
    allreduce); x: [B, L_tp, D] -> [B, L_tp, D] (sequence, ring: the projections see the
    whole sequence, so RoPE and the causal mask use global positions).

    p (gathered over fsdp): wq [D, H_tp, K], wk/wv [D, G_tp, K], wo [H_tp, K, D].
    """
    dt = cfg.compute_dtype
    q_BLHK, k_BLGK, v_BLGK = qkv_projections(x_BLD, p, cfg, axes)
    q_BLHK, k_BLGK = rope(q_BLHK, theta=cfg.rope_theta), rope(k_BLGK, theta=cfg.rope_theta)
    attend = attention_kernel(cfg.attention, q_BLHK.shape[1])
    o_BLHK = attend(q_BLHK.astype(dt), k_BLGK.astype(dt), v_BLGK.astype(dt), causal=True)
    return out_projection(o_BLHK, p, cfg, axes)
