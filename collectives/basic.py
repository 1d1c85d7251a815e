"""Gather, reduce-scatter, all-reduce, broadcast, ring shift and all-to-all.

Notation (the scaling book's): `X_a` is dim X sharded over axis `a`; `{U_a}` a partial
sum over `a` not yet reduced. Under `check_vma=True` every value carries the set of
axes it varies over; the adjoint pairs are

    gather  (all-gather)      <->  reduce_scatter (reduce-scatter)
    broadcast (no data moves) <->  all_reduce     (all-reduce)

so `jax.grad` of a gather is a reduce-scatter and of a broadcast an all-reduce.
"""
from __future__ import annotations

import functools
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisNames = Union[None, str, Sequence[str]]


def _names(axis: AxisNames) -> tuple[str, ...]:
    if axis is None:
        return ()
    if isinstance(axis, str):
        return (axis,)
    return tuple(axis)


def varying_axes(x) -> frozenset:
    """Axes `x` (an array, or a jaxpr variable's aval) varies over (jax 0.10 spells it
    `.mat.varying`, older and newer `.vma`)."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else aval.vma


def axis_size(axis: AxisNames) -> int:
    """Number of devices along `axis` (1 when absent)."""
    size = 1
    for name in _names(axis):
        size *= lax.axis_size(name)
    return size


def axis_index(axis: AxisNames) -> jax.Array:
    """This device's row-major index along `axis` (0 when absent)."""
    names = _names(axis)
    if not names:
        return jnp.int32(0)
    return lax.axis_index(names if len(names) > 1 else names[0])


def gather(x: jax.Array, axis: AxisNames, dim: int, *, replicated: bool = False,
           cast=None, keep_grad_dtype: bool = False) -> jax.Array:
    """All-gather: `[.., X_axis, ..] -> [.., X, ..]` along `dim`; transpose is reduce_scatter.

    The result stays typed per-device (so its grad is a reduce-scatter); `replicated=True`
    types it as the same on every device of `axis`, for values returned or compared as
    replicated (its transpose is then a slice, not a reduce-scatter). cast: gather
    `x.astype(cast)`; with `keep_grad_dtype` (not with `replicated`) the transpose
    casts the cotangent back to x's own dtype and reduce-scatters it there."""
    names = _names(axis)
    if cast is not None and not keep_grad_dtype:
        x, cast = x.astype(cast), None
    if cast is not None:
        if replicated:
            raise ValueError("gather: keep_grad_dtype reduce-scatters the grad, "
                             "replicated=True has none")
        return (_gather_cast(names, dim, jnp.dtype(cast), x.dtype)(x) if names
                else x.astype(cast))
    if not names:
        return x
    to = "invarying" if replicated else "varying"
    return lax.all_gather(x, names, axis=dim, tiled=True, to=to)


@functools.cache
def _gather_cast(names: tuple[str, ...], dim: int, cast, dtype):
    """x (of `dtype`) -> all_gather(x.astype(cast)) along `dim`, typed per-device; the
    cotangent is cast to `dtype`, then reduce-scattered."""

    def gather(x):
        return lax.all_gather(x.astype(cast), names, axis=dim, tiled=True, to="varying")

    f = jax.custom_vjp(gather)
    f.defvjp(lambda x: (gather(x), None),
             lambda _, ct: (lax.psum_scatter(ct.astype(dtype), names,
                                             scatter_dimension=dim, tiled=True),))
    return f


def gather_many(xs: Sequence[jax.Array], axis: AxisNames, dims: Sequence[int],
                pack: bool = True, cast=None, keep_grad_dtype: bool = False) -> list:
    """`[gather(x, axis, dim) for x, dim in zip(xs, dims)]` as ONE all-gather.

    Each `[.., X_axis, ..]` is laid out with its gathered dim first and flattened; the
    flat pieces are concatenated into one buffer `[P]`, all-gathered to `[n, P]` and cut
    back, each piece then `[n, X/n, ..] -> [X, ..]` with its dim moved back into place.
    One collective instead of len(xs) (each costs a synchronization of every device);
    the copies around it move the same bytes once more, on the device. Its transpose is
    one reduce-scatter of the concatenated grads. All xs must share a dtype. pack: 2-byte
    dtypes travel as uint32 pairs (`_gather_packed`), for a backend that widens 2-byte
    collectives (`widens_2byte`). cast: gather the xs cast to this dtype (each cast
    before the concatenation); with `keep_grad_dtype` the buffer is cast just before
    the all-gather instead, and the transpose casts the grads back to xs' dtype before
    its reduce-scatter (grads reduced in the params' precision, gathered in the
    compute dtype)."""
    if cast is not None and not keep_grad_dtype:
        xs, cast = [x.astype(cast) for x in xs], None
    names = _names(axis)
    if not names:
        return list(xs) if cast is None else [x.astype(cast) for x in xs]
    moved = [jnp.moveaxis(x, d, 0) for x, d in zip(xs, dims)]
    flat_P = jnp.concatenate([m.reshape(-1) for m in moved])
    cast = None if cast is None else jnp.dtype(cast)
    whole_nP = _gather_packed(names, pack, cast, flat_P.dtype)(flat_P)
    # split, not slices: its transpose concatenates the grads (slices' would pad each
    # to the whole buffer and add them up)
    pieces = jnp.split(whole_nP, np.cumsum([m.size for m in moved])[:-1], axis=1)
    return [jnp.moveaxis(piece.reshape(-1, *m.shape[1:]), 0, d)  # [n, P_x] -> [X, ..]
            for piece, m, d in zip(pieces, moved, dims)]


