"""Vocab-parallel embedding and cross-entropy over tp (Megatron): each tp rank owns a
contiguous slice of V_tp = V / tp token ids; full logits are never built on one device."""
import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers.axes import Axes
from layers.common import einsum


def _local_ids(ids_BL: jax.Array, v_local: int, axes: Axes):
    """Token ids shifted into this rank's vocab slice, and whether they fall in it."""
    local_BL = ids_BL - collectives.axis_index(axes.tp) * v_local
    mine_BL = (local_BL >= 0) & (local_BL < v_local)
    return jnp.where(mine_BL, local_BL, 0), mine_BL


def embed(tokens_BL: jax.Array, embed_VD: jax.Array, axes: Axes,
          comm: str = "allreduce", dtype=jnp.float32) -> jax.Array:
    """tokens [B, L] -> x [B, L, D] in `dtype` (the activation dtype) replicated over tp
    (comm allreduce) or [B, L_tp, D] (sequence, ring).

    embed_VD: [V_tp, D]. Each rank looks up the ids it owns, zeros elsewhere; the partial
    sums are all-reduced, or reduce-scattered along L (as a ring for comm ring)."""

    def lookup(tokens_BL):  # the whole sequence, or (ring) one chunk of it at a time
        local_BL, mine_BL = _local_ids(tokens_BL, embed_VD.shape[0], axes)
        x_BLD = jnp.take(embed_VD, local_BL, axis=0) * mine_BL[..., None]  # [B, L, D]{U_tp}
        return x_BLD.astype(dtype)

    return collectives.row_parallel(tokens_BL, lookup, axes.tp, dim=1, comm=comm)


def mask_padding(logits_BLV: jax.Array, n_valid: int | None, axes: Axes) -> jax.Array:
    """logits [..., V_tp] with the columns of padding ids (global id >= n_valid, the
    vocab rounded up to a multiple of tp: `ModelConfig.padded_vocab`) set to -inf, so
    that no softmax, max or sample sees them. n_valid None: no padding, unchanged."""
    if n_valid is None:
        return logits_BLV
    v_local = logits_BLV.shape[-1]
    id_V = collectives.axis_index(axes.tp) * v_local + jnp.arange(v_local)
    return jnp.where(id_V < n_valid, logits_BLV, -jnp.inf)


def cross_entropy(h_BLD, unembed_DV, targets_BL, axes: Axes, dtype,
                  comm: str = "allreduce", n_valid: int | None = None) -> jax.Array:
    """Per-token loss [B, L] (f32) of logits h @ unembed against targets.

    h: [B, L, D] replicated over tp (comm allreduce) or [B, L_tp, D] (sequence, ring:
    gathered along L, as a ring for ring); unembed_DV: [D, V_tp]. Logits stay
    [B, L, V_tp]: the max and the sum of exponentials are reduced over tp, and so is the
    target logit (found on the one rank that owns it). n_valid: the real vocab when
    unembed has padding columns (`mask_padding`), else None."""
    logits = lambda h_BLD: einsum("BLD,DV->BLV", h_BLD, unembed_DV, dtype=dtype)
    # allreduce: broadcast (bwd all-reduce dh); sequence: all-gather along L (bwd
    # reduce-scatter dh); ring: the gather as ppermutes interleaved with the matmuls
    logits_BLV = collectives.column_parallel(h_BLD, logits, axes.tp, dim=1, comm=comm)
    logits_BLV = mask_padding(logits_BLV, n_valid, axes)
    m_BL = collectives.all_reduce_max(lax.stop_gradient(jnp.max(logits_BLV, axis=-1)), axes.tp)
    sumexp_BL = collectives.all_reduce(
        jnp.sum(jnp.exp(logits_BLV - m_BL[..., None]), axis=-1), axes.tp)
    local_BL, mine_BL = _local_ids(targets_BL, logits_BLV.shape[-1], axes)
    target_BL = jnp.take_along_axis(logits_BLV, local_BL[..., None], axis=-1)[..., 0]
    target_BL = collectives.all_reduce(jnp.where(mine_BL, target_BL, 0.0), axes.tp)
    return jnp.log(sumexp_BL) + m_BL - target_BL
