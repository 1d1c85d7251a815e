"""Mixture-of-experts MLP per shard: a softmax top-K router, E SwiGLU experts sharded
over ep (tokens go to their experts' devices and back by all-to-all), shared experts.

Letter key (layers/config.py): T = B*L local tokens, A = T*K assignments (k-major: a =
k*T + t, so every token's first choice comes before any second choice), E experts,
X = E/ep experts on this ep rank, F expert hidden (F_tp on a tp rank), P ep peers,
C slots per peer in the send buffer, R = P*C rows received, M slots per expert in
the expert buffer.

Dispatch, with fixed-size buffers (`lax.ragged_all_to_all` is unimplemented on XLA:CPU):
1. Router: logits [T, E] in f32, probs = softmax over all E, the top-K probs are the
   combine weights (Switch / GShard: not renormalized, so they sum to less than 1).
   `router_renorm` divides them by their sum (Mixtral, HF `MixtralSparseMoeBlock`):
   softmax-then-top-K-then-renormalize, which equals top-K-then-softmax over the K
   chosen logits. The choice of experts is the same either way; only the weights
   differ. The load-balancing and z-losses read the full softmax in both.
2. Capacity (capacity_factor c > 0): assignment a of row b to expert e is kept if fewer
   than ceil(c*L*K/E) earlier assignments of row b went to e (k-major priority); the
   rest are dropped and counted. Dropless (c = 0): every assignment is kept.
3. Each kept assignment gets a slot in the send buffer [P, C, D] of its expert's ep rank
   (its rank among the kept assignments to that peer); C is the worst case: T*min(K, X)
   dropless, fewer with a capacity. `all_to_all` over ep: row p of the result is what
   peer p sent here, with each row's local expert id beside it (X: an empty slot).
4. The received rows are placed into a padded expert buffer [X, M, D] (M = P x the most
   rows one peer can send one expert: T dropless) and the experts run as dense einsums
   on it; the outputs go back to their rows, `all_to_all` home, are weighted by the
   router probs and summed over each token's K choices. Dropped assignments add nothing,
   so a token whose every choice was dropped leaves the block as it came (residual).

The experts are padded einsums: on the CPU they ran faster than `jax.lax.ragged_dot`
(rows sorted by expert, one grouped matmul per weight; `python bench/moe.py --matmuls`,
bench/results/2026-11-23-moe-matmuls-cpu.md). The price is E/K times the routed FLOPs
when dropless (every expert's buffer holds its worst case).

tp (allreduce tp_comm only, engine/parallel/validate.py) splits every expert's hidden dim: the
routing and dispatch are the same on every tp rank, the routed tokens are broadcast over
tp before the experts (the backward all-reduces their grad) and the combined output is
all-reduced over tp, as in `layers.mlp`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import collectives
from layers import scopes
from layers.axes import Axes
from layers.common import einsum
from layers.config import ModelConfig
from layers.mlp import mlp
from layers.norm import swiglu

# The per-layer sums `moe` returns (local to this device, not yet reduced over the data
# axes): `router_losses` turns them into the losses and metrics.
STATS = ("count_E", "probs_E", "zsum", "dropped")


def capacity(cfg: ModelConfig, L: int) -> int:
    """Slots per expert per sequence of L tokens: L dropless (an expert can take each
    token once), else min(L, ceil(c*L*K/E)) for capacity_factor c."""
    if cfg.capacity_factor <= 0:
        return L
    return min(L, math.ceil(cfg.capacity_factor * L * cfg.top_k / cfg.experts))


def route(x_TD: jax.Array, router_DE: jax.Array, cfg: ModelConfig):
    """(probs [T, E] f32, logits [T, E] f32, weights [K, T], experts [K, T] int32)."""
    logits_TE = checkpoint_name(einsum("TD,DE->TE", x_TD, router_DE, dtype=jnp.float32),
                                scopes.ROUTER_LOGITS)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    w_TK, e_TK = lax.top_k(probs_TE, cfg.top_k)
    if cfg.router_renorm:
        w_TK = w_TK / jnp.sum(w_TK, axis=-1, keepdims=True)
    return probs_TE, logits_TE, w_TK.T, e_TK.T


def keep_mask(e_KT: jax.Array, B: int, cfg: ModelConfig) -> jax.Array:
    """[K, T] bool: the assignments within their expert's capacity per sequence, in
    k-major order (every first choice of a row before its second choices)."""
    K, T = e_KT.shape
    L = T // B
    if cfg.capacity_factor <= 0:
        return jnp.ones((K, T), bool)
    oh_BAE = jax.nn.one_hot(e_KT.reshape(K, B, L).transpose(1, 0, 2).reshape(B, K * L),
                            cfg.experts, dtype=jnp.int32)
    rank_BA = jnp.sum((jnp.cumsum(oh_BAE, axis=1) - 1) * oh_BAE, axis=-1)
    kept_BA = rank_BA < capacity(cfg, L)
    return kept_BA.reshape(B, K, L).transpose(1, 0, 2).reshape(K, T)


def _slots(dest_A: jax.Array, kept_A: jax.Array, n: int, size: int) -> jax.Array:
    """Each kept assignment's rank among the kept ones with the same destination (of n),
    in order; `size` (out of range: scattered nowhere) for the others."""
    oh_An = jax.nn.one_hot(dest_A, n, dtype=jnp.int32) * kept_A[:, None]
    rank_A = jnp.sum((jnp.cumsum(oh_An, axis=0) - 1) * oh_An, axis=-1)
    return jnp.where(kept_A, rank_A, size)


def experts(x_XMD: jax.Array, p: dict, cfg: ModelConfig) -> jax.Array:
    """The local experts on their padded buffers: [X, M, D] -> [X, M, D] {U_tp}."""
    dt, at = cfg.compute_dtype, cfg.act_dtype
    g_XMF = einsum("XMD,XDF->XMF", x_XMD, p["we_g"], dtype=dt, out=at)
    u_XMF = einsum("XMD,XDF->XMF", x_XMD, p["we_u"], dtype=dt, out=at)
    return einsum("XMF,XFD->XMD", swiglu(g_XMF, u_XMF), p["we_d"], dtype=dt, out=at)


def moe(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes):
    """x [B, L, D] replicated over tp -> (y [B, L, D] replicated over tp, this layer's
    local sums {name: value} for STATS). p (gathered over fsdp): router [D, E] (stored
    replicated: a gather with the tp-sharded experts would type it per-device over tp), we_g,
    we_u [X, D, F_tp], we_d [X, F_tp, D]; with shared experts ws_g, ws_u [D, I_tp],
    ws_d [D, I_tp] (stored as layers/mlp.py stores wd)."""
    B, L, D = x_BLD.shape
    T, K, E = B * L, cfg.top_k, cfg.experts
    P = axes.ep_size
    X = E // P
    x_TD = x_BLD.reshape(T, D)
    probs_TE, logits_TE, w_KT, e_KT = route(x_TD, p["router"], cfg)
    kept_KT = keep_mask(e_KT, B, cfg)

    per_peer = B * capacity(cfg, L)  # the most rows one peer sends one expert
    C = min(T * min(K, X), X * per_peer)
    M = P * per_peer
    e_A, kept_A = e_KT.reshape(-1), kept_KT.reshape(-1)
    t_A = jnp.tile(jnp.arange(T), K)
    dest_A = e_A // X
    slot_A = _slots(dest_A, kept_A, P, C)

    xe_TD = collectives.broadcast(x_TD, axes.tp)  # bwd: all-reduce the experts' dx
    send_PCD = jnp.zeros((P, C, D), x_TD.dtype).at[dest_A, slot_A].set(xe_TD[t_A],
                                                                        mode="drop")
    send_PC = jnp.full((P, C), X, jnp.int32).at[dest_A, slot_A].set(e_A % X, mode="drop")
    recv_PCD = collectives.all_to_all(send_PCD, axes.ep, 0, 0)
    local_R = collectives.all_to_all(send_PC, axes.ep, 0, 0).reshape(-1)

    valid_R = local_R < X
    row_R = _slots(local_R, valid_R, X, M)
    buf_XMD = jnp.zeros((X, M, D), x_TD.dtype).at[local_R, row_R].set(
        recv_PCD.reshape(P * C, D), mode="drop")
    out_XMD = experts(buf_XMD, p, cfg)
    out_PCD = out_XMD.at[local_R, row_R].get(mode="fill", fill_value=0).reshape(P, C, D)
    back_PCD = collectives.all_to_all(out_PCD, axes.ep, 0, 0)

    got_KTD = back_PCD.at[dest_A, slot_A].get(mode="fill", fill_value=0).reshape(K, T, D)
    w_KT = collectives.broadcast(w_KT, axes.tp)
    y_TD = collectives.all_reduce(jnp.einsum("KT,KTD->TD", w_KT, got_KTD), axes.tp)
    if cfg.shared_experts:
        shared = {"wg": p["ws_g"], "wu": p["ws_u"], "wd": p["ws_d"]}
        y_TD = y_TD + mlp(x_BLD, shared, cfg, axes).reshape(T, D)

    count_E = jnp.sum(jax.nn.one_hot(e_KT, E, dtype=jnp.float32), axis=(0, 1))
    stats = {"count_E": lax.stop_gradient(count_E),
             "probs_E": jnp.sum(probs_TE, axis=0),
             "zsum": jnp.sum(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))),
             "dropped": jnp.sum(~kept_KT).astype(jnp.float32)}
    return y_TD.reshape(B, L, D).astype(x_BLD.dtype), stats


def router_losses(stats: dict, n_tokens: int, cfg: ModelConfig, data_axes) -> tuple:
    """(aux_coef * load-balancing loss + z_coef * z-loss, metrics) from the per-layer
    local sums stacked over layers ({name: [N, ...]}), summed over `data_axes` first so
    every layout sees the global batch's statistics. n_tokens: the global token count.

    Load balancing (Switch Transformer eq. 4, with K choices): E * sum_e f_e P_e, f_e the
    fraction of assignments routed to e, P_e the mean router prob of e; z-loss (ST-MoE):
    the mean over tokens of logsumexp(logits)^2. Both are averaged over layers."""
    # a sum the same on every device (dropped: 0 when dropless) is per-device all the same
    total = {k: collectives.all_reduce(collectives.broadcast(v, data_axes), data_axes)
             for k, v in stats.items()}
    f_NE = total["count_E"] / (n_tokens * cfg.top_k)
    p_NE = total["probs_E"] / n_tokens
    aux = jnp.mean(cfg.experts * jnp.sum(f_NE * p_NE, axis=-1))
    z = jnp.mean(total["zsum"]) / n_tokens
    count_NE = total["count_E"]
    metrics = {"aux_loss": aux, "z_loss": z,
               "tokens_per_expert_max": jnp.max(count_NE),
               "tokens_per_expert_mean": jnp.mean(count_NE),
               "dropped_fraction": jnp.sum(total["dropped"]) / jnp.sum(count_NE)}
    return cfg.aux_loss_coef * aux + cfg.z_loss_coef * z, metrics
