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

A `TpComm` strategy (allreduce, sequence or ring; `TP_COMMS`) says how the input of a
column-parallel matmul is made whole and how the partial sums of a row-parallel matmul
are reduced; `column_parallel` and `row_parallel` call the one they are given.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from collectives.basic import (
    all_reduce, axis_index, axis_size, broadcast, gather, reduce_scatter, ring_shift,
)

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


@dataclasses.dataclass(frozen=True)
class TpComm:
    """How tp keeps activations between blocks and moves them around a tp-sharded matmul.

    column(x, f, axis, dim): f applied to x whole along `dim` (the input of a
        column-parallel matmul, made whole as this strategy stores it).
    row(h, f, axis, dim): f(h) summed over `axis` (f gives partial sums {U_axis}; the
        output of a row-parallel matmul), stored as this strategy keeps activations.
    shards_sequence: activations between blocks are [.., X_axis, ..] along `dim`
        (the sequence) rather than replicated over `axis`.
    doc: one line for `--help` and the docs.
    """

    name: str
    shards_sequence: bool
    doc: str

    def column(self, x: jax.Array, f: Callable, axis: str | None, dim: int):
        raise NotImplementedError

    def row(self, h: jax.Array, f: Callable, axis: str | None, dim: int):
        raise NotImplementedError

    def once(self) -> TpComm:
        """This strategy with a column's input gathered once and kept for the backward:
        inside a remat policy, which recomputes the gathered input anyway (layers/
        block.py), and where the forward and backward are one straight program (the
        loss head), in which XLA would merge the two gathers into one."""
        return self


class AllReduceComm(TpComm):
    """Megatron TP: x [.., X, ..] replicated over `axis`. column: `broadcast` (bwd:
    all-reduce dx); row: `all_reduce` -> [.., X, ..] replicated."""

    def column(self, x, f, axis, dim):
        return f(broadcast(x, axis))

    def row(self, h, f, axis, dim):
        return all_reduce(f(h), axis)


@dataclasses.dataclass(frozen=True)
class SequenceComm(TpComm):
    """Megatron sequence parallel: x [.., X_axis, ..]. column: `gather` along dim (bwd:
    gather x again, reduce-scatter dx); row: `reduce_scatter` along dim ->
    [.., X_axis, ..] (bwd: all-gather).

    The column's backward gathers x again for the weight grads rather than keeping the
    forward's gathered x (the sequence parallelism of Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", MLSys 2023, as Megatron-LM's
    sequence-parallel linear layers run it): the backward keeps x [.., X_axis, ..], 1/n
    of the gathered one, for one more all-gather a column. regather False: gather once
    (`once`)."""

    regather: bool = True

    def column(self, x, f, axis, dim):
        if axis is None or not self.regather:
            return f(gather(x, axis, dim))
        # nothing inside saved: the backward runs the gather again, not f (its outputs
        # are the region's outputs; the matmuls' backward reads only their inputs)
        return jax.checkpoint(lambda x: f(gather(x, axis, dim)), prevent_cse=False,
                              policy=jax.checkpoint_policies.nothing_saveable)(x)

    def once(self) -> TpComm:
        return dataclasses.replace(self, regather=False)

    def row(self, h, f, axis, dim):
        return reduce_scatter(f(h), axis, dim)


class RingComm(TpComm):
    """Sequence parallel with collective matmuls: x [.., X_axis, ..]. column:
    `gather_apply`; row: `apply_reduce_scatter` (bwd: the reverse rings)."""

    def column(self, x, f, axis, dim):
        return gather_apply(x, f, axis, dim)

    def row(self, h, f, axis, dim):
        return apply_reduce_scatter(h, f, axis, dim)


ALLREDUCE = AllReduceComm(
    "allreduce", shards_sequence=False,
    doc="Megatron TP: activations replicated over tp between blocks; each block's "
        "row-parallel output is all-reduced")
TP_COMMS: dict[str, TpComm] = {c.name: c for c in (
    ALLREDUCE,
    SequenceComm("sequence", shards_sequence=True,
                 doc="Megatron sequence parallel: activations sharded over tp along the "
                     "sequence between blocks; all-gather before (again in the backward), "
                     "reduce-scatter after"),
    RingComm("ring", shards_sequence=True,
             doc="sequence parallel with collective matmuls: the all-gather and "
                 "reduce-scatter decomposed into ppermute steps interleaved with partial "
                 "matmuls"))}
COMMS = tuple(TP_COMMS)


def tp_comm(comm: "str | TpComm") -> TpComm:
    """The strategy named `comm` (a strategy passes through)."""
    return TP_COMMS[comm] if isinstance(comm, str) else comm


def column_parallel(x: jax.Array, f: Callable, axis: str | None, dim: int,
                    comm: "str | TpComm"):
    """f applied to x whole along `dim`, x stored as `comm` keeps activations
    (`TpComm.column`)."""
    return tp_comm(comm).column(x, f, axis, dim)


def row_parallel(h: jax.Array, f: Callable, axis: str | None, dim: int,
                 comm: "str | TpComm"):
    """f(h) summed over `axis`, stored as `comm` keeps activations (`TpComm.row`)."""
    return tp_comm(comm).row(h, f, axis, dim)
