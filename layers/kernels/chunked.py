"""Dense causal attention by query chunks: the tiles above the diagonal are never formed.

Shape letters: B batch, T queries in one chunk, S keys the chunk sees, G kv heads,
R = H // G query heads per kv head, K head dim.

The queries are cut into chunks of T (the last one may be shorter). Under a causal
mask, chunk c (queries [cT, cT + T)) sees only keys [0, cT + T), so each chunk is one
dense softmax over its key prefix and the score tiles a dense kernel would compute and
then mask away are skipped: C(C + 1) / 2 of C^2 tiles for C chunks. Without a causal
mask there is one chunk over all keys.

Each chunk is a `jax.custom_vjp` with the FlashAttention backward (Dao 2023, alg. 2),
except that P is not recomputed: the forward keeps E = exp(S - rowmax) in the inputs'
dtype (the operand of its PV matmul) and 1/l = 1/rowsum(E), and with P = E / l and
delta = rowsum(dO * O)

    dV = E^T (dO / l),   dP = dO V^T,   dS = E (dP - delta) / l,   dK = dS^T Q,   dQ = dS K,

so the backward forms no score matrix and no exponential, and autodiff never builds
the softmax's own backward. Under remat the layer's forward is recomputed right before
its backward, so E lives through one layer's backward only (with `remat none` every
layer's E is saved, as the dense reference saves its P).

Scores, softmax and accumulation are f32; E and dS are cast to the inputs' dtype
before their matmuls. Memory is O(L^2) like the dense reference: this is
the kernel for sequences short enough for that (`layers.kernels.resolve_attention`);
`layers.kernels.blocked` keeps memory O(L * block) for long ones.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, flash_vjp,
                                   softmax_scale, tile_mask)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Static description of one chunk: queries [start, start + T), keys [0, S)."""

    causal: bool
    start: int  # global position of the chunk's first query
    kv_len: int  # keys at positions >= kv_len are masked (padding)
    scale: float


def _scores(q_BTGRK, k_BSGK, chunk: _Chunk):
    """Scaled, masked scores s_BGRTS (f32) and the mask [T, S]."""
    s_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK,
                         preferred_element_type=jnp.float32) * chunk.scale
    q_pos_T = chunk.start + jnp.arange(q_BTGRK.shape[1])
    mask_TS = tile_mask(q_pos_T, jnp.arange(k_BSGK.shape[1]), causal=chunk.causal,
                        kv_len=chunk.kv_len)
    return jnp.where(mask_TS, s_BGRTS, MASK_VALUE), mask_TS


def _probs(s_BGRTS, shift_BGRT, mask_TS, padded: bool):
    """exp(s - shift) with masked entries 0. Without padding every row sees a key, so
    its shift is a real score and exp(MASK_VALUE - shift) is already 0: no select."""
    p_BGRTS = jnp.exp(s_BGRTS - shift_BGRT[..., None])
    return jnp.where(mask_TS, p_BGRTS, 0.0) if padded else p_BGRTS


def _forward(q_BTGRK, k_BSGK, v_BSGK, chunk: _Chunk):
    """o_BTGRK (q's dtype), and for the backward the unnormalised probabilities
    e_BGRTS = exp(s - max) in v's dtype (what the PV matmul reads) and 1 / rowsum."""
    s_BGRTS, mask_TS = _scores(q_BTGRK, k_BSGK, chunk)
    m_BGRT = jnp.max(s_BGRTS, axis=-1)
    e_BGRTS = _probs(s_BGRTS, m_BGRT, mask_TS, chunk.kv_len < k_BSGK.shape[1])
    l_BGRT = jnp.sum(e_BGRTS, axis=-1)
    # A row with no visible key (only with kv_len padding) has l == 0: it outputs zeros.
    inv_l_BGRT = 1.0 / jnp.where(l_BGRT == 0.0, 1.0, l_BGRT)
    e_BGRTS = e_BGRTS.astype(v_BSGK.dtype)
    o_BGRTK = jnp.einsum("BGRTS,BSGK->BGRTK", e_BGRTS, v_BSGK,
                         preferred_element_type=jnp.float32) * inv_l_BGRT[..., None]
    o_BTGRK = o_BGRTK.transpose(0, 3, 1, 2, 4).astype(q_BTGRK.dtype)
    return o_BTGRK, (e_BGRTS, inv_l_BGRT)


def _backward(chunk: _Chunk, residuals, do_BTGRK):
    """P = e / l from the forward's residuals (no scores recomputed):
    dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = dS K, dK = dS^T Q."""
    q_BTGRK, k_BSGK, v_BSGK, o_BTGRK, e_BGRTS, inv_l_BGRT = residuals
    f32 = jnp.float32
    delta_BGRT = jnp.einsum("BTGRK,BTGRK->BGRT", do_BTGRK.astype(f32), o_BTGRK.astype(f32))
    # 1/l applied to dO (a [T, K] tile) instead of to P ([T, S])
    do_BGRTK = do_BTGRK.transpose(0, 2, 3, 1, 4).astype(f32) * inv_l_BGRT[..., None]
    dv_BSGK = jnp.einsum("BGRTS,BGRTK->BSGK", e_BGRTS, do_BGRTK.astype(v_BSGK.dtype),
                         preferred_element_type=f32)
    dp_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", do_BTGRK.astype(v_BSGK.dtype), v_BSGK,
                          preferred_element_type=f32)
    ds_BGRTS = (e_BGRTS.astype(f32) * (dp_BGRTS - delta_BGRT[..., None])
                * (inv_l_BGRT * chunk.scale)[..., None])
    dq_BTGRK = jnp.einsum("BGRTS,BSGK->BTGRK", ds_BGRTS.astype(k_BSGK.dtype), k_BSGK,
                          preferred_element_type=f32)
    dk_BSGK = jnp.einsum("BGRTS,BTGRK->BSGK", ds_BGRTS.astype(q_BTGRK.dtype), q_BTGRK,
                         preferred_element_type=f32)
    return (dq_BTGRK.astype(q_BTGRK.dtype), dk_BSGK.astype(k_BSGK.dtype),
            dv_BSGK.astype(v_BSGK.dtype))


@functools.cache
def _attend(chunk: _Chunk):
    """The differentiable dense attention of one chunk: (q_BTGRK, k, v) -> o_BTGRK."""
    return flash_vjp(_forward, _backward, chunk)


def chunked_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, axes=None,
                      blocks: BlockSizes = BlockSizes(block_q=64), kv_len: int | None = None):
    """Softmax(q k^T / sqrt(K)) v, computing only the causally visible tiles.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G. Causal
    needs L == S; queries are taken `blocks.block_q` at a time, each chunk against the
    keys up to its last query. kv_len (default S) masks keys at positions >= kv_len.
    Returns o_BLHK in q's dtype. axes: unused (nothing is communicated)."""
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK, causal=causal)
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    T = min(blocks.block_q, L) if causal else L
    outs = []
    for start in range(0, L, T):
        stop = min(start + T, L)
        S = stop if causal else dims.kv_len
        chunk = _Chunk(causal=causal, start=start, scale=softmax_scale(K),
                       kv_len=dims.kv_len if kv_len is None else kv_len)
        outs.append(_attend(chunk)(q_BLGRK[:, start:stop], k_BSGK[:, :S], v_BSGK[:, :S]))
    return jnp.concatenate(outs, axis=1).reshape(B, L, H, K)
