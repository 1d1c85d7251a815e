"""Memory-efficient (flash) attention in plain jnp: a scan over key blocks.

Shape letters: B batch, L query length, S key length, H query heads, G kv heads,
K head dim, R = H // G query heads per kv head, J key blocks, T keys in one block.
Query head h uses kv head h // R, so q_BLHK is viewed as q_BLGRK and K/V are
never repeated.

Forward: `lax.scan` over key blocks carrying the running row max m_BGRL, row sum
l_BGRL and unnormalised output acc_BGRLK, all f32 (online softmax, FlashAttention-2
section 3.1). Only one score block s_BGRLT is live at a time, so memory is
O(L * T) instead of O(L * S). The residuals are O and the log-sum-exp lse_BGRL.

Backward (`jax.custom_vjp`): a second scan over key blocks recomputes each block's
probabilities P = exp(S - lse) and, with delta = rowsum(dO * O),
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dK = dS^T Q,   dQ = dS K
carrying dQ and emitting dK / dV per block.

Key lengths not divisible by the block are padded with zeros and the padded keys
masked. This module tiles only the key axis (`BlockSizes.block_q` is for the chunked
and Pallas kernels).

Global positions (`q_offset`, `k_offset`: a slice of a longer sequence, such as a
context-parallel rank's query chunk against keys gathered over cp): the causal mask
compares the positions q_offset + l and k_offset + s, which may be traced, and each key
block no query of the call can see is skipped (`lax.cond` in both scans: no scores, no
grads formed for it). Without offsets every block is visible to some query.

Segment ids (packed documents: q [B, L], kv [B, S]) mask each block to the query's own
document and take the same run-time skip: a key block no query of any row can see
(every key of it in an earlier document than every query) costs a predicate only. Only
keys are tiled, so over a whole window every key block is seen by the queries of its
own document and nothing is skipped; a query slice (a cp rank's chunk) skips the blocks
of documents that ended before it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, flash_vjp, heads_mask,
                                   pad_axis, same_segment, softmax_scale, tile_mask,
                                   varying_like)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static configuration of one blocked-attention call."""

    causal: bool
    block_k: int  # T
    kv_len: int  # keys at positions >= kv_len are padding
    scale: float


