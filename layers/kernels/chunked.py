"""Dense causal attention by query chunks: the tiles above the diagonal are never formed.

Shape letters: B batch, T queries in one chunk, S keys the chunk sees, G kv heads,
R = H // G query heads per kv head, K head dim.

The queries are cut into chunks of T (the last one may be shorter). Under a causal
mask, chunk c (queries [cT, cT + T)) sees only keys [0, cT + T), so each chunk is one
dense softmax over its key prefix and the score tiles a dense kernel would compute and
then mask away are skipped: C(C + 1) / 2 of C^2 tiles for C chunks. Without a causal
mask there is one chunk over all keys.

The call is one `jax.custom_vjp` whose backward is FlashAttention's (Dao 2023, alg. 2)
chunk by chunk, except that P is not recomputed: the forward keeps E = exp(S - rowmax)
in the inputs' dtype (the operand of its PV matmul) and 1/l = 1/rowsum(E), and with
P = E / l and delta = rowsum(dO * O)

    dV = E^T (dO / l),   dP = dO V^T,   dS = E (dP - delta) / l,   dK = dS^T Q,   dQ = dS K,

so the backward forms no score matrix and no exponential, and autodiff never builds
the softmax's own backward. q, k, v, o and dO are laid out heads-major ([B, G, R, L, K],
[B, G, S, K]) once per call, so each chunk's matmuls read slices in the order they take
them, and dK, dV are summed over the chunks' key prefixes in f32 as [B, G, K, S],
then laid out keys-major and cast once. Under remat the layer's forward is recomputed right before
its backward, so E lives through one layer's backward only (with `remat none` every
layer's E is saved, as the dense reference saves its P).

Global positions (`q_offset`, `k_offset`: a slice of a longer sequence, such as a
context-parallel rank's query chunk against keys gathered over cp): static offsets keep
the static skip (each chunk against the keys up to its last query's position); traced
ones mask at global positions over all the keys (nothing skipped: the kernel's tiles
are static; `layers.kernels.blocked` skips at run time). Segment ids (packed documents)
mask the chunk's scores as well; they skip nothing here (the chunks are static).

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

from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, heads_mask,
                                   same_segment, softmax_scale, tile_mask)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of one call: chunk (start, stop, S) is the queries [start, stop)
    against the keys [0, S) (S = 0: it sees no key and outputs zeros)."""

    causal: bool
    scale: float
    kv_len: int  # keys at indices >= kv_len are masked (padding)
    keys: int  # S of the whole call
    chunks: tuple  # ((start, stop, S), ...)
    q_start: int = 0  # global position of the first query
    k_start: int = 0  # global position of the first key
    at: bool = False  # positions are inputs (traced offsets): q_start, k_start unused
    segmented: bool = False  # segment ids (q [B, L], kv [B, S]) are inputs too


def _scores(q_BGRTK, k_BGSK, plan: _Plan, start: int, pos=None, seg=None):
    """Scaled, masked scores s_BGRTS (f32) of the chunk whose first query is query
    `start`, and the mask ([T, S], or [B, 1, 1, T, S] with segment ids). pos: the chunk's
    traced positions (q_pos_T, k_pos_S) under `at`; seg: its segment ids (q [B, T],
    kv [B, S]) when `segmented`."""
    s_BGRTS = jnp.einsum("BGRTK,BGSK->BGRTS", q_BGRTK, k_BGSK,
                         preferred_element_type=jnp.float32) * plan.scale
    mask_TS = _mask(q_BGRTK.shape[3], k_BGSK.shape[2], plan, start, pos)
    if seg is not None:
        mask_TS = heads_mask(mask_TS & same_segment(*seg))
    return jnp.where(mask_TS, s_BGRTS, MASK_VALUE), mask_TS


def _mask(T: int, S: int, plan: _Plan, start: int, pos=None):
    """The chunk's causal and padding mask [T, S] (`_scores`)."""
    if pos is None and plan.k_start == 0:  # key positions are key indices
        return tile_mask(plan.q_start + start + jnp.arange(T), jnp.arange(S),
                         causal=plan.causal, kv_len=plan.kv_len)
    if pos is None:
        q_pos_T, k_pos_S = plan.q_start + start + jnp.arange(T), plan.k_start + jnp.arange(S)
    else:
        q_pos_T, k_pos_S = pos
    mask_TS = jnp.broadcast_to(jnp.arange(S)[None, :] < plan.kv_len, (T, S))
    if plan.causal:
        mask_TS = mask_TS & (q_pos_T[:, None] >= k_pos_S[None, :])
    return mask_TS


def _probs(s_BGRTS, shift_BGRT, mask_TS, padded: bool):
    """exp(s - shift) with masked entries 0. Without padding every row sees a key, so
    its shift is a real score and exp(MASK_VALUE - shift) is already 0: no select."""
    p_BGRTS = jnp.exp(s_BGRTS - shift_BGRT[..., None])
    return jnp.where(mask_TS, p_BGRTS, 0.0) if padded else p_BGRTS


