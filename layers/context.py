"""The load-balanced causal sequence layout of context parallelism (the `cp` axis).

Each sequence of L tokens is cut into 2·cp chunks of c = L / (2·cp); cp rank i holds
chunks i and 2cp−1−i, in that order, as its local sequence of L_cp = 2c tokens. Under a
causal mask chunk m attends to m + 1 chunks, so every rank attends to (i + 1) +
(2cp − i) = 2cp + 1 chunks: the same causal work on every rank (Megatron-LM's and
torchtitan's layout).

The step cuts the tokens once, at the start of the per-shard step (`shard_sequence`);
everything up to the loss runs on the local chunks. Positions matter in two places
only: RoPE (`local_positions`) and attention's causal mask (layers/kernels/context.py,
which puts the keys gathered over cp back in position order with `natural_order`).
With no cp axis every function here is the identity.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers.axes import Axes


def chunk_ids(axes: Axes) -> tuple[jax.Array, jax.Array]:
    """The global chunk numbers (i, 2cp − 1 − i) this cp rank holds (int32 scalars)."""
    i = collectives.axis_index(axes.cp)
    return i, 2 * axes.cp_size - 1 - i


def shard_sequence(x_BL: jax.Array, axes: Axes) -> jax.Array:
    """This rank's two chunks of whole sequences: [B, L] -> [B, L_cp] (chunk i, then
    chunk 2cp − 1 − i). Moves nothing: x is replicated over cp, the slices are local."""
    if axes.cp is None:
        return x_BL
    c = x_BL.shape[1] // (2 * axes.cp_size)
    return jnp.concatenate([lax.dynamic_slice_in_dim(x_BL, m * c, c, axis=1)
                            for m in chunk_ids(axes)], axis=1)


def local_positions(n: int, axes: Axes) -> jax.Array:
    """Global positions of this rank's n = L_cp local tokens: [n] int32."""
    if axes.cp is None:
        return jnp.arange(n, dtype=jnp.int32)
    return chunk_positions(collectives.axis_index(axes.cp), n, axes.cp_size)


def chunk_positions(rank: jax.Array, n: int, cp: int) -> jax.Array:
    """Global positions of the n = L_cp tokens cp rank `rank` holds (chunks rank and
    2cp − 1 − rank): [n] int32."""
    c = n // 2
    return jnp.concatenate([m * c + jnp.arange(c, dtype=jnp.int32)
                            for m in (rank, 2 * cp - 1 - rank)])


def natural_order(x_BSX: jax.Array, cp: int) -> jax.Array:
    """Keys all-gathered over cp (rank r's chunks r and 2cp − 1 − r, rank after rank)
    back in position order along dim 1: [B, S, ...] -> [B, S, ...]. Static reshapes
    and a flip: rank r's first chunks are chunks 0..cp−1 in order, its second chunks
    are chunks 2cp−1..cp, reversed."""
    B, S = x_BSX.shape[:2]
    rest = x_BSX.shape[2:]
    x = x_BSX.reshape(B, cp, 2, S // (2 * cp), *rest)
    first, second = x[:, :, 0], jnp.flip(x[:, :, 1], axis=1)
    return jnp.concatenate([first, second], axis=1).reshape(B, S, *rest)