def _key_blocks(x_BSGK, T: int):
    """[B, S, G, K] -> [J, B, T, G, K] with S = J * T (the scan's xs)."""
    B, S, G, K = x_BSGK.shape
    return x_BSGK.reshape(B, S // T, T, G, K).transpose(1, 0, 2, 3, 4)


def _unblock(x_JBTGK):
    """[J, B, T, G, K] -> [B, J * T, G, K]."""
    J, B, T, G, K = x_JBTGK.shape
    return x_JBTGK.transpose(1, 0, 2, 3, 4).reshape(B, J * T, G, K)


def _block_mask(L: int, j, plan: _Plan, pos=None, seg=None):
    """Which (query, key) pairs of key block j attend: mask_LT, or [B, 1, 1, L, T] with
    segment ids. pos: None (positions 0..L-1 and the keys' indices) or (q_pos_L,
    k_pos_T), global positions of the queries and of this block's keys (indices still
    decide padding). seg: None or (q_seg_BL, k_seg_BT), the document ids."""
    k_idx_T = j * plan.block_k + jnp.arange(plan.block_k)
    if pos is None:
        mask_LT = tile_mask(jnp.arange(L), k_idx_T, causal=plan.causal, kv_len=plan.kv_len)
    else:
        q_pos_L, k_pos_T = pos
        mask_LT = jnp.broadcast_to(k_idx_T[None, :] < plan.kv_len, (L, plan.block_k))
        if plan.causal:
            mask_LT = mask_LT & (q_pos_L[:, None] >= k_pos_T[None, :])
    return mask_LT if seg is None else heads_mask(mask_LT & same_segment(*seg))


def _block_scores(q_BLGRK, k_BTGK, j, plan: _Plan, pos=None, seg=None):
    """Scaled scores of key block j and its mask: s_BGRLT f32, mask_LT (`_block_mask`)."""
    s_BGRLT = jnp.einsum(
        "BLGRK,BTGK->BGRLT", q_BLGRK, k_BTGK, preferred_element_type=jnp.float32
    )
    return s_BGRLT * plan.scale, _block_mask(q_BLGRK.shape[1], j, plan, pos, seg)


def _key_xs(k_BSGK, v_BSGK, T: int, k_pos_S=None, k_seg_BS=None):
    """The scans' xs: block index j, key and value blocks [J, B, T, G, K], and when
    given the blocks' key positions [J, T] and segment ids [J, B, T]."""
    J = k_BSGK.shape[1] // T
    xs = dict(j=jnp.arange(J), k=_key_blocks(k_BSGK, T), v=_key_blocks(v_BSGK, T))
    if k_pos_S is not None:
        xs["pos"] = k_pos_S.reshape(J, T)
    if k_seg_BS is not None:
        xs["seg"] = k_seg_BS.reshape(k_seg_BS.shape[0], J, T).transpose(1, 0, 2)
    return xs


def _where(q_pos_L, q_seg_BL, xs):
    """(pos, seg) of one key block for `_block_mask` from the scan's xs."""
    pos = None if q_pos_L is None else (q_pos_L, xs["pos"])
    seg = None if q_seg_BL is None else (q_seg_BL, xs["seg"])
    return pos, seg


def _forward(q_BLGRK, k_BSGK, v_BSGK, plan: _Plan, q_pos_L=None, k_pos_S=None,
             q_seg_BL=None, k_seg_BS=None):
    """Online-softmax scan: returns o_BLGRK (q's dtype) and (lse_BGRL,) (f32).
    q_pos_L, k_pos_S: global positions; q_seg_BL, k_seg_BS: segment ids (module doc);
    with either, invisible blocks are skipped."""
    B, L, G, R, K = q_BLGRK.shape
    T = plan.block_k

    def step(carry, xs):
        if q_pos_L is None and q_seg_BL is None:
            return fold(carry, xs)
        visible = jnp.any(_block_mask(L, xs["j"], plan, *_where(q_pos_L, q_seg_BL, xs)))
        return lax.cond(visible, fold, lambda carry, xs: (carry, None), carry, xs)

    def fold(carry, xs):
        m_BGRL, l_BGRL, acc_BGRLK = carry
        j, k_BTGK, v_BTGK = xs["j"], xs["k"], xs["v"]
        s_BGRLT, mask_LT = _block_scores(q_BLGRK, k_BTGK, j, plan,
                                         *_where(q_pos_L, q_seg_BL, xs))
        s_BGRLT = jnp.where(mask_LT, s_BGRLT, MASK_VALUE)
        m_new_BGRL = jnp.maximum(m_BGRL, s_BGRLT.max(axis=-1))
        p_BGRLT = jnp.where(mask_LT, jnp.exp(s_BGRLT - m_new_BGRL[..., None]), 0.0)
        correction_BGRL = jnp.exp(m_BGRL - m_new_BGRL)
        l_BGRL = correction_BGRL * l_BGRL + p_BGRLT.sum(axis=-1)
        pv_BGRLK = jnp.einsum(
            "BGRLT,BTGK->BGRLK",
            p_BGRLT.astype(v_BTGK.dtype),
            v_BTGK,
            preferred_element_type=jnp.float32,
        )
        acc_BGRLK = correction_BGRL[..., None] * acc_BGRLK + pv_BGRLK
        return (m_new_BGRL, l_BGRL, acc_BGRLK), None

    init = varying_like(
        (jnp.full((B, G, R, L), MASK_VALUE, jnp.float32),
         jnp.zeros((B, G, R, L), jnp.float32),
         jnp.zeros((B, G, R, L, K), jnp.float32)),
        q_BLGRK, k_BSGK, v_BSGK, *_given(q_pos_L, k_pos_S, q_seg_BL, k_seg_BS))
    xs = _key_xs(k_BSGK, v_BSGK, T, k_pos_S, k_seg_BS)
    (m_BGRL, l_BGRL, acc_BGRLK), _ = lax.scan(step, init, xs)
    # A row with no visible key has l == 0: it outputs zeros, not 0 / 0.
    l_safe_BGRL = jnp.where(l_BGRL == 0.0, 1.0, l_BGRL)
    o_BGRLK = acc_BGRLK / l_safe_BGRL[..., None]
    o_BLGRK = o_BGRLK.transpose(0, 3, 1, 2, 4).astype(q_BLGRK.dtype)
    return o_BLGRK, (m_BGRL + jnp.log(l_safe_BGRL),)


def _given(*xs):
    """The arrays of xs that are not None (positions when given)."""
    return tuple(x for x in xs if x is not None)


def _backward(plan: _Plan, residuals, do_BLGRK, q_pos_L=None, k_pos_S=None, q_seg_BL=None,
              k_seg_BS=None):
    """Recomputes P per key block from lse; returns dq, dk, dv in input dtypes. With
    positions or segment ids, blocks no query sees give zero dk, dv and add nothing to
    dq."""
    q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, lse_BGRL = residuals
    L = q_BLGRK.shape[1]
    T = plan.block_k
    f32 = jnp.float32
    delta_BGRL = jnp.einsum(
        "BLGRK,BLGRK->BGRL", do_BLGRK.astype(f32), o_BLGRK.astype(f32)
    )
    refs = (q_BLGRK, k_BSGK, v_BSGK, do_BLGRK, *_given(q_pos_L, k_pos_S, q_seg_BL, k_seg_BS))

    def step(dq_BLGRK, xs):
        if q_pos_L is None and q_seg_BL is None:
            return grads(dq_BLGRK, xs)
        visible = jnp.any(_block_mask(L, xs["j"], plan, *_where(q_pos_L, q_seg_BL, xs)))

        def skip(dq_BLGRK, xs):
            zeros = varying_like((jnp.zeros(xs["k"].shape, xs["k"].dtype),
                                  jnp.zeros(xs["v"].shape, xs["v"].dtype)), *refs)
            return dq_BLGRK, zeros

        return lax.cond(visible, grads, skip, dq_BLGRK, xs)

    def grads(dq_BLGRK, xs):
        j, k_BTGK, v_BTGK = xs["j"], xs["k"], xs["v"]
        s_BGRLT, mask_LT = _block_scores(q_BLGRK, k_BTGK, j, plan,
                                         *_where(q_pos_L, q_seg_BL, xs))
        p_BGRLT = jnp.where(mask_LT, jnp.exp(s_BGRLT - lse_BGRL[..., None]), 0.0)
        dv_BTGK = jnp.einsum(
            "BGRLT,BLGRK->BTGK",
            p_BGRLT.astype(do_BLGRK.dtype),
            do_BLGRK,
            preferred_element_type=f32,
        )
        dp_BGRLT = jnp.einsum(
            "BLGRK,BTGK->BGRLT", do_BLGRK, v_BTGK, preferred_element_type=f32
        )
        ds_BGRLT = p_BGRLT * (dp_BGRLT - delta_BGRL[..., None]) * plan.scale
        dk_BTGK = jnp.einsum(
            "BGRLT,BLGRK->BTGK",
            ds_BGRLT.astype(q_BLGRK.dtype),
            q_BLGRK,
            preferred_element_type=f32,
        )
        dq_BLGRK = dq_BLGRK + jnp.einsum(
            "BGRLT,BTGK->BLGRK",
            ds_BGRLT.astype(k_BTGK.dtype),
            k_BTGK,
            preferred_element_type=f32,
        )
        return dq_BLGRK, (dk_BTGK.astype(k_BTGK.dtype), dv_BTGK.astype(v_BTGK.dtype))

    xs = _key_xs(k_BSGK, v_BSGK, T, k_pos_S, k_seg_BS)
    init = varying_like(jnp.zeros(q_BLGRK.shape, f32), *refs)
    dq_BLGRK, (dk_JBTGK, dv_JBTGK) = lax.scan(step, init, xs)
    return dq_BLGRK.astype(q_BLGRK.dtype), _unblock(dk_JBTGK), _unblock(dv_JBTGK)


@functools.cache
def _flash(plan: _Plan):
    """The differentiable attention for one static plan: (q_BLGRK, k, v) -> o_BLGRK."""
    return flash_vjp(_forward, _backward, plan)


@functools.cache
def _flash_at(plan: _Plan):
    """As `_flash`, with the global positions q_pos_L, k_pos_S and the segment ids
    q_seg_BL, k_seg_BS (int32, or None for no segment mask) as four more inputs:
    (q_BLGRK, k, v, q_pos_L, k_pos_S, q_seg_BL, k_seg_BS) -> o_BLGRK. The integer
    inputs get no cotangent."""

    @jax.custom_vjp
    def attend(q, k, v, *ints):
        return _forward(q, k, v, plan, *ints)[0]

    def attend_fwd(q, k, v, *ints):
        o, (lse,) = _forward(q, k, v, plan, *ints)
        return o, (q, k, v, o, lse, ints)

    def attend_bwd(residuals, do):
        *saved, ints = residuals
        return (*_backward(plan, tuple(saved), do, *ints), *(None,) * len(ints))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def blocked_attention(
    q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, axes=None,
    blocks: BlockSizes = BlockSizes(), q_offset=0, k_offset=0, segment_ids=None
):
    """Softmax(q k^T / sqrt(K)) v without materialising the [L, S] scores.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G.
    Causal without offsets needs L == S (query i attends keys <= i). q_offset, k_offset
    (ints or int32 scalars, possibly traced): global positions of the first query and
    key; the causal mask compares global positions and key blocks no query sees are
    skipped. segment_ids (`SegmentIds`): a query sees only keys of its own document,
    and key blocks no query sees are skipped as well. Keys are processed
    min(blocks.block_k, S) at a time; S is zero-padded to a multiple of that and the
    padding masked. Returns o_BLHK in q's dtype; accumulation
    is f32. axes: unused (nothing is communicated).
    """
    at = not (_is_zero(q_offset) and _is_zero(k_offset)) or segment_ids is not None
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK, causal=causal and not at)
    T = min(blocks.block_k, dims.kv_len)
    plan = _Plan(causal=causal, block_k=T, kv_len=dims.kv_len,
                 scale=softmax_scale(dims.head_dim))
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    k_BSGK, v_BSGK = pad_axis(k_BSGK, 1, T), pad_axis(v_BSGK, 1, T)
    if at:
        q_pos_L = jnp.asarray(q_offset, jnp.int32) + jnp.arange(L, dtype=jnp.int32)
        k_pos_S = jnp.asarray(k_offset, jnp.int32) + jnp.arange(k_BSGK.shape[1],
                                                                dtype=jnp.int32)
        seg = (None, None) if segment_ids is None else (
            jnp.asarray(segment_ids.q_BL, jnp.int32),
            pad_axis(jnp.asarray(segment_ids.kv_BS, jnp.int32), 1, T))
        o_BLGRK = _flash_at(plan)(q_BLGRK, k_BSGK, v_BSGK, q_pos_L, k_pos_S, *seg)
    else:
        o_BLGRK = _flash(plan)(q_BLGRK, k_BSGK, v_BSGK)
    return o_BLGRK.reshape(B, L, H, K)


def _is_zero(offset) -> bool:
    """A static offset of 0 (no positions needed)."""
    return isinstance(offset, int) and offset == 0
