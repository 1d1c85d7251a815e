"""The dense attention every kernel is checked against, and the decode path's kernel.

Letter key as in layers/kernels/shared.py.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from layers.kernels.shared import causal_mask, heads_mask, positions, same_segment


def reference_attention(q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, q_offset=0,
                        k_offset=0, axes=None, segment_ids=None) -> jax.Array:
    """Dense softmax attention, f32 scores. GQA: query head h reads kv head h // R.

    q: [B, L, H, K]; k, v: [B, S, G, K] -> o: [B, L, H, K] in q's dtype.
    q_offset, k_offset: global position of the first query and of the first key (an int,
    or an int array [B] for one offset per row), so a causal mask is right for any
    slice of the sequence: a sequence shard, or new tokens against a KV cache (keys at
    positions above a query's, such as cache slots not yet written, are masked).
    segment_ids (`layers.kernels.shared.SegmentIds`): a query sees only keys of its own
    document. axes: unused (nothing is communicated).
    """
    B, L, H, K = q_BLHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    s_BGRLS = jnp.einsum("BLGRK,BSGK->BGRLS", q_BLGRK, k_BSGK,
                         preferred_element_type=jnp.float32) / math.sqrt(K)
    mask_LS = causal_mask(positions(q_offset, L), positions(k_offset, S)) if causal else None
    if segment_ids is not None:
        same_BLS = same_segment(*segment_ids)
        mask_LS = same_BLS if mask_LS is None else mask_LS & same_BLS
    if mask_LS is not None:  # [L, S], or per row [B, L, S] -> [B, 1, 1, L, S]
        s_BGRLS = jnp.where(heads_mask(mask_LS), s_BGRLS, jnp.finfo(jnp.float32).min)
    p_BGRLS = jax.nn.softmax(s_BGRLS, axis=-1)
    o_BLGRK = jnp.einsum("BGRLS,BSGK->BLGRK", p_BGRLS.astype(v_BSGK.dtype), v_BSGK,
                         preferred_element_type=jnp.float32)
    return o_BLGRK.reshape(B, L, H, K).astype(q_BLHK.dtype)
