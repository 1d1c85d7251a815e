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
masked. This module tiles only the key axis; `BlockSizes.block_q` is used by the
Pallas kernel in layers/flash_pallas.py, which imports `BlockSizes`,
`attention_dims`, `pad_axis` and `tile_mask` from here.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import collectives

# Finite stand-in for -inf: masked scores never produce inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: block_q query rows and block_k keys per tile."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"block sizes must be positive, got {self}")


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    """Validated sizes of one attention call."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """R: query heads sharing one kv head."""
        return self.heads // self.kv_heads


def attention_dims(q_BLHK, k_BSGK, v_BSGK, *, causal: bool) -> AttentionDims:
    """Checks q [B, L, H, K], k and v [B, S, G, K] and returns their sizes."""
    if q_BLHK.ndim != 4 or k_BSGK.ndim != 4 or k_BSGK.shape != v_BSGK.shape:
        raise ValueError(
            "expected q [B, L, H, K] and k, v [B, S, G, K] with equal shapes, got "
            f"q {q_BLHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}"
        )
    B, L, H, K = q_BLHK.shape
    Bk, S, G, Kk = k_BSGK.shape
    if (B, K) != (Bk, Kk):
        raise ValueError(
            f"batch and head dim must match: q {q_BLHK.shape}, k {k_BSGK.shape}"
        )
    if G < 1 or H % G != 0:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads G={G}")
    if causal and L != S:
        raise ValueError(f"causal attention needs L == S, got L={L}, S={S}")
    if L < 1 or S < 1:
        raise ValueError(f"empty sequence: L={L}, S={S}")
    return AttentionDims(B, L, S, H, G, K)


def pad_axis(x, axis: int, multiple: int):
    """Pads `x` with zeros at the end of `axis` up to a multiple of `multiple`."""
    pad = -x.shape[axis] % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def tile_mask(q_pos_Q, k_pos_T, *, causal: bool, kv_len: int):
    """Which (query, key) pairs of a tile attend: bool [Q, T].

    Keys at positions >= kv_len are padding; causal keeps keys <= the query.
    """
    mask_QT = k_pos_T[None, :] < kv_len
    if causal:
        mask_QT = mask_QT & (q_pos_Q[:, None] >= k_pos_T[None, :])
    return mask_QT


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


def _varying_like(carry, *refs):
    """Inside shard_map a scan carry must vary over the same mesh axes as the body's
    result: mark the fresh initial carry as varying wherever any of `refs` does."""
    axes = tuple(frozenset().union(*map(collectives.varying_axes, refs)))
    return jax.tree.map(lambda c: collectives.broadcast(c, axes), carry)


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

    init = _varying_like(
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
    init = _varying_like(jnp.zeros(q_BLGRK.shape, f32), q_BLGRK, k_BSGK, v_BSGK, do_BLGRK)
    dq_BLGRK, (dk_JBTGK, dv_JBTGK) = lax.scan(step, init, xs)
    return dq_BLGRK.astype(q_BLGRK.dtype), _unblock(dk_JBTGK), _unblock(dv_JBTGK)


def flash_vjp(forward, backward, plan):
    """The differentiable attention (q, k, v) -> o for one static plan, as a custom_vjp:
    `forward(q, k, v, plan)` gives (o, saved), saved a tuple of arrays, and
    `backward(plan, (q, k, v, o, *saved), do)` gives (dq, dk, dv)."""

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v, plan)[0]

    def attend_fwd(q, k, v):
        o, saved = forward(q, k, v, plan)
        return o, (q, k, v, o, *saved)

    attend.defvjp(attend_fwd, functools.partial(backward, plan))
    return attend


@functools.cache
def _flash(plan: _Plan):
    """The differentiable attention for one static plan: (q_BLGRK, k, v) -> o_BLGRK."""
    return flash_vjp(_forward, _backward, plan)


def blocked_attention(
    q_BLHK, k_BSGK, v_BSGK, *, causal: bool = True, blocks: BlockSizes = BlockSizes()
):
    """Softmax(q k^T / sqrt(K)) v without materialising the [L, S] scores.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G.
    Causal needs L == S (query i attends keys <= i). Keys are processed
    min(blocks.block_k, S) at a time; S is zero-padded to a multiple of that and
    the padding masked. Returns o_BLHK in q's dtype; accumulation is f32.
    """
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK, causal=causal)
    T = min(blocks.block_k, dims.kv_len)
    plan = _Plan(causal=causal, block_k=T, kv_len=dims.kv_len, scale=dims.head_dim**-0.5)
    B, L, H, K = q_BLHK.shape
    q_BLGRK = q_BLHK.reshape(B, L, dims.kv_heads, dims.group, K)
    o_BLGRK = _flash(plan)(q_BLGRK, pad_axis(k_BSGK, 1, T), pad_axis(v_BSGK, 1, T))
    return o_BLGRK.reshape(B, L, H, K)
