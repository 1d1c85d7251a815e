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
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, flash_vjp, pad_axis,
                                   softmax_scale, tile_mask, varying_like)


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


def _block_scores(q_BLGRK, k_BTGK, j, plan: _Plan):
    """Scaled scores of key block j and its mask: s_BGRLT f32, mask_LT."""
    s_BGRLT = jnp.einsum(
        "BLGRK,BTGK->BGRLT", q_BLGRK, k_BTGK, preferred_element_type=jnp.float32
    )
    T = plan.block_k
    q_pos_L = jnp.arange(q_BLGRK.shape[1])
    k_pos_T = j * T + jnp.arange(T)
    mask_LT = tile_mask(q_pos_L, k_pos_T, causal=plan.causal, kv_len=plan.kv_len)
    return s_BGRLT * plan.scale, mask_LT


def _forward(q_BLGRK, k_BSGK, v_BSGK, plan: _Plan):
    """Online-softmax scan: returns o_BLGRK (q's dtype) and (lse_BGRL,) (f32)."""
    B, L, G, R, K = q_BLGRK.shape
    T = plan.block_k
    J = k_BSGK.shape[1] // T

    def step(carry, xs):
        m_BGRL, l_BGRL, acc_BGRLK = carry
        j, k_BTGK, v_BTGK = xs
        s_BGRLT, mask_LT = _block_scores(q_BLGRK, k_BTGK, j, plan)
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
        q_BLGRK, k_BSGK, v_BSGK)
    xs = (jnp.arange(J), _key_blocks(k_BSGK, T), _key_blocks(v_BSGK, T))
    (m_BGRL, l_BGRL, acc_BGRLK), _ = lax.scan(step, init, xs)
    # A row with no visible key has l == 0: it outputs zeros, not 0 / 0.
    l_safe_BGRL = jnp.where(l_BGRL == 0.0, 1.0, l_BGRL)
    o_BGRLK = acc_BGRLK / l_safe_BGRL[..., None]
    o_BLGRK = o_BGRLK.transpose(0, 3, 1, 2, 4).astype(q_BLGRK.dtype)
    return o_BLGRK, (m_BGRL + jnp.log(l_safe_BGRL),)


def _backward(plan: _Plan, residuals, do_BLGRK):
    """Recomputes P per key block from lse; returns dq, dk, dv in input dtypes."""
    q_BLGRK, k_BSGK, v_BSGK, o_BLGRK, lse_BGRL = residuals
    T = plan.block_k
    J = k_BSGK.shape[1] // T
    f32 = jnp.float32
    delta_BGRL = jnp.einsum(
        "BLGRK,BLGRK->BGRL", do_BLGRK.astype(f32), o_BLGRK.astype(f32)
    )

    def step(dq_BLGRK, xs):
        j, k_BTGK, v_BTGK = xs
        s_BGRLT, mask_LT = _block_scores(q_BLGRK, k_BTGK, j, plan)
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

    xs = (jnp.arange(J), _key_blocks(k_BSGK, T), _key_blocks(v_BSGK, T))
    init = varying_like(jnp.zeros(q_BLGRK.shape, f32), q_BLGRK, k_BSGK, v_BSGK, do_BLGRK)
    dq_BLGRK, (dk_JBTGK, dv_JBTGK) = lax.scan(step, init, xs)
    return dq_BLGRK.astype(q_BLGRK.dtype), _unblock(dk_JBTGK), _unblock(dv_JBTGK)


@functools.cache
def _flash(plan: _Plan):
    """The differentiable attention for one static plan: (q_BLGRK, k, v) -> o_BLGRK."""
    return flash_vjp(_forward, _backward, plan)


def blocked_attention(
    q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, axes=None,
    blocks: BlockSizes = BlockSizes()
):
    """Softmax(q k^T / sqrt(K)) v without materialising the [L, S] scores.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G.
    Causal needs L == S (query i attends keys <= i). Keys are processed
    min(blocks.block_k, S) at a time; S is zero-padded to a multiple of that and
    the padding masked. Returns o_BLHK in q's dtype; accumulation is f32. axes: unused
    (nothing is communicated).
    """
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK, causal=causal)
    T = min(blocks.block_k, dims.kv_len)
    plan = _Plan(causal=causal, block_k=T, kv_len=dims.kv_len,
                 scale=softmax_scale(dims.head_dim))
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    o_BLGRK = _flash(plan)(q_BLGRK, pad_axis(k_BSGK, 1, T), pad_axis(v_BSGK, 1, T))
    return o_BLGRK.reshape(B, L, H, K)
