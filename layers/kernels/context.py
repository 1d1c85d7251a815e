"""Context-parallel attention: queries of this cp rank's two load-balanced chunks
(layers/context.py) against the keys of the whole sequence.

Shape letters as in layers/kernels/shared.py; L_cp = 2c local tokens, c per chunk,
S = cp · L_cp the whole sequence.

    allgather  all-gather K and V over cp (G kv heads only: small under GQA), put them
               in position order, and attend each local query chunk with a causal mask
               at its global positions. Under check_vma the gather's transpose is a
               reduce-scatter, so the backward reduce-scatters dK and dV over cp.
    ring       K and V travel around the cp ring by ppermute, one rank's chunks per step
               (cp steps, cp − 1 shifts), each step folded into an online-softmax carry
               (running max, sum and output) with the causal mask at global positions.
               The forward never holds more than one remote block and saves only
               the row log-sum-exp. The backward (custom VJP) sends K and V around
               again with dK and dV accumulators travelling beside them, recomputing
               each block's probabilities; one last shift takes dK, dV home. Of each
               remote block only the visible half is computed (`_earlier`).

Segment ids (packed documents, `SegmentIds`): q_BL holds this rank's local tokens' ids
[B, L_cp], kv_BS the ids of the whole window [B, S] in position order. The tokens are
replicated over cp, so every rank derives the whole window's ids itself and no id
travels: the all-gather path hands each query chunk the ids of the key prefix it reads,
the ring slices the ids of the block that arrived (the source rank's chunk positions)
out of the window's. Every tile then also masks across documents; remote ring tiles,
unmasked before, are masked by ids alone.

`CP_COMMS` is the registry `--cp-comm` names; `CP_KERNELS` the local kernels that take
global query and key offsets (the only ones a cp rank's chunks can use).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers.context import chunk_ids, chunk_positions, natural_order
from layers.kernels import blocked
from layers.kernels.blocked import blocked_attention
from layers.kernels.chunked import chunked_attention
from layers.kernels.reference import reference_attention
from layers.kernels.shared import (MASK_VALUE, BlockSizes, SegmentIds, causal_mask, flash_vjp,
                                   heads_mask, pad_axis, same_segment, softmax_scale)

CP_KERNELS = {"reference": reference_attention, "chunked": chunked_attention,
              "blocked": blocked_attention}


def allgather_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference",
                        segment_ids: SegmentIds | None = None):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks i and 2cp−1−i) ->
    o [B, L_cp, H, K] in q's dtype: causal attention at global positions over the keys
    all-gathered from every cp rank, by the local kernel `kernel` (`CP_KERNELS`). The
    first chunk (i < cp) sees only the first half of the keys, so it is given only
    those; within a call the kernel skips what it can (blocked: every key block past
    the chunk's last position, or before the chunk's first document). segment_ids: the
    local and whole-window document ids (module doc)."""
    attend = CP_KERNELS[kernel]
    k_BSGK, v_BSGK = (natural_order(collectives.gather(x, axes.cp, dim=1), axes.cp_size)
                      for x in (k_BLGK, v_BLGK))
    c = q_BLHK.shape[1] // 2
    S = k_BSGK.shape[1]
    seg = lambda j: {} if segment_ids is None else dict(segment_ids=SegmentIds(  # noqa: E731
        segment_ids.q_BL[:, j * c:(j + 1) * c], segment_ids.kv_BS[:, :S // (2 - j)]))
    outs = [attend(q_BLHK[:, j * c:(j + 1) * c], k_BSGK[:, :S // (2 - j)],
                   v_BSGK[:, :S // (2 - j)], causal=True, q_offset=m * c, k_offset=0, **seg(j))
            for j, m in enumerate(chunk_ids(axes))]
    return jnp.concatenate(outs, axis=1)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of a ring: the cp axis and its size; block_k > 0 runs each
    step's tile with the blocked kernel (key blocks of block_k), 0 as one dense tile."""

    axis: str | None
    size: int
    block_k: int = 0


def _blocked_plan(S: int, K: int, ring: _Ring) -> blocked._Plan:
    T = min(ring.block_k, S)
    return blocked._Plan(causal=True, block_k=T, kv_len=S, scale=softmax_scale(K))


def _mask(q_pos_L, k_pos_S, seg, masked: bool):
    """A dense tile's mask: causal at global positions when `masked`, and within
    documents when seg = (q_seg_BL, k_seg_BS) is given; None when nothing is masked."""
    mask = causal_mask(q_pos_L, k_pos_S) if masked else None
    if seg is not None:
        same_BLS = same_segment(*seg)
        mask = same_BLS if mask is None else mask & same_BLS
    return None if mask is None else heads_mask(mask)


def _tile_stats(q_BLGRK, k_BSGK, v_BSGK, q_pos_L, k_pos_S, ring: _Ring, masked: bool,
                seg=None):
    """One tile's softmax pieces (m, l, acc; f32) at global positions: dense (masked
    causally only when `masked`, by document when seg = (q_seg_BL, k_seg_BS)) or, with
    ring.block_k, the blocked kernel's forward (o, lse) as m = lse, l = 1, acc = o (the
    same online-softmax state)."""
    if not ring.block_k:
        return _block_stats(q_BLGRK, k_BSGK, v_BSGK, _mask(q_pos_L, k_pos_S, seg, masked))
    S = k_BSGK.shape[1]
    plan = _blocked_plan(S, q_BLGRK.shape[-1], ring)
    k, v = (pad_axis(x, 1, plan.block_k) for x in (k_BSGK, v_BSGK))
    k_pos = pad_axis(k_pos_S, 0, plan.block_k)
    ids = (None, None) if seg is None else (seg[0], pad_axis(seg[1], 1, plan.block_k))
    o_BLGRK, (lse_BGRL,) = blocked._forward(q_BLGRK, k, v, plan, q_pos_L, k_pos, *ids)
    acc_BGRLK = o_BLGRK.astype(jnp.float32).transpose(0, 2, 3, 1, 4)
    return lse_BGRL, jnp.ones_like(lse_BGRL), acc_BGRLK


def _tile_grads(q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, do_BLGRK, lse_BGRL, delta_BGRL, q_pos_L,
                k_pos_S, ring: _Ring, masked: bool, seg=None):
    """One tile's (dq, dk, dv) (f32) from the global o and lse: dense, or the blocked
    kernel's backward (which skips key blocks no query sees). Masks as `_tile_stats`."""
    if not ring.block_k:
        return _block_grads(q_BLGRK, k_BSGK, v_BSGK, do_BLGRK, lse_BGRL, delta_BGRL,
                            _mask(q_pos_L, k_pos_S, seg, masked))
    S = k_BSGK.shape[1]
    plan = _blocked_plan(S, q_BLGRK.shape[-1], ring)
    k, v = (pad_axis(x, 1, plan.block_k) for x in (k_BSGK, v_BSGK))
    k_pos = pad_axis(k_pos_S, 0, plan.block_k)
    ids = (None, None) if seg is None else (seg[0], pad_axis(seg[1], 1, plan.block_k))
    dq, dk, dv = blocked._backward(plan, (q_BLGRK, k, v, o_BLGRK, lse_BGRL), do_BLGRK,
                                   q_pos_L, k_pos, *ids)
    f32 = jnp.float32
    return dq.astype(f32), dk[:, :S].astype(f32), dv[:, :S].astype(f32)


def _scores(q_BLGRK, k_BSGK, mask_LS=None):
    """Scaled scores s_BGRLS (f32), masked where mask_LS is False (None: all visible)."""
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                         preferred_element_type=jnp.float32) * softmax_scale(q_BLGRK.shape[-1])
    return s_BGRLS if mask_LS is None else jnp.where(mask_LS, s_BGRLS, MASK_VALUE)


def _block_stats(q_BLGRK, k_BSGK, v_BSGK, mask_LS=None):
    """One block's softmax pieces: row max m_BGRL, sum l_BGRL of exp(s - m), and
    unnormalised output acc_BGRLK (all f32)."""
    s_BGRLS = _scores(q_BLGRK, k_BSGK, mask_LS)
    m_BGRL = jnp.max(s_BGRLS, axis=-1)
    e_BGRLS = jnp.exp(s_BGRLS - m_BGRL[..., None])
    if mask_LS is not None:
        e_BGRLS = jnp.where(mask_LS, e_BGRLS, 0.0)
    acc_BGRLK = jnp.einsum("BGRLS,BSGK->BGRLK", e_BGRLS.astype(v_BSGK.dtype), v_BSGK,
                           preferred_element_type=jnp.float32)
    return m_BGRL, jnp.sum(e_BGRLS, axis=-1), acc_BGRLK


def _block_grads(q_BLGRK, k_BSGK, v_BSGK, do_BLGRK, lse_BGRL, delta_BGRL, mask_LS=None):
    """One block's (dq, dk, dv), f32, from P = exp(s - lse) recomputed."""
    f32 = jnp.float32
    s_BGRLS = _scores(q_BLGRK, k_BSGK, mask_LS)
    p_BGRLS = jnp.exp(s_BGRLS - lse_BGRL[..., None])
    if mask_LS is not None:
        p_BGRLS = jnp.where(mask_LS, p_BGRLS, 0.0)
    do_BLGRK = do_BLGRK.astype(f32)
    dv_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", p_BGRLS, do_BLGRK)
    dp_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", do_BLGRK, v_BSGK.astype(f32))
    ds_BGRLS = p_BGRLS * (dp_BGRLS - delta_BGRL[..., None]) * softmax_scale(q_BLGRK.shape[-1])
    dq_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", ds_BGRLS, k_BSGK.astype(f32))
    dk_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", ds_BGRLS, q_BLGRK.astype(f32))
    return dq_BLGRK, dk_BSGK, dv_BSGK


def _earlier(step: int, ring: _Ring):
    """At step > 0 the chunks held come from rank src = i - step. If src < i, both local
    query chunks see all of chunk src and none of chunk 2cp-1-src: the visible tile is
    (all queries) x (the first key chunk). Else only query chunk 2cp-1-i sees anything,
    and it sees both key chunks: (the second query chunk) x (all keys). Either way one
    unmasked tile of half the block; the other half is skipped."""
    i = collectives.axis_index(ring.axis)
    return (i - step) % ring.size < i


def _pad_rows(x, c: int, axis: int, value):
    """Put the second query chunk's rows x back in a whole local row range: `value`
    (nothing seen) for the first chunk's c rows."""
    pad = jnp.full(x.shape[:axis] + (c,) + x.shape[axis + 1:], value, x.dtype)
    return jnp.concatenate([pad, x], axis=axis)


def _pad_keys(x, axis: int = 1):
    """A first key chunk's grads back in the whole block: zeros for the second chunk."""
    return jnp.concatenate([x, jnp.zeros_like(x)], axis=axis)


def _ids(seg, rows=slice(None), keys=None):
    """Segment ids (q rows, k ids) of one tile, or None without ids: seg = (q_seg_BL,
    window_BS); keys: the tile's key ids [B, S'] (None: the local tokens' own)."""
    if seg is None:
        return None
    return seg[0][:, rows], seg[0] if keys is None else keys


def _arrived_ids(seg, src_pos_L):
    """The ids of the block that arrived from the rank holding positions src_pos_L: the
    window's ids at those positions (no communication), or None without ids."""
    return None if seg is None else jnp.take(seg[1], src_pos_L, axis=1)


def _ring_forward(q_BLGRK, k_BSGK, v_BSGK, ring: _Ring, seg=None):
    """o_BLGRK (q's dtype) and the row log-sum-exp lse_BGRL (f32) for the backward.
    seg: None or (q_seg_BL, window_BS), the segment ids (module doc)."""
    L = q_BLGRK.shape[1]
    c = L // 2
    i = collectives.axis_index(ring.axis)
    pos_L = chunk_positions(i, L, ring.size)
    m_BGRL, l_BGRL, acc_BGRLK = _tile_stats(q_BLGRK, k_BSGK, v_BSGK, pos_L, pos_L, ring, True,
                                            _ids(seg))
    kv = (k_BSGK, v_BSGK)
    # in the remote tiles below every query sees every key causally: positions only
    # place them (the blocked kernel's mask); only segment ids, if any, mask
    src_pos = lambda step: chunk_positions((i - step) % ring.size, L, ring.size)

    def keys_first(q_BLGRK, k_BSGK, v_BSGK, k_pos_L, k_seg_BL):
        return _tile_stats(q_BLGRK, k_BSGK[:, :c], v_BSGK[:, :c], pos_L, k_pos_L[:c], ring,
                           False, _ids(seg, keys=None if seg is None else k_seg_BL[:, :c]))

    def queries_second(q_BLGRK, k_BSGK, v_BSGK, k_pos_L, k_seg_BL):
        m_BGRL, l_BGRL, acc_BGRLK = _tile_stats(q_BLGRK[:, c:], k_BSGK, v_BSGK, pos_L[c:],
                                                k_pos_L, ring, False,
                                                _ids(seg, slice(c, None), k_seg_BL))
        return (_pad_rows(m_BGRL, c, 3, MASK_VALUE), _pad_rows(l_BGRL, c, 3, 0.0),
                _pad_rows(acc_BGRLK, c, 3, 0.0))

    for step in range(1, ring.size):
        kv = tuple(collectives.ring_shift(x, ring.axis) for x in kv)
        mb_BGRL, lb_BGRL, accb_BGRLK = lax.cond(_earlier(step, ring), keys_first,
                                                queries_second, q_BLGRK, *kv, src_pos(step),
                                                _arrived_ids(seg, src_pos(step)))
        m_new_BGRL = jnp.maximum(m_BGRL, mb_BGRL)
        old_BGRL, new_BGRL = jnp.exp(m_BGRL - m_new_BGRL), jnp.exp(mb_BGRL - m_new_BGRL)
        l_BGRL = l_BGRL * old_BGRL + lb_BGRL * new_BGRL
        acc_BGRLK = acc_BGRLK * old_BGRL[..., None] + accb_BGRLK * new_BGRL[..., None]
        m_BGRL = m_new_BGRL
    # every query sees its own key (step 0, in its own document), so l > 0
    o_BLGRK = (acc_BGRLK / l_BGRL[..., None]).transpose(0, 3, 1, 2, 4)
    return o_BLGRK.astype(q_BLGRK.dtype), (m_BGRL + jnp.log(l_BGRL),)


def _ring_backward(ring: _Ring, residuals, do_BLGRK, seg=None):
    """K/V go around the ring again with their dK/dV accumulators beside them; at each
    step the visible tile's P = exp(s - lse) is recomputed, dQ accumulates here and the
    tile's dK, dV are added to the accumulators travelling with the block. After the
    cp steps each accumulator is one rank short of home: one more shift delivers it.
    seg: as `_ring_forward`'s."""
    q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, lse_BGRL = residuals
    L = q_BLGRK.shape[1]
    c = L // 2
    delta_BGRL = jnp.einsum("BLGRK,BLGRK->BGRL", do_BLGRK.astype(jnp.float32),
                            o_BLGRK.astype(jnp.float32))
    i = collectives.axis_index(ring.axis)
    pos_L = chunk_positions(i, L, ring.size)
    dq_BLGRK, dk_BSGK, dv_BSGK = _tile_grads(q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, do_BLGRK,
                                             lse_BGRL, delta_BGRL, pos_L, pos_L, ring, True,
                                             _ids(seg))
    kv, dkv = (k_BSGK, v_BSGK), (dk_BSGK, dv_BSGK)
    src_pos = lambda step: chunk_positions((i - step) % ring.size, L, ring.size)

    def keys_first(q_BLGRK, k_BSGK, v_BSGK, k_pos_L, k_seg_BL):
        dq, dk, dv = _tile_grads(q_BLGRK, k_BSGK[:, :c], v_BSGK[:, :c], o_BLGRK, do_BLGRK,
                                 lse_BGRL, delta_BGRL, pos_L, k_pos_L[:c], ring, False,
                                 _ids(seg, keys=None if seg is None else k_seg_BL[:, :c]))
        return dq, _pad_keys(dk), _pad_keys(dv)

    def queries_second(q_BLGRK, k_BSGK, v_BSGK, k_pos_L, k_seg_BL):
        dq, dk, dv = _tile_grads(q_BLGRK[:, c:], k_BSGK, v_BSGK, o_BLGRK[:, c:],
                                 do_BLGRK[:, c:], lse_BGRL[..., c:], delta_BGRL[..., c:],
                                 pos_L[c:], k_pos_L, ring, False,
                                 _ids(seg, slice(c, None), k_seg_BL))
        return _pad_rows(dq, c, 1, 0.0), dk, dv

    for step in range(1, ring.size):
        kv = tuple(collectives.ring_shift(x, ring.axis) for x in kv)
        dkv = tuple(collectives.ring_shift(x, ring.axis) for x in dkv)
        dq, dk, dv = lax.cond(_earlier(step, ring), keys_first, queries_second, q_BLGRK, *kv,
                              src_pos(step), _arrived_ids(seg, src_pos(step)))
        dq_BLGRK = dq_BLGRK + dq
        dkv = (dkv[0] + dk, dkv[1] + dv)
    dk_BSGK, dv_BSGK = (collectives.ring_shift(x, ring.axis) for x in dkv)
    return (dq_BLGRK.astype(q_BLGRK.dtype), dk_BSGK.astype(k_BSGK.dtype),
            dv_BSGK.astype(v_BSGK.dtype))


@functools.cache
def _ring(ring: _Ring):
    return flash_vjp(_ring_forward, _ring_backward, ring)


@functools.cache
def _ring_segmented(ring: _Ring):
    """`_ring` with the segment ids (q_seg_BL, window_BS) as two more inputs (int32, no
    cotangent)."""

    @jax.custom_vjp
    def attend(q, k, v, q_seg_BL, window_BS):
        return _ring_forward(q, k, v, ring, (q_seg_BL, window_BS))[0]

    def attend_fwd(q, k, v, q_seg_BL, window_BS):
        o, saved = _ring_forward(q, k, v, ring, (q_seg_BL, window_BS))
        return o, (q, k, v, o, *saved, q_seg_BL, window_BS)

    def attend_bwd(residuals, do):
        *saved, q_seg_BL, window_BS = residuals
        return (*_ring_backward(ring, tuple(saved), do, (q_seg_BL, window_BS)), None, None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def ring_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference",
                   blocks: BlockSizes = BlockSizes(), segment_ids: SegmentIds | None = None):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks) -> o [B, L_cp, H, K]
    in q's dtype, the allgather kernel's result with K and V passed around the ring.
    kernel: "blocked" runs each step's tile with the blocked kernel (key blocks of
    `blocks.block_k`; the diagonal's invisible blocks skipped), anything else as one
    dense tile (the ring's steps are already the causal tiles). segment_ids: the local
    and whole-window document ids (module doc)."""
    B, L, H, K = q_BLHK.shape
    G = k_BLGK.shape[2]
    block_k = blocks.block_k if kernel == "blocked" else 0
    ring = _Ring(axes.cp, axes.cp_size, block_k)
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    if segment_ids is None:
        o_BLGRK = _ring(ring)(q_BLGRK, k_BLGK, v_BLGK)
    else:
        o_BLGRK = _ring_segmented(ring)(q_BLGRK, k_BLGK, v_BLGK, *segment_ids)
    return o_BLGRK.reshape(B, L, H, K)


@dataclasses.dataclass(frozen=True)
class CpComm:
    """How attention reaches the keys of the other cp ranks: `attend` is
    `allgather_attention` or `ring_attention`; doc: one line for `--help` and the docs."""

    name: str
    attend: Callable
    doc: str

    def __call__(self, q_BLHK, k_BLGK, v_BLGK, **kw):
        return self.attend(q_BLHK, k_BLGK, v_BLGK, **kw)


CP_COMMS: dict[str, CpComm] = {c.name: c for c in (
    CpComm("allgather", allgather_attention,
           doc="all-gather K and V over cp; reduce-scatter dK and dV in the backward"),
    CpComm("ring", ring_attention,
           doc="K and V passed around the cp ring by ppermute into an online-softmax "
               "carry; dK and dV travel with them in the backward"),
)}