def _forward(q_BLGRK, k_BSGK, v_BSGK, plan: _Plan, pos=None, seg=None):
    """o_BLGRK (q's dtype), and for the backward q, k, v and o heads-major and, per
    chunk that sees a key, the unnormalised probabilities e_BGRTS = exp(s - max) in v's
    dtype (what the PV matmul reads) and 1 / rowsum. pos: (q_pos_L, k_pos_S) under `at`;
    seg: segment ids (q_seg_BL, k_seg_BS) when `segmented`.

    q, k and v are laid out heads-major once ([B, G, R, L, K], [B, G, S, K]), so every
    chunk's matmuls read slices of them in the order the matmuls take."""
    q_BGRLK = q_BLGRK.transpose(0, 2, 3, 1, 4)
    k_BGSK, v_BGSK = (x.transpose(0, 2, 1, 3) for x in (k_BSGK, v_BSGK))
    o_chunks, e_chunks, inv_l_chunks = [], [], []
    for start, stop, S in plan.chunks:
        q_BGRTK = q_BGRLK[:, :, :, start:stop]
        if S == 0:  # no key visible to any query of the chunk
            o_chunks.append(jnp.zeros_like(q_BGRTK))
            continue
        at = None if pos is None else (pos[0][start:stop], pos[1][:S])
        ids = None if seg is None else (seg[0][:, start:stop], seg[1][:, :S])
        s_BGRTS, mask_TS = _scores(q_BGRTK, k_BGSK[:, :, :S], plan, start, at, ids)
        m_BGRT = jnp.max(s_BGRTS, axis=-1)
        # a row may see no key: padding, or (with offsets) queries before every key
        e_BGRTS = _probs(s_BGRTS, m_BGRT, mask_TS,
                         plan.kv_len < S or plan.at or plan.k_start != 0)
        l_BGRT = jnp.sum(e_BGRTS, axis=-1)
        # A row with no visible key (only with kv_len padding) has l == 0: it outputs zeros.
        inv_l_BGRT = 1.0 / jnp.where(l_BGRT == 0.0, 1.0, l_BGRT)
        e_BGRTS = e_BGRTS.astype(v_BSGK.dtype)
        o_BGRTK = jnp.einsum("BGRTS,BGSK->BGRTK", e_BGRTS, v_BGSK[:, :, :S],
                             preferred_element_type=jnp.float32) * inv_l_BGRT[..., None]
        o_chunks.append(o_BGRTK.astype(q_BLGRK.dtype))
        e_chunks.append(e_BGRTS)
        inv_l_chunks.append(inv_l_BGRT)
    o_BGRLK = jnp.concatenate(o_chunks, axis=3)
    return (o_BGRLK.transpose(0, 3, 1, 2, 4),
            (q_BGRLK, k_BGSK, v_BGSK, o_BGRLK, tuple(e_chunks), tuple(inv_l_chunks)))


def _add_keys(acc_BGKS, new_BGKS):
    """Sum of two key grads over key prefixes of different lengths: the shorter is
    added into the first keys of the longer."""
    if acc_BGKS is None:
        return new_BGKS
    short, long = sorted((acc_BGKS, new_BGKS), key=lambda x: x.shape[3])
    return long.at[..., :short.shape[3]].add(short)


