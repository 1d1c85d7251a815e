"""Megatron GQA attention per shard: QKV column-parallel over heads, output row-parallel;
the kernel between them is picked from `layers.kernels.KERNELS` by `cfg.attention`.
Decoding runs the same layer against a KV cache (`LayerCache`).

Letter key: B batch, L query length, S key length, D model, H query heads, G kv heads,
R = H/G query heads per kv head, K head dim, C cache length. Shapes are per shard unless
noted.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import collectives
from layers import scopes
from layers.axes import Axes
from layers.common import einsum
from layers.config import ModelConfig
from layers.documents import Documents
from layers.kernels import attention_kernel, reference_attention
from layers.kernels import resolve_attention  # noqa: F401 (re-exported for the CLIs)
from layers.kernels.context import CP_COMMS
from layers.context import local_positions
from layers.rope import Rope, rope, rope_at, rope_rows


class LayerCache(NamedTuple):
    """One layer's KV cache while decoding, and where this call's new tokens go.

    k, v [B, C, G_tp, K] (after RoPE, compute dtype); row b's new tokens are at positions
    (= cache slots) start_B[b] + [0, L). Slots above a query's position (not yet written,
    or a right-padded prompt's padding, overwritten before any query can see it) are
    masked by the causal mask."""

    k_BCGK: jax.Array
    v_BCGK: jax.Array
    start_B: jax.Array

    def write(self, k_BLGK: jax.Array, v_BLGK: jax.Array) -> "LayerCache":
        """The cache with row b of the new keys and values in slots start_B[b] + [0, L)
        (callers keep them inside C)."""
        write = lambda c_CGK, n_LGK, s: lax.dynamic_update_slice_in_dim(c_CGK, n_LGK, s, axis=0)
        rows = lambda c_BCGK, n_BLGK: jax.vmap(write)(c_BCGK, n_BLGK.astype(c_BCGK.dtype),
                                                      self.start_B)
        return LayerCache(rows(self.k_BCGK, k_BLGK), rows(self.v_BCGK, v_BLGK), self.start_B)


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
    -> q [B, L, H_tp, K], k and v [B, L, G_tp, K] (compute-dtype matmuls, results in the
    activation dtype).
    p (gathered over fsdp): wq [D, H_tp, K], wk/wv [D, G_tp, K]."""
    dt, at = cfg.compute_dtype, cfg.act_dtype
    wq_DHK = p["wq"]
    wk_DGK, wv_DGK = (kv_weights_for_rank(p[w], cfg, axes) for w in ("wk", "wv"))

    def qkv(x_BLD):  # the whole sequence, or (ring) one chunk of it at a time
        return (einsum("BLD,DHK->BLHK", x_BLD, wq_DHK, dtype=dt, out=at),
                einsum("BLD,DGK->BLGK", x_BLD, wk_DGK, dtype=dt, out=at),
                einsum("BLD,DGK->BLGK", x_BLD, wv_DGK, dtype=dt, out=at))

    # allreduce: broadcast (bwd all-reduce dx); sequence: all-gather along L (bwd
    # reduce-scatter dx); ring: the gather as ppermutes interleaved with the matmuls
    q_BLHK, k_BLGK, v_BLGK = collectives.column_parallel(x_BLD, qkv, axes.tp, dim=1,
                                                         comm=axes.tp_comm)
    return (checkpoint_name(q_BLHK, scopes.Q), checkpoint_name(k_BLGK, scopes.K),
            checkpoint_name(v_BLGK, scopes.V))


