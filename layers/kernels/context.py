"""Context-parallel attention: queries of this cp rank's two load-balanced chunks
(layers/context.py) against the keys of the whole sequence.

Shape letters as in layers/kernels/shared.py; L_cp = 2c local tokens, c per chunk,
S = cp · L_cp the whole sequence.

    allgather  all-gather K and V over cp (G kv heads only: small under GQA), put them
               in position order, and attend each local query chunk with a causal mask
               at its global positions. Under check_vma the gather's transpose is a
               reduce-scatter, so the backward reduce-scatters dK and dV over cp.

`CP_COMMS` is the registry `--cp-comm` names; `CP_KERNELS` the local kernels that take
global query and key offsets (the only ones a cp rank's chunks can use).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import collectives
from layers.context import chunk_ids, natural_order
from layers.kernels.reference import reference_attention

CP_KERNELS = {"reference": reference_attention}


def allgather_attention(q_BLHK, k_BLGK, v_BLGK, *, axes, kernel: str = "reference"):
    """q [B, L_cp, H, K], k, v [B, L_cp, G, K] (this rank's chunks i and 2cp−1−i) ->
    o [B, L_cp, H, K] in q's dtype: causal attention at global positions over the keys
    all-gathered from every cp rank."""
    attend = CP_KERNELS[kernel]
    k_BSGK, v_BSGK = (natural_order(collectives.gather(x, axes.cp, dim=1), axes.cp_size)
                      for x in (k_BLGK, v_BLGK))
    c = q_BLHK.shape[1] // 2
    outs = [attend(q_BLHK[:, j * c:(j + 1) * c], k_BSGK, v_BSGK, causal=True, q_offset=m * c,
                   k_offset=0)
            for j, m in enumerate(chunk_ids(axes))]
    return jnp.concatenate(outs, axis=1)


CP_COMMS = {"allgather": allgather_attention}
