"""Document masking of packed sequences: every attention kernel with segment ids equals
the dense reference with them, and a packed row of three documents gives, per token,
the loss and gradients of the three documents run as separate rows (single and cp, tp,
pp layouts).

f32 throughout. Kernels: online softmax reorders the reference's sums (as in
test_flash.py, errors ~1e-6 of the largest entry), so 1e-5 relative to max|reference|.
Packed vs separate rows: the same math on the same tokens, except that without
`document_positions` a document's RoPE angles are its separate row's plus a constant
offset (relative positions agree; cos/sin of the larger angles round differently, ~1e-7
relative), and sharded runs reorder sums as in test_step.py: 1e-5 relative.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.kernels import (BlockSizes, blocked_attention, chunked_attention, pallas_attention,
                            reference_attention)
from layers.kernels.shared import SegmentIds

TOL = 1e-5
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def close(got, want, tol=TOL, what=""):
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    bound = tol * float(np.max(np.abs(np.asarray(want, np.float32))))
    assert err <= bound, f"{what}: error {err:.2e} > {bound:.2e}"


def ids_of(doc_lengths_B, L):
    """Segment ids [B, L] of rows packed with documents of the given lengths (the last
    one runs to the end of the row)."""
    rows = []
    for lengths in doc_lengths_B:
        ends = np.cumsum(lengths)
        rows.append(np.searchsorted(ends, np.arange(L), side="right"))
    return jnp.asarray(np.array(rows), jnp.int32)


# row 0: three documents, one crossing every tile edge; row 1: one short document first
SEG_LENGTHS = [[5, 19, 9], [3, 40]]


def qkv(B, L, H, G, K, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, L, H, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, L, G, K), jnp.float32)
    v = jax.random.normal(ks[2], (B, L, G, K), jnp.float32)
    do = jax.random.normal(ks[3], (B, L, H, K), jnp.float32)
    return q, k, v, do


def value_and_grads(attend, q, k, v, do):
    o, vjp = jax.vjp(attend, q, k, v)
    return (o, *vjp(do))


KERNEL_CASES = {
    "chunked": lambda q, k, v, seg: chunked_attention(q, k, v, segment_ids=seg,
                                                      blocks=BlockSizes(block_q=8)),
    "blocked": lambda q, k, v, seg: blocked_attention(q, k, v, segment_ids=seg,
                                                      blocks=BlockSizes(block_k=8)),
    "pallas": lambda q, k, v, seg: pallas_attention(q, k, v, segment_ids=seg, interpret=True,
                                                    blocks=BlockSizes(block_q=8, block_k=8)),
}


@pytest.mark.parametrize("kernel", sorted(KERNEL_CASES))
def test_kernel_with_segments_matches_reference(kernel):
    """Output and dQ, dK, dV with segment ids equal the dense reference's; L = 33 is not
    a multiple of the tiles (padded keys and queries), tiles of 8 so whole tiles lie
    before a document's start (the skipped ones)."""
    B, L, H, G, K = 2, 33, 4, 2, 8
    q, k, v, do = qkv(B, L, H, G, K)
    ids = ids_of(SEG_LENGTHS, L)
    seg = SegmentIds(ids, ids)
    want = value_and_grads(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg),
                           q, k, v, do)
    attend = KERNEL_CASES[kernel]
    got = jax.jit(lambda q, k, v, do: value_and_grads(
        lambda q, k, v: attend(q, k, v, seg), q, k, v, do)).lower(q, k, v, do).compile(
            FAST_COMPILE)(q, k, v, do)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        close(g, w, what=f"{kernel} {name}")
    # the mask matters here: without it the reference differs by far more than TOL
    plain = reference_attention(q, k, v)
    assert float(jnp.max(jnp.abs(plain - want[0]))) > 100 * TOL * float(jnp.max(jnp.abs(want[0])))


def test_reference_segments_equal_separate_rows():
    """The reference with segment ids: each document's outputs are those of the
    document attended alone (a plain causal call on its slice)."""
    B, L, H, G, K = 1, 24, 4, 2, 8
    q, k, v, _ = qkv(B, L, H, G, K, seed=1)
    lengths = [7, 10, 7]
    ids = ids_of([lengths], L)
    o = reference_attention(q, k, v, segment_ids=SegmentIds(ids, ids))
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        close(o[:, sl], reference_attention(q[:, sl], k[:, sl], v[:, sl]), what=f"doc at {start}")
        start += n