def out_projection(o_BLHK: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """Row-parallel output. o: [B, L, H_tp, K], wo [H_tp, K, D] -> [B, L, D] replicated
    over tp (tp_comm allreduce) or [B, L_tp, D] (sequence, ring)."""
    out = lambda o_BLHK: einsum("BLHK,HKD->BLD", o_BLHK, p["wo"], dtype=cfg.compute_dtype,
                                out=cfg.act_dtype)
    # partial sums {U_tp}: all-reduce (allreduce), reduce-scatter along L (sequence),
    # or reduce-scatter as ppermutes interleaved with the matmuls (ring)
    y_BLD = collectives.row_parallel(checkpoint_name(o_BLHK, scopes.CONTEXT), out, axes.tp,
                                     dim=1, comm=axes.tp_comm)
    if axes.tp is not None and axes.tp_size > 1:  # the sum crossed devices
        y_BLD = checkpoint_name(y_BLD, scopes.ATTN_OUT_TP)
    return checkpoint_name(y_BLD, scopes.ATTN_OUT)


def cp_kernel(name: str) -> str:
    """The local kernel a cp rank's chunks use: `auto` is the dense reference (the one
    kernel taking global offsets: `layers.kernels.context.CP_KERNELS`)."""
    return "reference" if name == "auto" else name


def rope_documents(x_BLHK: jax.Array, pos_BL: jax.Array, theta: float | Rope) -> jax.Array:
    """RoPE with row b's token l at position pos_BL[b, l] (in-document positions).
    [B, L, H, K] -> same."""
    return jax.vmap(lambda x_LHK, pos_L: rope_at(x_LHK[None], pos_L, theta)[0])(x_BLHK, pos_BL)


def attention(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes,
              cache: LayerCache | None = None, docs: Documents | None = None):
    """x: [B, L, D] replicated over tp -> [B, L, D] replicated over tp (tp_comm
    allreduce); x: [B, L_tp, D] -> [B, L_tp, D] (sequence, ring: the projections see the
    whole sequence, so RoPE and the causal mask use global positions).

    p (gathered over fsdp): wq [D, H_tp, K], wk/wv [D, G_tp, K], wo [H_tp, K, D].
    cache (decoding, tp_comm allreduce): the new tokens' keys and values are RoPE-rotated
    at their positions and written into it, and the queries attend over the whole cache
    (the dense reference kernel with one query offset per row); returns (y, the cache
    with the new tokens) instead of y.
    Under cp, L is this rank's two load-balanced chunks (layers/context.py): RoPE at
    their global positions, keys and values from every cp rank as `axes.cp_comm` says.
    docs (packed documents, layers/documents.py): every kernel also masks keys of other
    documents, and with in-document positions RoPE uses them. Decoding takes no docs:
    a prompt is one document.
    """
    dt = cfg.compute_dtype
    q_BLHK, k_BLGK, v_BLGK = qkv_projections(x_BLD, p, cfg, axes)
    if cache is not None:
        q_BLHK = rope_rows(q_BLHK, cache.start_B, cfg.rope)
        k_BLGK = rope_rows(k_BLGK, cache.start_B, cfg.rope)
        cache = cache.write(k_BLGK, v_BLGK)
        o_BLHK = reference_attention(q_BLHK.astype(dt), cache.k_BCGK, cache.v_BCGK,
                                     q_offset=cache.start_B, axes=axes)
        return out_projection(o_BLHK, p, cfg, axes), cache
    masked = {} if docs is None else dict(segment_ids=docs.segment_ids())
    if docs is not None and docs.positions_BL is not None:  # positions restart per document
        q_BLHK, k_BLGK = (rope_documents(x, docs.positions_BL, cfg.rope)
                          for x in (q_BLHK, k_BLGK))
    elif axes.cp is not None:  # this rank's two chunks: global positions
        pos_L = local_positions(q_BLHK.shape[1], axes)
        q_BLHK, k_BLGK = (rope_at(x, pos_L, cfg.rope) for x in (q_BLHK, k_BLGK))
    else:
        q_BLHK, k_BLGK = rope(q_BLHK, theta=cfg.rope), rope(k_BLGK, theta=cfg.rope)
    if axes.cp is not None:  # keys over cp
        o_BLHK = CP_COMMS[axes.cp_comm](q_BLHK.astype(dt), k_BLGK.astype(dt),
                                        v_BLGK.astype(dt), axes=axes,
                                        kernel=cp_kernel(cfg.attention), **masked)
        return out_projection(o_BLHK, p, cfg, axes)
    attend = attention_kernel(cfg.attention, q_BLHK.shape[1])
    o_BLHK = attend(q_BLHK.astype(dt), k_BLGK.astype(dt), v_BLGK.astype(dt), causal=True,
                    axes=axes, **masked)
    return out_projection(o_BLHK, p, cfg, axes)
