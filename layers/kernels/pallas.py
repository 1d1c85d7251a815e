"""Flash attention as Pallas kernels: forward, dQ and dK/dV, under a custom_vjp.

Shape letters: B batch, L query length, S key length, H query heads, G kv heads,
K head dim, R = H // G query heads per kv head; inside a kernel Q is the rows of
one query tile (block_q) and T the keys of one key tile (block_k).

The wrapper zero-pads L to a multiple of block_q and S to a multiple of block_k
(padded keys are masked, padded query rows sliced off) and transposes to
q_BHLK, k_BGSK, v_BGSK so a tile is a contiguous [rows, K] slab. Kernels:

  forward (L/Q, B, H)  one query tile per program; `lax.fori_loop` over key tiles
                       with online softmax in f32; causal stops at the diagonal
                       tile. Writes o and the log-sum-exp lse_BHL (the residual).
  dq      (L/Q, B, H)  same loop; P = exp(S - lse), dS = P * (dP - delta),
                       dQ += dS K, with delta_BHL = rowsum(dO * O) from the wrapper.
  dkv     (S/T, B, G)  one key tile per program; loops over the R query heads of
                       the group and the query tiles from the diagonal on, summing
                       dK = dS^T Q and dV = P^T dO over the group in f32.

Segment ids (packed documents: `SegmentIds`, non-decreasing along the sequence) come in
as two more inputs, the query tile's ids [Q] and the row's key ids [S]: each tile's mask
also requires equal ids, and the loops skip the tiles no query of the tile can see as
they skip the tiles above the diagonal. Forward and dq start at the first key tile whose
last id reaches the query tile's first id; dkv stops after the last query tile whose
first id is within the key tile's last id.

Every program writes only its own output tile and reads inputs only, so the grid
has no shared state. `interpret=None` runs the kernels in interpret mode when the
default backend is CPU.

GPU (Triton): written for it, untested here (no GPU). Tiles are powers of two
(checked) and K must be one too (pad the head dim otherwise); whole-S K/V and
whole-group Q blocks only fix a base pointer, every load is a [Q or T, K] slice.
TPU (Mosaic) would need: lse / delta stored lane-dense (e.g. [B, H, L, 128]),
since a block's last two dims must be multiples of (8, 128); 2-D iotas
(`lax.broadcasted_iota`) in the masks; the key axis as an "arbitrary" grid
dimension with VMEM scratch for m, l and acc instead of whole-S K/V blocks (which
overflow VMEM at long S), as in jax/experimental/pallas/ops/tpu/flash_attention.py;
and `pltpu.CompilerParams` dimension semantics.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import collectives
from layers.kernels.shared import (MASK_VALUE, BlockSizes, attention_dims, pad_axis, softmax_scale,
                                   tile_mask)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static configuration of one Pallas attention call."""

    causal: bool
    block_q: int  # Q
    block_k: int  # T
    kv_len: int  # keys at positions >= kv_len are padding
    scale: float
    interpret: bool
    segmented: bool = False  # segment ids are two more inputs (module doc)


def _tile_scores(q_QK, k_TK, q_tile, k_tile, plan: _Plan, seg=None):
    """Scaled f32 scores of one (query tile, key tile) pair and its mask [Q, T].
    seg: the tile's segment ids (q [Q], k [T]) or None."""
    s_QT = jnp.einsum("QK,TK->QT", q_QK, k_TK, preferred_element_type=jnp.float32)
    q_pos_Q = q_tile * plan.block_q + jnp.arange(plan.block_q)
    k_pos_T = k_tile * plan.block_k + jnp.arange(plan.block_k)
    mask_QT = tile_mask(q_pos_Q, k_pos_T, causal=plan.causal, kv_len=plan.kv_len)
    if seg is not None:
        mask_QT = mask_QT & (seg[0][:, None] == seg[1][None, :])
    return s_QT * plan.scale, mask_QT


def _key_tiles_from(q_seg_Q, k_seg_S, plan: _Plan):
    """The first key tile a query tile with segment ids q_seg_Q can see: the tiles
    before it end in an earlier document than the tile's first query (ids ascend)."""
    last_ids = k_seg_S[plan.block_k - 1::plan.block_k]
    return jnp.sum(last_ids < q_seg_Q[0]).astype(jnp.int32)


def _key_tile_seg(kseg_ref, j, plan: _Plan):
    """Key tile j's segment ids [T] from the row's ids [S]."""
    return kseg_ref[pl.ds(j * plan.block_k, plan.block_k)]


