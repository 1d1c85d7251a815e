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
               The forward never holds more than one remote block. The backward is
               autodiff's: each ppermute's transpose sends dK and dV back around the
               ring; every step's probabilities are saved for it (no custom VJP yet, so
               its memory is the allgather's), and masked tiles are computed, then
               masked (not skipped).

`CP_COMMS` is the registry `--cp-comm` names; `CP_KERNELS` the local kernels that take
global query and key offsets (the only ones a cp rank's chunks can use).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import collectives
from layers.context import chunk_ids, chunk_positions, local_positions, natural_order
from layers.kernels.reference import reference_attention
from layers.kernels.shared import MASK_VALUE, causal_mask, softmax_scale, varying_like

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


def ring_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference"):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks) -> o [B, L_cp, H, K]
    in q's dtype, the allgather kernel's result with K and V passed around the ring.
    kernel: unused (the ring folds dense blocks itself)."""
    B, L, H, K = q_BLHK.shape
    G = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    q_pos_L = local_positions(L, axes)
    m_BGRL = jnp.full((B, G, H // G, L), MASK_VALUE, jnp.float32)
    l_BGRL = jnp.zeros((B, G, H // G, L), jnp.float32)
    acc_BGRLK = jnp.zeros((B, G, H // G, L, K), jnp.float32)
    m_BGRL, l_BGRL, acc_BGRLK = varying_like((m_BGRL, l_BGRL, acc_BGRLK), q_BLHK, k_BLGK)
    kv = (k_BLGK, v_BLGK)
    for step in range(axes.cp_size):
        if step:  # rank i now holds rank i - step's chunks
            kv = tuple(collectives.ring_shift(x, axes.cp) for x in kv)
        src = (collectives.axis_index(axes.cp) - step) % axes.cp_size
        k_pos_S = chunk_positions(src, L, axes.cp_size)
        mask_LS = causal_mask(q_pos_L, k_pos_S)
        s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, kv[0],
                             preferred_element_type=jnp.float32) * softmax_scale(K)
        s_BGRLS = jnp.where(mask_LS, s_BGRLS, MASK_VALUE)
        m_new_BGRL = jnp.maximum(m_BGRL, jnp.max(s_BGRLS, axis=-1))
        p_BGRLS = jnp.where(mask_LS, jnp.exp(s_BGRLS - m_new_BGRL[..., None]), 0.0)
        fix_BGRL = jnp.exp(m_BGRL - m_new_BGRL)
        l_BGRL = l_BGRL * fix_BGRL + jnp.sum(p_BGRLS, axis=-1)
        acc_BGRLK = acc_BGRLK * fix_BGRL[..., None] + jnp.einsum(
            "BGRLS,BSGK->BGRLK", p_BGRLS.astype(kv[1].dtype), kv[1],
            preferred_element_type=jnp.float32)
        m_BGRL = m_new_BGRL
    # every query sees its own key (step 0), so l > 0
    o_BGRLK = acc_BGRLK / l_BGRL[..., None]
    return o_BGRLK.transpose(0, 3, 1, 2, 4).reshape(B, L, H, K).astype(q_BLHK.dtype)


CP_COMMS = {"allgather": allgather_attention, "ring": ring_attention}
