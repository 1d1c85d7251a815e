"""Megatron SwiGLU MLP per shard: gate/up column-parallel, down row-parallel over tp."""
import jax
from jax.ad_checkpoint import checkpoint_name

import collectives
from layers import scopes
from layers.axes import Axes
from layers.common import einsum
from layers.config import ModelConfig
from layers.norm import swiglu


def mlp(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """x: [B, L, D] replicated over tp -> [B, L, D] replicated over tp (axes.tp_comm
    allreduce); x: [B, L_tp, D] -> [B, L_tp, D] (sequence, ring).

    p (gathered over fsdp): wg, wu, wd [D, F_tp]. wd is stored [D, F] like wg and wu, so
    its weight grad `BLD,BLF->DF` reads the cotangent transposed, not h: on XLA:CPU the
    transposed operand of a dot is copied into its layout, and under remat the copy of
    h would carry h's recompute (silu, an exp per element) in an unvectorized loop, and
    the [F, D] grad would be copied once more into fsdp's [D, F] reduce-scatter layout.
    """
    dt, at = cfg.compute_dtype, cfg.act_dtype
    gate_up = lambda x_BLD: (einsum("BLD,DF->BLF", x_BLD, p["wg"], dtype=dt, out=at),
                             einsum("BLD,DF->BLF", x_BLD, p["wu"], dtype=dt, out=at))
    down = lambda h_BLF: einsum("BLF,DF->BLD", h_BLF, p["wd"], dtype=dt, out=at)  # {U_tp}
    # allreduce: broadcast (bwd all-reduce dx); sequence: all-gather along L (bwd
    # reduce-scatter dx); ring: the gather as ppermutes interleaved with the matmuls
    g_BLF, u_BLF = collectives.column_parallel(x_BLD, gate_up, axes.tp, dim=1,
                                               comm=axes.tp_comm)
    h_BLF = swiglu(checkpoint_name(g_BLF, scopes.GATE), checkpoint_name(u_BLF, scopes.UP))
    # all-reduce (allreduce), reduce-scatter along L (sequence), or its ring (ring)
    return collectives.row_parallel(h_BLF, down, axes.tp, dim=1, comm=axes.tp_comm)
