"""The pipeline's stage shift: a stage's output x [B, L, D] (forward) or its input
cotangent (backward) sent one stage along the pp ring.

Under Megatron TP with `--tp-comm allreduce` the value is replicated over tp: every tp
rank of a stage holds the same x. Sending it whole from each of them puts tp identical
copies on the links between stages. Instead each tp rank sends its own 1/tp slice along
the sequence dim L (D where tp does not divide L; B where it divides neither), and the
receiving stage all-gathers the slices over tp: Megatron-LM's scatter/gather
(Narayanan et al. 2021, section 4.1). The pp link carries 1/tp of the bytes; the rest
moves over tp, the fast link within a node. Under sequence parallel (`sequence`, `ring`)
x is already split over tp along L and is sent as it is.

    stage_shift(v [B, L, D], pp, +1, tp)    # v replicated over tp
        = slice over tp    [B, L, D]   -> [B, L_tp, D]   (this rank's 1/tp: no data moves)
        ring_shift over pp [B, L_tp, D] -> [B, L_tp, D]  (ppermute)
        gather over tp     [B, L_tp, D] -> [B, L, D]     (all-gather, replicated again)

The slice varies over tp (it is cut at `axis_index(tp)`); the all-gather returns a value
typed invariant over tp again (`gather(..., replicated=True)`: `all_gather_invariant`),
as the pipeline's buffers hold it. The shift is not differentiated (the pipeline runs
its units' vjps itself), so the gather's transpose never runs.
"""
from __future__ import annotations

import jax
from jax import lax

import collectives

SPLIT_DIMS = (1, 2, 0)  # the dims a replicated value is cut along, first choice first: L, D, B


def split_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dim of a [B, L, D] value that `n` tp ranks cut it along (`SPLIT_DIMS`: the
    first that n divides), None when n <= 1 or n divides none (then it is sent whole)."""
    if n <= 1:
        return None
    return next((d for d in SPLIT_DIMS if shape[d] % n == 0), None)


def stage_shift(v_BLD: jax.Array, pp: str, direction: int, tp: str | None = None) -> jax.Array:
    """`v` [B, L, D] sent `direction` stages along the pp ring (+1: to the next stage).

    tp: an axis `v` is replicated over (the same value on each of its ranks), whose
    ranks then each send 1/tp of it and gather the slices on arrival (module doc); None
    sends it whole from every device."""
    n = collectives.axis_size(tp)
    dim = split_dim(v_BLD.shape, n)
    if dim is None:
        return collectives.ring_shift(v_BLD, pp, direction)  # ppermute over pp
    size = v_BLD.shape[dim] // n
    part = lax.dynamic_slice_in_dim(v_BLD, collectives.axis_index(tp) * size, size, dim)
    part = collectives.ring_shift(part, pp, direction)  # ppermute over pp, 1/tp the bytes
    return collectives.gather(part, tp, dim, replicated=True)  # all-gather over tp
