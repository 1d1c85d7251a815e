"""What every attention kernel shares: shape checks, tile sizes, masks, the softmax
scale, padding and the custom_vjp wrapper.

Shape letters: B batch, L query length, S key length, H query heads, G kv heads,
K head dim, R = H // G query heads per kv head; Q query rows and T keys of one tile.

The kernel signature, for every entry of `layers.kernels.KERNELS`:

    kernel(q_BLHK, k_BSGK, v_BSGK, *, causal=True, axes=None, segment_ids=None,
           **options) -> o_BLHK

q [B, L, H, K]; k, v [B, S, G, K] with H a multiple of G (query head h reads kv head
h // R); o in q's dtype. segment_ids (`SegmentIds`, packed documents): a query attends a
key only if both carry the same id (and, causal, the key is not later). `axes` (a `layers.axes.Axes`) is for kernels that communicate
(e.g. K/V blocks travelling around a sequence-parallel ring); the local kernels accept
it and move nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import collectives

# Finite stand-in for -inf in the flash kernels: masked scores never produce
# inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class SegmentIds(NamedTuple):
    """Document ids of the queries and of the keys (int32): q [B, L], kv [B, S]. A query
    attends only keys of its own document. Ids are non-decreasing along the sequence
    (documents packed in order: `layers.documents`), which lets the flash kernels skip
    a tile whose last key's id is below its first query's (the Pallas kernel relies on
    it; the masks themselves compare ids for equality)."""

    q_BL: jax.Array
    kv_BS: jax.Array


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


def softmax_scale(head_dim: int) -> float:
    """The 1 / sqrt(K) the flash kernels multiply their scores by."""
    return head_dim**-0.5


def pad_axis(x, axis: int, multiple: int):
    """Pads `x` with zeros at the end of `axis` up to a multiple of `multiple`."""
    pad = -x.shape[axis] % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def positions(offset, n: int):
    """Global positions of n consecutive tokens whose first is at `offset`: [n] for
    offset 0 or a scalar, [..., n] for an array of offsets [...] (one per row)."""
    if isinstance(offset, int) and offset == 0:
        return jnp.arange(n)
    return jnp.asarray(offset)[..., None] + jnp.arange(n)


def causal_mask(q_pos, k_pos_S):
    """Query at q_pos sees keys at positions <= its own: q_pos [L] or [B, L], k_pos [S]
    -> bool [L, S] or [B, L, S]."""
    return q_pos[..., :, None] >= k_pos_S[None, :]


def same_segment(q_seg_BL, k_seg_BS):
    """Query l and key s are in one document: bool [B, L, S]."""
    return q_seg_BL[:, :, None] == k_seg_BS[:, None, :]


def heads_mask(mask_LS):
    """A mask [L, S] or [B, L, S] shaped to broadcast against scores [B, G, R, L, S]."""
    return mask_LS if mask_LS.ndim == 2 else mask_LS[:, None, None]


def tile_mask(q_pos_Q, k_pos_T, *, causal: bool, kv_len: int):
    """Which (query, key) pairs of a tile attend: bool [Q, T].

    Keys at positions >= kv_len are padding; causal keeps keys <= the query.
    """
    mask_QT = k_pos_T[None, :] < kv_len
    if causal:
        mask_QT = mask_QT & (q_pos_Q[:, None] >= k_pos_T[None, :])
    return mask_QT


def varying_like(carry, *refs):
    """Inside shard_map a scan carry must vary over the same mesh axes as the body's
    result: mark the fresh initial carry as varying wherever any of `refs` does."""
    axes = tuple(frozenset().union(*map(collectives.varying_axes, refs)))
    return jax.tree.map(lambda c: collectives.broadcast(c, axes), carry)


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