def _backward(plan: _Plan, residuals, do_BLGRK):
    """Per chunk, P = e / l from the forward's residuals (no scores recomputed):
    dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = dS K, dK = dS^T Q. dK and dV
    are formed as [B, G, K, S] (dO^T P and Q^T dS: the order the matmuls produce, so
    neither E nor dS is relaid out), summed over the chunks in f32, and laid out
    keys-major and cast once."""
    q_BGRLK, k_BGSK, v_BGSK, o_BGRLK, e_chunks, inv_l_chunks = residuals
    f32 = jnp.float32
    do_BGRLK = do_BLGRK.transpose(0, 2, 3, 1, 4)
    delta_BGRL = jnp.einsum("BGRLK,BGRLK->BGRL", do_BGRLK.astype(f32), o_BGRLK.astype(f32))
    dq_chunks, dk_BGKS, dv_BGKS = [], None, None
    visible = iter(zip(e_chunks, inv_l_chunks))
    for start, stop, S in plan.chunks:
        do_BGRTK = do_BGRLK[:, :, :, start:stop]
        if S == 0:
            dq_chunks.append(jnp.zeros_like(do_BGRTK, dtype=f32))
            continue
        e_BGRTS, inv_l_BGRT = next(visible)
        k_c, v_c = k_BGSK[:, :, :S], v_BGSK[:, :, :S]
        # 1/l applied to dO (a [T, K] tile) instead of to P ([T, S])
        dol_BGRTK = (do_BGRTK.astype(f32) * inv_l_BGRT[..., None]).astype(v_BGSK.dtype)
        dv_BGKS = _add_keys(dv_BGKS, jnp.einsum("BGRTK,BGRTS->BGKS", dol_BGRTK, e_BGRTS,
                                                preferred_element_type=f32))
        dp_BGRTS = jnp.einsum("BGRTK,BGSK->BGRTS", do_BGRTK.astype(v_BGSK.dtype), v_c,
                              preferred_element_type=f32)
        ds_BGRTS = (e_BGRTS.astype(f32) * (dp_BGRTS - delta_BGRL[..., start:stop, None])
                    * (inv_l_BGRT * plan.scale)[..., None])
        dq_chunks.append(jnp.einsum("BGRTS,BGSK->BGRTK", ds_BGRTS.astype(k_BGSK.dtype), k_c,
                                    preferred_element_type=f32))
        dk_BGKS = _add_keys(dk_BGKS, jnp.einsum(
            "BGRTK,BGRTS->BGKS", q_BGRLK[:, :, :, start:stop],
            ds_BGRTS.astype(q_BGRLK.dtype), preferred_element_type=f32))

    def keys_major(d_BGKS, like_BGSK):  # -> [B, S, G, K] over all the call's keys
        if d_BGKS is None:
            return jnp.zeros_like(like_BGSK).transpose(0, 2, 1, 3)
        if d_BGKS.shape[3] < plan.keys:  # keys past every chunk's prefix get no grad
            d_BGKS = jnp.pad(d_BGKS, ((0, 0),) * 3 + ((0, plan.keys - d_BGKS.shape[3]),))
        return d_BGKS.transpose(0, 3, 1, 2).astype(like_BGSK.dtype)

    dq_BGRLK = jnp.concatenate(dq_chunks, axis=3)
    return (dq_BGRLK.transpose(0, 3, 1, 2, 4).astype(q_BGRLK.dtype),
            keys_major(dk_BGKS, k_BGSK), keys_major(dv_BGKS, v_BGSK))


@functools.cache
def _attend(plan: _Plan):
    """The differentiable attention of one call, (q_BLGRK, k, v) -> o_BLGRK, followed
    under `at` by (q_pos_L, k_pos_S) and when `segmented` by (q_seg_BL, k_seg_BS): int32
    inputs taking no cotangent."""
    n_ints = 2 * plan.at + 2 * plan.segmented

    def forward(q, k, v, *ints):
        pos, seg = (ints[:2] if plan.at else None), (ints[-2:] if plan.segmented else None)
        return _forward(q, k, v, plan, pos, seg)

    @jax.custom_vjp
    def attend(q, k, v, *ints):
        return forward(q, k, v, *ints)[0]

    attend.defvjp(forward, lambda res, do: (*_backward(plan, res, do), *(None,) * n_ints))
    return attend


def chunked_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, axes=None,
                      blocks: BlockSizes = BlockSizes(block_q=64), kv_len: int | None = None,
                      q_offset=0, k_offset=0, segment_ids=None):
    """Softmax(q k^T / sqrt(K)) v, computing only the causally visible tiles.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G. Causal
    without offsets needs L == S; queries are taken `blocks.block_q` at a time, each
    chunk against the keys up to its last query. kv_len (default S) masks keys at
    indices >= kv_len. q_offset, k_offset (ints, or traced int32 scalars): global
    positions of the first query and key (module doc). segment_ids (`SegmentIds`): a
    query sees only keys of its own document. Returns o_BLHK in q's dtype.
    axes: unused (nothing is communicated)."""
    static = isinstance(q_offset, int) and isinstance(k_offset, int)
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK,
                          causal=causal and static and q_offset == k_offset == 0)
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    T = min(blocks.block_q, L) if causal else L
    kv_len = dims.kv_len if kv_len is None else kv_len
    common = dict(causal=causal, scale=softmax_scale(K), kv_len=kv_len, keys=dims.kv_len,
                  segmented=segment_ids is not None)
    spans = [(start, min(start + T, L)) for start in range(0, L, T)]
    if static:  # each chunk against the keys up to its last query (by global position)
        seen = lambda stop: (min(max(q_offset + stop - k_offset, 0), dims.kv_len) if causal
                             else dims.kv_len)
        plan = _Plan(chunks=tuple((start, stop, seen(stop)) for start, stop in spans),
                     q_start=q_offset, k_start=k_offset, **common)
        pos = ()
    else:  # every chunk against all the keys, masked at the traced positions
        plan = _Plan(chunks=tuple((start, stop, dims.kv_len) for start, stop in spans),
                     at=True, **common)
        pos = (jnp.asarray(q_offset, jnp.int32) + jnp.arange(L, dtype=jnp.int32),
               jnp.asarray(k_offset, jnp.int32) + jnp.arange(dims.kv_len, dtype=jnp.int32))
    seg = () if segment_ids is None else tuple(jnp.asarray(x, jnp.int32) for x in segment_ids)
    return _attend(plan)(q_BLGRK, k_BSGK, v_BSGK, *pos, *seg).reshape(B, L, H, K)