def widens_2byte(mesh) -> bool:
    """Whether the backend of `mesh` (the default backend for an AbstractMesh) runs bf16
    collectives in f32: XLA:CPU does, so a packed gather moves them at their own size.
    XLA:TPU gathers bf16 natively, and there the packing costs memory: it unpacks the
    gathered u32[n, Q] through a u32[n, Q, 2] broadcast and a copy of it, together 4x
    the gathered bf16 bytes (bench/tpu_compile.py: 7.25 GiB of temporaries for one
    layer of an 8192-wide model)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform == "cpu"
    return jax.default_backend() == "cpu"


@functools.cache
def _gather_packed(names: tuple[str, ...], pack: bool = True, cast=None, dtype=None):
    """[P] -> [n, P] all-gather (typed per-device) whose transpose is a reduce-scatter;
    with `pack`, 2-byte dtypes travel as pairs bitcast to uint32, so a backend that
    widens bf16 collectives (XLA:CPU runs them in f32) moves them at their own size,
    unconverted. cast: gather the buffer (of `dtype`) cast to this dtype; the cotangent
    is cast back to `dtype` before the reduce-scatter."""

    def gather(flat_P):
        if cast is not None:
            flat_P = flat_P.astype(cast)
        if flat_P.dtype.itemsize != 2 or not pack:
            return lax.all_gather(flat_P, names, axis=0, tiled=False, to="varying")
        P = flat_P.shape[0]
        pairs_Q2 = jnp.pad(flat_P, (0, P % 2)).reshape(-1, 2)
        words_nQ = lax.all_gather(lax.bitcast_convert_type(pairs_Q2, jnp.uint32), names,
                                  axis=0, tiled=False, to="varying")
        n = words_nQ.shape[0]
        return lax.bitcast_convert_type(words_nQ, flat_P.dtype).reshape(n, -1)[:, :P]

    f = jax.custom_vjp(gather)
    f.defvjp(lambda flat_P: (gather(flat_P), None),
             lambda _, ct_nP: (lax.psum_scatter(ct_nP if cast is None else ct_nP.astype(dtype),
                                                names, scatter_dimension=0, tiled=False),))
    return f


def reduce_scatter(x: jax.Array, axis: AxisNames, dim: int) -> jax.Array:
    """Reduce-scatter: `[.., X, ..]{U_axis} -> [.., X_axis, ..]` along `dim`."""
    names = _names(axis)
    if not names:
        return x
    return lax.psum_scatter(x, names, scatter_dimension=dim, tiled=True)


def all_reduce(x: jax.Array, axis: AxisNames) -> jax.Array:
    """All-reduce (sum): `{U_axis} -> ` replicated; transpose is broadcast."""
    names = _names(axis)
    if not names:
        return x
    return lax.psum(x, names)


def all_reduce_max(x: jax.Array, axis: AxisNames) -> jax.Array:
    """All-reduce (max). Not differentiable: callers stop the gradient first."""
    names = _names(axis)
    if not names:
        return x
    return lax.pmax(x, names)


def broadcast(x: jax.Array, axis: AxisNames) -> jax.Array:
    """Mark a replicated value as per-device along `axis`: forward moves nothing, the
    backward all-reduces the cotangent over `axis` (Megatron's `f` operator).

    Values that already vary along an axis are left as they are along it."""
    names = tuple(n for n in _names(axis) if n not in varying_axes(x))
    if not names:
        return x
    return lax.pcast(x, names, to="varying")


def zeros_like(x: jax.Array) -> jax.Array:
    """Zeros of x's shape and dtype, varying over the same axes as x (an accumulator
    that x's values can be added into, e.g. a scan carry)."""
    return broadcast(jnp.zeros(x.shape, x.dtype), tuple(varying_axes(x)))


def ring_shift(x: jax.Array, axis: str | None, shift: int = 1) -> jax.Array:
    """Send `x` to the device `shift` steps further along the ring of `axis` (ppermute)."""
    if axis is None:
        return x
    n = lax.axis_size(axis)
    perm = [(i, (i + shift) % n) for i in range(n)]
    return lax.ppermute(x, axis, perm)


def all_to_all(x: jax.Array, axis: str | None, split_dim: int, concat_dim: int) -> jax.Array:
    """All-to-all: `[.., X, .., Y_axis, ..] -> [.., X_axis, .., Y, ..]` (split X, gather Y)."""
    if axis is None:
        return x
    return lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)
