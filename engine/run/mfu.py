"""Model FLOPs per token and the peak the MFU is measured against."""
from __future__ import annotations

import time

from engine.parallel.params import param_count
from layers.config import ModelConfig

# Dense bf16 peak per chip, FLOP/s, from the vendors' spec sheets.
PEAK_BF16 = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
             "A100": 312e12, "H100": 989e12}


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per non-embedding param (the unembedding is a matmul,
    the embedding a lookup) plus 12·N·H·K·L for attention scores and values (PaLM,
    Chowdhery et al. 2022, appendix B; nanoGPT's `estimate_mfu`). Remat is not counted:
    MFU is model FLOPs, not hardware FLOPs. A mixture of experts counts the params one
    token uses (top_k experts, not E; no padding)."""
    return (6 * param_count(cfg, include_embed=False, active=True)
            + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq)


def measured_matmul_peak(dtype, n: int = 2048, reps: int = 3) -> float:
    """Best FLOP/s of an n³ matmul in `dtype` (f32 accumulation) on the first device.

    On a CPU this is the machine's peak: forced host devices share its cores."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(dtype, devices) -> tuple[float, str]:
    """(peak FLOP/s of the devices used, where the figure comes from)."""
    kind = devices[0].device_kind
    for name, flops in PEAK_BF16.items():
        if name.lower() in kind.lower():
            return flops * len(devices), f"{len(devices)} x {name} spec"
    if devices[0].platform == "cpu":
        return measured_matmul_peak(dtype), "measured matmul on this CPU"
    return measured_matmul_peak(dtype) * len(devices), f"measured matmul on one {kind}"