def _key_tile_bound(q_tile, num_k_tiles: int, plan: _Plan):
    """Key tiles [0, bound) that query tile `q_tile` sees: causal stops at the diagonal."""
    if not plan.causal:
        return num_k_tiles
    last_row = (q_tile + 1) * plan.block_q
    return jnp.minimum(lax.div(last_row + plan.block_k - 1, plan.block_k), num_k_tiles)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, plan: _Plan):
    """q_ref, o_ref [Q, K]; k_ref, v_ref [S, K]; lse_ref [Q]; when segmented, before the
    outputs, qseg_ref [Q] and kseg_ref [S]."""
    qseg_ref, kseg_ref, o_ref, lse_ref = (None, None, *refs) if len(refs) == 2 else refs
    i = pl.program_id(0)
    q_QK = q_ref[...]
    T = plan.block_k
    q_seg_Q = None if qseg_ref is None else qseg_ref[...]

    def body(j, carry):
        m_Q, l_Q, acc_QK = carry
        k_TK = k_ref[pl.ds(j * T, T), :]
        v_TK = v_ref[pl.ds(j * T, T), :]
        seg = None if q_seg_Q is None else (q_seg_Q, _key_tile_seg(kseg_ref, j, plan))
        s_QT, mask_QT = _tile_scores(q_QK, k_TK, i, j, plan, seg)
        s_QT = jnp.where(mask_QT, s_QT, MASK_VALUE)
        m_new_Q = jnp.maximum(m_Q, s_QT.max(axis=-1))
        p_QT = jnp.where(mask_QT, jnp.exp(s_QT - m_new_Q[:, None]), 0.0)
        correction_Q = jnp.exp(m_Q - m_new_Q)
        l_Q = correction_Q * l_Q + p_QT.sum(axis=-1)
        pv_QK = jnp.einsum(
            "QT,TK->QK", p_QT.astype(v_TK.dtype), v_TK, preferred_element_type=jnp.float32
        )
        return m_new_Q, l_Q, correction_Q[:, None] * acc_QK + pv_QK

    Q, K = q_QK.shape
    init = (
        jnp.full((Q,), MASK_VALUE, jnp.float32),
        jnp.zeros((Q,), jnp.float32),
        jnp.zeros((Q, K), jnp.float32),
    )
    bound = _key_tile_bound(i, k_ref.shape[0] // T, plan)
    first = 0 if q_seg_Q is None else _key_tiles_from(q_seg_Q, kseg_ref[...], plan)
    m_Q, l_Q, acc_QK = lax.fori_loop(first, bound, body, init)
    # A row with no visible key has l == 0: it outputs zeros, not 0 / 0.
    l_safe_Q = jnp.where(l_Q == 0.0, 1.0, l_Q)
    o_ref[...] = (acc_QK / l_safe_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m_Q + jnp.log(l_safe_Q)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: _Plan):
    """q_ref, do_ref, dq_ref [Q, K]; k_ref, v_ref [S, K]; lse_ref, delta_ref [Q]; when
    segmented, before dq_ref, qseg_ref [Q] and kseg_ref [S]."""
    qseg_ref, kseg_ref, dq_ref = (None, None, *refs) if len(refs) == 1 else refs
    i = pl.program_id(0)
    q_QK, do_QK = q_ref[...], do_ref[...]
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    T = plan.block_k
    q_seg_Q = None if qseg_ref is None else qseg_ref[...]

    def body(j, dq_QK):
        k_TK = k_ref[pl.ds(j * T, T), :]
        v_TK = v_ref[pl.ds(j * T, T), :]
        seg = None if q_seg_Q is None else (q_seg_Q, _key_tile_seg(kseg_ref, j, plan))
        s_QT, mask_QT = _tile_scores(q_QK, k_TK, i, j, plan, seg)
        p_QT = jnp.where(mask_QT, jnp.exp(s_QT - lse_Q[:, None]), 0.0)
        dp_QT = jnp.einsum("QK,TK->QT", do_QK, v_TK, preferred_element_type=jnp.float32)
        ds_QT = p_QT * (dp_QT - delta_Q[:, None]) * plan.scale
        return dq_QK + jnp.einsum(
            "QT,TK->QK", ds_QT.astype(k_TK.dtype), k_TK, preferred_element_type=jnp.float32
        )

    bound = _key_tile_bound(i, k_ref.shape[0] // T, plan)
    first = 0 if q_seg_Q is None else _key_tiles_from(q_seg_Q, kseg_ref[...], plan)
    dq_QK = lax.fori_loop(first, bound, body, jnp.zeros(q_QK.shape, jnp.float32))
    dq_ref[...] = dq_QK.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: _Plan):
    """q_ref, do_ref [R, L, K]; lse_ref, delta_ref [R, L]; k/v/dk/dv_ref [T, K]; when
    segmented, before dk_ref, qseg_ref [L] (the row's query ids) and kseg_ref [T]."""
    qseg_ref, kseg_ref, dk_ref, dv_ref = (None, None, *refs) if len(refs) == 2 else refs
    j = pl.program_id(0)
    k_TK, v_TK = k_ref[...], v_ref[...]
    R, L, _ = q_ref.shape
    Q = plan.block_q
    first_q_tile = lax.div(j * plan.block_k, Q) if plan.causal else 0
    last_q_tile = L // Q
    if qseg_ref is not None:  # query tiles whose first id is past this tile's last id see nothing
        k_seg_T = kseg_ref[...]
        last_q_tile = jnp.sum(qseg_ref[...][::Q] <= k_seg_T[-1]).astype(jnp.int32)

    def q_tile_body(r, i, carry):
        dk_TK, dv_TK = carry
        rows = pl.ds(i * Q, Q)
        q_QK, do_QK = q_ref[r, rows, :], do_ref[r, rows, :]
        lse_Q, delta_Q = lse_ref[r, rows], delta_ref[r, rows]
        seg = None if qseg_ref is None else (qseg_ref[rows], k_seg_T)
        s_QT, mask_QT = _tile_scores(q_QK, k_TK, i, j, plan, seg)
        p_QT = jnp.where(mask_QT, jnp.exp(s_QT - lse_Q[:, None]), 0.0)
        dv_TK = dv_TK + jnp.einsum(
            "QT,QK->TK", p_QT.astype(do_QK.dtype), do_QK, preferred_element_type=jnp.float32
        )
        dp_QT = jnp.einsum("QK,TK->QT", do_QK, v_TK, preferred_element_type=jnp.float32)
        ds_QT = p_QT * (dp_QT - delta_Q[:, None]) * plan.scale
        dk_TK = dk_TK + jnp.einsum(
            "QT,QK->TK", ds_QT.astype(q_QK.dtype), q_QK, preferred_element_type=jnp.float32
        )
        return dk_TK, dv_TK

    def head_body(r, carry):
        return lax.fori_loop(first_q_tile, last_q_tile, functools.partial(q_tile_body, r), carry)

    zeros_TK = jnp.zeros(k_TK.shape, jnp.float32)
    dk_TK, dv_TK = lax.fori_loop(0, R, head_body, (zeros_TK, zeros_TK))
    dk_ref[...] = dk_TK.astype(dk_ref.dtype)
    dv_ref[...] = dv_TK.astype(dv_ref.dtype)


def _query_tile_spec(plan: _Plan, K: int):
    """Grid (L/Q, B, H): the [Q, K] tile i of query head h (also o, dO, dQ)."""
    return pl.BlockSpec((None, None, plan.block_q, K), lambda i, b, h: (b, h, i, 0))


def _query_row_spec(plan: _Plan):
    """Grid (L/Q, B, H): the [Q] rows of tile i of head h (lse, delta)."""
    return pl.BlockSpec((None, None, plan.block_q), lambda i, b, h: (b, h, i))


def _whole_kv_spec(S: int, K: int, group: int):
    """Grid (L/Q, B, H): all [S, K] keys (or values) of kv head h // R."""
    return pl.BlockSpec((None, None, S, K), lambda i, b, h: (b, h // group, 0, 0))


def _query_seg_specs(plan: _Plan, S: int):
    """Grid (L/Q, B, H): the segment ids of query tile i [Q] and of all keys [S] of row b."""
    return [pl.BlockSpec((None, plan.block_q), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, S), lambda i, b, h: (b, 0))]


def _forward(q_BHLK, k_BGSK, v_BGSK, *seg, plan: _Plan):
    """Runs the forward kernel: o_BHLK (q's dtype) and lse_BHL (f32). seg: () or the
    segment ids (q_seg_BL, k_seg_BS)."""
    B, H, L, K = q_BHLK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    tile_spec, row_spec = _query_tile_spec(plan, K), _query_row_spec(plan)
    kv_spec = _whole_kv_spec(S, K, H // G)
    seg_specs = _query_seg_specs(plan, S) if seg else []
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan),
        grid=(L // plan.block_q, B, H),
        in_specs=[tile_spec, kv_spec, kv_spec, *seg_specs],
        out_specs=[tile_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q_BHLK.shape, q_BHLK.dtype),
            jax.ShapeDtypeStruct((B, H, L), jnp.float32),
        ],
        interpret=plan.interpret,
        name="flash_forward",
    )(q_BHLK, k_BGSK, v_BGSK, *seg)


def _dq(q_BHLK, k_BGSK, v_BGSK, do_BHLK, lse_BHL, delta_BHL, seg, plan: _Plan):
    """Runs the dQ kernel: dq_BHLK in q's dtype."""
    B, H, L, K = q_BHLK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    tile_spec, row_spec = _query_tile_spec(plan, K), _query_row_spec(plan)
    kv_spec = _whole_kv_spec(S, K, H // G)
    seg_specs = _query_seg_specs(plan, S) if seg else []
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(L // plan.block_q, B, H),
        in_specs=[tile_spec, kv_spec, kv_spec, tile_spec, row_spec, row_spec, *seg_specs],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(q_BHLK.shape, q_BHLK.dtype),
        interpret=plan.interpret,
        name="flash_dq",
    )(q_BHLK, k_BGSK, v_BGSK, do_BHLK, lse_BHL, delta_BHL, *seg)


def _dkv(q_BHLK, k_BGSK, v_BGSK, do_BHLK, lse_BHL, delta_BHL, seg, plan: _Plan):
    """Runs the dK/dV kernel on grid (S/T, B, G): dk_BGSK, dv_BGSK."""
    B, H, L, K = q_BHLK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    R, T = H // G, plan.block_k
    group_spec = pl.BlockSpec((None, None, R, L, K), lambda j, b, g: (b, g, 0, 0, 0))
    group_row_spec = pl.BlockSpec((None, None, R, L), lambda j, b, g: (b, g, 0, 0))
    key_tile_spec = pl.BlockSpec((None, None, T, K), lambda j, b, g: (b, g, j, 0))
    by_group = lambda x: x.reshape(B, G, R, *x.shape[2:])
    seg_specs = [pl.BlockSpec((None, L), lambda j, b, g: (b, 0)),
                 pl.BlockSpec((None, T), lambda j, b, g: (b, j))] if seg else []
    return pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(S // T, B, G),
        in_specs=[
            group_spec, key_tile_spec, key_tile_spec, group_spec, group_row_spec, group_row_spec,
            *seg_specs
        ],
        out_specs=[key_tile_spec, key_tile_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_BGSK.shape, k_BGSK.dtype),
            jax.ShapeDtypeStruct(v_BGSK.shape, v_BGSK.dtype),
        ],
        interpret=plan.interpret,
        name="flash_dkv",
    )(by_group(q_BHLK), k_BGSK, v_BGSK, by_group(do_BHLK), by_group(lse_BHL), by_group(delta_BHL),
      *seg)


def _backward(plan: _Plan, residuals, do_BHLK):
    """delta = rowsum(dO * O), then the dQ and dK/dV kernels. residuals: q, k, v, o,
    lse and the segment ids, if any."""
    q_BHLK, k_BGSK, v_BGSK, o_BHLK, lse_BHL, *seg = residuals
    f32 = jnp.float32
    delta_BHL = jnp.einsum("BHLK,BHLK->BHL", do_BHLK.astype(f32), o_BHLK.astype(f32))
    args = (q_BHLK, k_BGSK, v_BGSK, do_BHLK, lse_BHL, delta_BHL, tuple(seg))
    dq_BHLK = _dq(*args, plan)
    dk_BGSK, dv_BGSK = _dkv(*args, plan)
    return dq_BHLK, dk_BGSK, dv_BGSK


def _drop_vma(x):
    """x as a value whose type names no varying axes.

    Values passed into a nested shard_map keep the outer varying axes even with the check
    off, while values computed by standard primitives there get none; interpret mode's
    loops would then mix the two. An add of zero is such a primitive (one elementwise
    pass, nothing next to the O(L^2) kernel)."""
    return x + jnp.zeros((), x.dtype)


def _unchecked(f, out_vma):
    """f with shard_map's varying-axes check off, when called inside a shard_map.

    Interpret mode runs each kernel as while loops whose carries fail the vma check, so
    the kernels run in a nested `shard_map(check_vma=False)` over no new axes (pure
    per-device code: nothing is communicated) and each output is re-marked as varying
    over the axes `out_vma(args)` gives for it. Only kernel launches sit
    in here, inside the custom_vjp rules, so autodiff never crosses the unchecked region
    and the rest of the step keeps `check_vma=True` (which keeps FSDP grads a single
    reduce-scatter)."""

    def run(*args):
        if not jax.sharding.get_abstract_mesh().manual_axes:
            return f(*args)
        out = jax.shard_map(lambda *a: f(*map(_drop_vma, a)), in_specs=P(), out_specs=P(),
                            axis_names=frozenset(), check_vma=False)(*args)
        return tuple(collectives.broadcast(o, tuple(axes)) for o, axes in zip(out, out_vma(args)))

    return run


@functools.cache
def _flash(plan: _Plan):
    """The differentiable kernel pair for one static plan: (q_BHLK, k, v) -> o_BHLK, or
    when segmented (q_BHLK, k, v, q_seg_BL, k_seg_BS) -> o_BHLK (the ids int32, taking no
    cotangent)."""
    vma = collectives.varying_axes
    # o and lse vary wherever q, k, v (or the ids) do; dq, dk, dv exactly where q, k, v do.
    forward = _unchecked(functools.partial(_forward, plan=plan),
                         lambda args: [frozenset().union(*map(vma, args))] * 2)
    backward = _unchecked(lambda *args: _backward(plan, args[:-1], args[-1]),
                          lambda args: [vma(a) for a in args[:3]])

    @jax.custom_vjp
    def flash(q_BHLK, k_BGSK, v_BGSK, *seg):
        return forward(q_BHLK, k_BGSK, v_BGSK, *seg)[0]

    def flash_fwd(q_BHLK, k_BGSK, v_BGSK, *seg):
        o_BHLK, lse_BHL = forward(q_BHLK, k_BGSK, v_BGSK, *seg)
        return o_BHLK, (q_BHLK, k_BGSK, v_BGSK, o_BHLK, lse_BHL, *seg)

    def flash_bwd(residuals, do_BHLK):
        grads = backward(*residuals, do_BHLK)
        return (*grads, *(None,) * (len(residuals) - 5))

    flash.defvjp(flash_fwd, flash_bwd)
    return flash


def _tile_size(block: int, length: int, name: str) -> int:
    """A power-of-two tile no longer than the (power-of-two rounded) sequence."""
    if block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two (GPU tiles)")
    return min(block, pl.next_power_of_2(length))


def pallas_attention(
    q_BLHK,
    k_BSGK,
    v_BSGK,
    *,
    causal: bool = True,
    axes=None,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    segment_ids=None,
):
    """Softmax(q k^T / sqrt(K)) v with Pallas flash kernels, forward and backward.

    q_BLHK [B, L, H, K]; k_BSGK, v_BSGK [B, S, G, K] with H a multiple of G.
    Causal needs L == S (query i attends keys <= i). Block sizes must be powers
    of two; L and S are zero-padded to multiples of them (padded keys masked).
    interpret=None means interpret mode exactly when the default backend is CPU.
    segment_ids (`SegmentIds`, ids non-decreasing along the sequence): a query sees only
    keys of its own document, and tiles no query of the tile sees are skipped.
    Returns o_BLHK in q's dtype; accumulation is f32. axes: unused (nothing is
    communicated; the nested shard_map below spans no axes).
    """
    dims = attention_dims(q_BLHK, k_BSGK, v_BSGK, causal=causal)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    plan = _Plan(
        causal=causal,
        block_q=_tile_size(blocks.block_q, dims.q_len, "block_q"),
        block_k=_tile_size(blocks.block_k, dims.kv_len, "block_k"),
        kv_len=dims.kv_len,
        scale=softmax_scale(dims.head_dim),
        interpret=interpret,
        segmented=segment_ids is not None,
    )
    # padded queries and keys repeat the last id, so the ids still ascend
    pad_ids = lambda x, block: jnp.pad(jnp.asarray(x, jnp.int32),
                                       ((0, 0), (0, -x.shape[1] % block)), mode="edge")
    seg = () if segment_ids is None else (pad_ids(segment_ids.q_BL, plan.block_q),
                                          pad_ids(segment_ids.kv_BS, plan.block_k))
    to_heads_major = lambda x, block: pad_axis(x, 1, block).transpose(0, 2, 1, 3)
    o_BHLK = _flash(plan)(
        to_heads_major(q_BLHK, plan.block_q),
        to_heads_major(k_BSGK, plan.block_k),
        to_heads_major(v_BSGK, plan.block_k),
        *seg,
    )
    return o_BHLK.transpose(0, 2, 1, 3)[:, : dims.q_len]
