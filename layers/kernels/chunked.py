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

Global positions (`q_offset`, `k_offset`: a slice of a longer sequence, such as a
context-parallel rank's query chunk against keys gathered over cp): static offsets keep
the static skip (each chunk against the keys up to its last query's position); traced
ones mask at global positions over all the keys (nothing skipped: the kernel's tiles
are static; `layers.kernels.blocked` skips at run time).

Scores, softmax and accumulation are f32; E and dS are cast to the inputs' dtype
before their matmuls. Memory is O(L^2) like the dense reference: this is
the kernel for sequences short enough for that (`layers.kernels.resolve_attention`);
`layers.kernels.blocked` keeps memory O(L * block) for long ones.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, flash_vjp,
                                   softmax_scale, tile_mask)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Static description of one chunk: queries [start, start + T), keys [0, S)."""

    causal: bool
    start: int  # global position of the chunk's first query
    kv_len: int  # keys at indices >= kv_len are masked (padding)
    scale: float
    k_start: int = 0  # global position of the first key
    at: bool = False  # positions are inputs (traced offsets): start, k_start unused


def _scores(q_BTGRK, k_BSGK, chunk: _Chunk, pos=None):
    """Scaled, masked scores s_BGRTS (f32) and the mask [T, S]. pos: the traced
    positions (q_pos_T, k_pos_S) of a chunk with `at`."""
    s_BGRTS = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK,
                         preferred_element_type=jnp.float32) * chunk.scale
    T, S = q_BTGRK.shape[1], k_BSGK.shape[1]
    if pos is None and chunk.k_start == 0:  # key positions are key indices
        mask_TS = tile_mask(chunk.start + jnp.arange(T), jnp.arange(S), causal=chunk.causal,
                            kv_len=chunk.kv_len)
        return jnp.where(mask_TS, s_BGRTS, MASK_VALUE), mask_TS
    if pos is None:
        q_pos_T, k_pos_S = chunk.start + jnp.arange(T), chunk.k_start + jnp.arange(S)
    else:
        q_pos_T, k_pos_S = pos
    mask_TS = jnp.broadcast_to(jnp.arange(S)[None, :] < chunk.kv_len, (T, S))
    if chunk.causal:
        mask_TS = mask_TS & (q_pos_T[:, None] >= k_pos_S[None, :])
    return jnp.where(mask_TS, s_BGRTS, MASK_VALUE), mask_TS


def _probs(s_BGRTS, shift_BGRT, mask_TS, padded: bool):
    """exp(s - shift) with masked entries 0. Without padding every row sees a key, so
    its shift is a real score and exp(MASK_VALUE - shift) is already 0: no select."""
    p_BGRTS = jnp.exp(s_BGRTS - shift_BGRT[..., None])
    return jnp.where(mask_TS, p_BGRTS, 0.0) if padded else p_BGRTS


def _forward(q_BTGRK, k_BSGK, v_BSGK, chunk: _Chunk, pos=None):
    """o_BTGRK (q's dtype), and for the backward the unnormalised probabilities
    e_BGRTS = exp(s - max) in v's dtype (what the PV matmul reads) and 1 / rowsum."""
    s_BGRTS, mask_TS = _scores(q_BTGRK, k_BSGK, chunk, pos)
    m_BGRT = jnp.max(s_BGRTS, axis=-1)
    # a row may see no key: padding, or (with offsets) queries before every key
    e_BGRTS = _probs(s_BGRTS, m_BGRT, mask_TS,
                     chunk.kv_len < k_BSGK.shape[1] or chunk.at or chunk.k_start != 0)
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


@functools.cache
def _attend_at(chunk: _Chunk):
    """As `_attend` with the positions q_pos_T, k_pos_S (int32, no cotangent) as inputs."""

    @jax.custom_vjp
    def attend(q, k, v, q_pos_T, k_pos_S):
        return _forward(q, k, v, chunk, (q_pos_T, k_pos_S))[0]

    def attend_fwd(q, k, v, q_pos_T, k_pos_S):
        o, saved = _forward(q, k, v, chunk, (q_pos_T, k_pos_S))
        return o, (q, k, v, o, *saved)

    def attend_bwd(residuals, do):
        return (*_backward(chunk, residuals, do), None, None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def chunked_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, axes=None,
                      blocks: BlockSizes = BlockSizes(block_q=64), kv_len: int | None = None,
                      q_offset=0, k_offset=0):
    """Softmax(q k^T / sqrt(K)) v, computing only the causally visible tiles.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G. Causal
    without offsets needs L == S; queries are taken `blocks.block_q` at a time, each
    chunk against the keys up to its last query. kv_len (default S) masks keys at
    indices >= kv_len. q_offset, k_offset (ints, or traced int32 scalars): global
    positions of the first query and key (module doc). Returns o_BLHK in q's dtype.
    axes: unused (nothing is communicated)."""
    static = isinstance(q_offset, int) and isinstance(k_offset, int)
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK,
                          causal=causal and static and q_offset == k_offset == 0)
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    T = min(blocks.block_q, L) if causal else L
    kv_len = dims.kv_len if kv_len is None else kv_len
    outs = []
    for start in range(0, L, T):
        stop = min(start + T, L)
        if not static:
            chunk = _Chunk(causal=causal, start=0, scale=softmax_scale(K), kv_len=kv_len,
                           at=True)
            q_pos_T = jnp.asarray(q_offset, jnp.int32) + jnp.arange(start, stop, dtype=jnp.int32)
            k_pos_S = jnp.asarray(k_offset, jnp.int32) + jnp.arange(dims.kv_len, dtype=jnp.int32)
            outs.append(_attend_at(chunk)(q_BLGRK[:, start:stop], k_BSGK, v_BSGK, q_pos_T,
                                          k_pos_S))
            continue
        # keys up to the chunk's last query (by global position)
        S = min(max(q_offset + stop - k_offset, 0), dims.kv_len) if causal else dims.kv_len
        if S == 0:  # no key visible to any query of the chunk
            outs.append(jnp.zeros_like(q_BLGRK[:, start:stop]))
            continue
        chunk = _Chunk(causal=causal, start=q_offset + start, scale=softmax_scale(K),
                       kv_len=kv_len, k_start=k_offset)
        outs.append(_attend(chunk)(q_BLGRK[:, start:stop], k_BSGK[:, :S], v_BSGK[:, :S]))
    return jnp.concatenate(outs, axis=1).reshape(B, L, H, K)
