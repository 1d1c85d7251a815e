"""Collective matmuls: a gather or reduce-scatter decomposed into ring steps, each one
ppermute overlapped with the compute on the chunk at hand (the JAX shard_map notebook's
collective matmul section; Wang et al., ASPLOS 2023).

With n devices on `axis` (one axis name, or None for no such axis: then both are
plain `f`), `x` is cut into n chunks along `dim`:

    gather_apply(x, f, axis, dim)         == f(gather(x, axis, dim))
    apply_reduce_scatter(h, f, axis, dim) == reduce_scatter(f(h), axis, dim)

computed as n applications of `f` to one chunk each, with n - 1 `ring_shift`s in
between, and no all-gather or reduce-scatter. `f` must act on each chunk along `dim`
independently (a matmul that does not contract `dim`), so that f of a chunk is that
chunk's part of f of the whole. Autodiff runs the rings backwards: the transpose of a
ppermute is the reverse ppermute, so the backward of gather_apply is a ring
reduce-scatter of the cotangent and that of apply_reduce_scatter a ring all-gather.

`column_parallel` and `row_parallel` pick, by the layout's `comm` ("allreduce",
"sequence" or "ring"), how the input of a column-parallel matmul is made whole and how
the partial sums of a row-parallel matmul are reduced.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from collectives.basic import (
    all_reduce, axis_index, axis_size, broadcast, gather, reduce_scatter, ring_shift,
)

COMMS = ("allreduce", "sequence", "ring")


def _chunk(x: jax.Array, j: jax.Array, n: int, dim: int) -> jax.Array:
    """Chunk j of n along `dim`: [.., X, ..] -> [.., X/n, ..]."""
    c = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, j * c, c, axis=dim)


def _place(whole: jax.Array, part: jax.Array, j: jax.Array, dim: int) -> jax.Array:
    """`whole` with `part` written as its chunk j along `dim`."""
    return lax.dynamic_update_slice_in_dim(whole, part, j * part.shape[dim], axis=dim)


def _zeros_whole(part: jax.Array, n: int, dim: int) -> jax.Array:
    """Zeros shaped like n chunks of `part` along `dim`."""
    shape = list(part.shape)
    shape[dim] *= n
    return jnp.zeros(shape, part.dtype)


def gather_apply(x: jax.Array, f: Callable, axis: str | None, dim: int):
    """f(gather(x, axis, dim)) one chunk at a time as the chunks travel round the ring.

    x: [.., X_axis, ..] along `dim`; f maps a chunk [.., X_axis, ..] to an array or a tuple
    of arrays whose `dim` is that chunk's part, and returns them whole: [.., X, ..].
    Step s applies f to the chunk of device (i - s) mod n while passing it on to i + 1.
    """
    if axis is None:
        return f(x)
    n, i = axis_size(axis), axis_index(axis)
    ys = f(x)
    outs = jax.tree.map(lambda y: _zeros_whole(y, n, dim), ys)
    for s in range(n):
        if s:
            x = ring_shift(x, axis, 1)  # now holding device (i - s)'s chunk
            ys = f(x)
        outs = jax.tree.map(lambda o, y: _place(o, y, (i - s) % n, dim), outs, ys)
    return outs


def apply_reduce_scatter(h: jax.Array, f: Callable, axis: str | None, dim: int):
    """reduce_scatter(f(h), axis, dim) one chunk of h at a time, the partial sums
    accumulated as they travel round the ring.

    h: [.., X, ..] along `dim`; f maps a chunk [.., X_axis, ..] to its part of a partial
    sum over `axis` (an array or a tuple). Returns [.., X_axis, ..]: this device's chunk,
    summed over `axis`. Step s adds f of chunk (i + s) mod n to the accumulator received
    from device i + 1, then passes it on to i - 1; the last step adds chunk i.
    """
    if axis is None:
        return f(h)
    n, i = axis_size(axis), axis_index(axis)
    acc = f(_chunk(h, (i + 1) % n, n, dim))
    for s in range(2, n + 1):
        acc = ring_shift(acc, axis, -1)
        acc = jax.tree.map(jnp.add, acc, f(_chunk(h, (i + s) % n, n, dim)))
    return acc


def column_parallel(x: jax.Array, f: Callable, axis: str | None, dim: int, comm: str):
    """f applied to x whole along `dim`, x stored as `comm` keeps activations:

    allreduce: x [.., X, ..] replicated over `axis`; `broadcast` (bwd: all-reduce dx).
    sequence:  x [.., X_axis, ..]; `gather` along dim (bwd: reduce-scatter dx).
    ring:      x [.., X_axis, ..]; `gather_apply` (bwd: the reverse ring).
    """
    if comm == "ring":
        return gather_apply(x, f, axis, dim)
    if comm == "sequence":
        return f(gather(x, axis, dim))
    return f(broadcast(x, axis))


def row_parallel(h: jax.Array, f: Callable, axis: str | None, dim: int, comm: str):
    """f(h) summed over `axis` (f gives partial sums {U_axis}), stored as `comm` keeps
    activations:

    allreduce: `all_reduce` -> [.., X, ..] replicated over `axis`.
    sequence:  `reduce_scatter` along dim -> [.., X_axis, ..] (bwd: all-gather).
    ring:      `apply_reduce_scatter` -> [.., X_axis, ..] (bwd: the reverse ring).
    """
    if comm == "ring":
        return apply_reduce_scatter(h, f, axis, dim)
    if comm == "sequence":
        return reduce_scatter(f(h), axis, dim)
    return all_reduce(f(h), axis)
