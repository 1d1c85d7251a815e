"""Megatron SwiGLU MLP per shard: gate/up column-parallel, down row-parallel over tp."""
import jax

import collectives
from layers.axes import Axes
from layers.common import einsum
from layers.config import ModelConfig


def mlp(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes) -> jax.Array:
    """x: [B, L, D] replicated over tp -> [B, L, D] replicated over tp.

    p (gathered over fsdp): wg, wu [D, F_tp], wd [F_tp, D].
    """
    dt = cfg.compute_dtype
    x_BLD = collectives.broadcast(x_BLD, axes.tp)  # bwd: all-reduce dx over tp
    g_BLF = einsum("BLD,DF->BLF", x_BLD, p["wg"], dtype=dt)
    u_BLF = einsum("BLD,DF->BLF", x_BLD, p["wu"], dtype=dt)
    h_BLF = jax.nn.silu(g_BLF) * u_BLF
    y_BLD = einsum("BLF,FD->BLD", h_BLF, p["wd"], dtype=dt)  # [B, L, D]{U_tp}
    return collectives.all_reduce(y_BLD, axes.tp)
