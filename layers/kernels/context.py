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
               each block's probabilities; one last shift takes dK, dV home. Masked
               tiles are computed, then masked (not skipped).

`CP_COMMS` is the registry `--cp-comm` names; `CP_KERNELS` the local kernels that take
global query and key offsets (the only ones a cp rank's chunks can use).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

import collectives
from layers.context import chunk_ids, chunk_positions, natural_order
from layers.kernels.reference import reference_attention
from layers.kernels.shared import MASK_VALUE, causal_mask, flash_vjp, softmax_scale, varying_like

CP_KERNELS = {"reference": reference_attention}


def allgather_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference"):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks i and 2cp−1−i) ->
    o [B, L_cp, H, K] in q's dtype: causal attention at global positions over the keys
    all-gathered from every cp rank."""
    attend = CP_KERNELS[kernel]
    k_BSGK, v_BSGK = (natural_order(collectives.gather(x, axes.cp, dim=1), axes.cp_size)
                      for x in (k_BLGK, v_BLGK))
    c = q_BLHK.shape[1] // 2
    outs = [attend(q_BLHK[:, j * c:(j + 1) * c], k_BSGK, v_BSGK, causal=True, q_offset=m * c,
                   k_offset=0)
            for j, m in enumerate(chunk_ids(axes))]
    return jnp.concatenate(outs, axis=1)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of a ring: the cp axis and its size."""

    axis: str | None
    size: int


def _block_scores(q_BLGRK, k_BSGK, src, ring: _Ring):
    """Scaled scores of the local queries against rank `src`'s chunks, masked at global
    positions: (s_BGRLS f32, mask_LS)."""
    L = q_BLGRK.shape[1]
    mask_LS = causal_mask(chunk_positions(collectives.axis_index(ring.axis), L, ring.size),
                          chunk_positions(src, k_BSGK.shape[1], ring.size))
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                         preferred_element_type=jnp.float32) * softmax_scale(q_BLGRK.shape[-1])
    return jnp.where(mask_LS, s_BGRLS, MASK_VALUE), mask_LS


def _source(step: int, ring: _Ring):
    """The rank whose chunks this rank holds at `step` (they moved `step` ranks on)."""
    return (collectives.axis_index(ring.axis) - step) % ring.size


def _ring_forward(q_BLGRK, k_BSGK, v_BSGK, ring: _Ring):
    """o_BLGRK (q's dtype) and the row log-sum-exp lse_BGRL (f32) for the backward."""
    B, L, G, R, K = q_BLGRK.shape
    m_BGRL = jnp.full((B, G, R, L), MASK_VALUE, jnp.float32)
    l_BGRL = jnp.zeros((B, G, R, L), jnp.float32)
    acc_BGRLK = jnp.zeros((B, G, R, L, K), jnp.float32)
    m_BGRL, l_BGRL, acc_BGRLK = varying_like((m_BGRL, l_BGRL, acc_BGRLK), q_BLGRK, k_BSGK)
    kv = (k_BSGK, v_BSGK)
    for step in range(ring.size):
        if step:
            kv = tuple(collectives.ring_shift(x, ring.axis) for x in kv)
        s_BGRLS, mask_LS = _block_scores(q_BLGRK, kv[0], _source(step, ring), ring)
        m_new_BGRL = jnp.maximum(m_BGRL, jnp.max(s_BGRLS, axis=-1))
        p_BGRLS = jnp.where(mask_LS, jnp.exp(s_BGRLS - m_new_BGRL[..., None]), 0.0)
        fix_BGRL = jnp.exp(m_BGRL - m_new_BGRL)
        l_BGRL = l_BGRL * fix_BGRL + jnp.sum(p_BGRLS, axis=-1)
        acc_BGRLK = acc_BGRLK * fix_BGRL[..., None] + jnp.einsum(
            "BGRLS,BSGK->BGRLK", p_BGRLS.astype(kv[1].dtype), kv[1],
            preferred_element_type=jnp.float32)
        m_BGRL = m_new_BGRL
    # every query sees its own key (step 0), so l > 0
    o_BLGRK = (acc_BGRLK / l_BGRL[..., None]).transpose(0, 3, 1, 2, 4)
    return o_BLGRK.astype(q_BLGRK.dtype), (m_BGRL + jnp.log(l_BGRL),)


def _ring_backward(ring: _Ring, residuals, do_BLGRK):
    """K/V go around the ring again with their dK/dV accumulators beside them; at each
    step P = exp(s - lse) is recomputed for the block held, dQ accumulates here and the
    block's dK, dV are added to the accumulators travelling with it. After cp steps
    each accumulator is one rank short of home: one more shift delivers it."""
    q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, lse_BGRL = residuals
    f32 = jnp.float32
    scale = softmax_scale(q_BLGRK.shape[-1])
    delta_BGRL = jnp.einsum("BLGRK,BLGRK->BGRL", do_BLGRK.astype(f32), o_BLGRK.astype(f32))
    do_f_BLGRK = do_BLGRK.astype(f32)
    dq_BLGRK = varying_like(jnp.zeros(q_BLGRK.shape, f32), q_BLGRK, k_BSGK)
    dkv = varying_like((jnp.zeros(k_BSGK.shape, f32), jnp.zeros(v_BSGK.shape, f32)),
                       q_BLGRK, k_BSGK)
    kv = (k_BSGK, v_BSGK)
    for step in range(ring.size):
        if step:
            kv = tuple(collectives.ring_shift(x, ring.axis) for x in kv)
            dkv = tuple(collectives.ring_shift(x, ring.axis) for x in dkv)
        s_BGRLS, mask_LS = _block_scores(q_BLGRK, kv[0], _source(step, ring), ring)
        p_BGRLS = jnp.where(mask_LS, jnp.exp(s_BGRLS - lse_BGRL[..., None]), 0.0)
        dv_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", p_BGRLS, do_f_BLGRK)
        dp_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", do_f_BLGRK, kv[1].astype(f32))
        ds_BGRLS = p_BGRLS * (dp_BGRLS - delta_BGRL[..., None]) * scale
        dq_BLGRK = dq_BLGRK + jnp.einsum("BGRLS,BSGK->BLGRK", ds_BGRLS, kv[0].astype(f32))
        dk_BSGK = jnp.einsum("BGRLS,BLGRK->BSGK", ds_BGRLS, q_BLGRK.astype(f32))
        dkv = (dkv[0] + dk_BSGK, dkv[1] + dv_BSGK)
    dk_BSGK, dv_BSGK = (collectives.ring_shift(x, ring.axis) for x in dkv)
    return (dq_BLGRK.astype(q_BLGRK.dtype), dk_BSGK.astype(k_BSGK.dtype),
            dv_BSGK.astype(v_BSGK.dtype))


@functools.cache
def _ring(ring: _Ring):
    return flash_vjp(_ring_forward, _ring_backward, ring)


def ring_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference"):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks) -> o [B, L_cp, H, K]
    in q's dtype, the allgather kernel's result with K and V passed around the ring.
    kernel: unused (the ring folds dense blocks itself)."""
    B, L, H, K = q_BLHK.shape
    G = k_BLGK.shape[2]
    o_BLGRK = _ring(_Ring(axes.cp, axes.cp_size))(q_BLHK.reshape(B, L, G, H // G, K),
                                                   k_BLGK, v_BLGK)
    return o_BLGRK.reshape(B, L, H, K)


CP_COMMS = {"allgather": allgather_attention, "ring": ring_attention}
