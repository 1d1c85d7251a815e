"""Rotary position embedding (rotate-half form, as in LLaMA's HF port)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Rope(NamedTuple):
    """RoPE's frequencies: base `theta`, and with `factor` > 0 Llama 3's scaling (HF
    `rope_type: llama3`): wavelengths longer than original_max / low_freq_factor are
    divided by `factor`, those shorter than original_max / high_freq_factor are kept,
    and those between are interpolated smoothly between the two."""

    theta: float = 10_000.0
    factor: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max: int = 8192


def frequencies(K: int, theta: float | Rope) -> jax.Array:
    """The K/2 inverse wavelengths [K/2] (f32) of head dim K: theta^(-2k/K), scaled."""
    r = theta if isinstance(theta, Rope) else Rope(float(theta))
    freq_k = r.theta ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * 2.0 / K)
    if r.factor <= 0:
        return freq_k
    wavelen_k = 2 * math.pi / freq_k
    smooth_k = (r.original_max / wavelen_k - r.low_freq_factor) / (
        r.high_freq_factor - r.low_freq_factor)
    scaled_k = jnp.where(wavelen_k > r.original_max / r.low_freq_factor,
                         freq_k / r.factor, freq_k)
    medium_k = ((wavelen_k >= r.original_max / r.high_freq_factor)
                & (wavelen_k <= r.original_max / r.low_freq_factor))
    return jnp.where(medium_k, (1 - smooth_k) * scaled_k / r.factor + smooth_k * scaled_k,
                     scaled_k)


def rope(x_BLHK: jax.Array, offset: int | jax.Array = 0,
         theta: float | Rope = 10_000.0) -> jax.Array:
    """Rotate pairs (k, k + K/2) of each head by angle pos / theta^(2k/K).

    x: [B, L, H, K] with positions offset + [0, L). Returns [B, L, H, K] in x's dtype.
    """
    pos_L = offset + jnp.arange(x_BLHK.shape[1], dtype=jnp.float32)
    return rope_at(x_BLHK, pos_L, theta)


def rope_at(x_BLHK: jax.Array, pos_L: jax.Array,
            theta: float | Rope = 10_000.0) -> jax.Array:
    """RoPE with token l at global position pos_L[l] (any order: a context-parallel
    rank's load-balanced chunks). x: [B, L, H, K], pos: [L] -> [B, L, H, K]."""
    K = x_BLHK.shape[3]
    freq_k = frequencies(K, theta)
    angle_Lk = pos_L.astype(jnp.float32)[:, None] * freq_k[None, :]
    cos_L1k, sin_L1k = jnp.cos(angle_Lk)[:, None, :], jnp.sin(angle_Lk)[:, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_L1k - x2 * sin_L1k, x2 * cos_L1k + x1 * sin_L1k], axis=-1)
    return out.astype(x_BLHK.dtype)


def rope_rows(x_BLHK: jax.Array, start_B: jax.Array,
              theta: float | Rope = 10_000.0) -> jax.Array:
    """RoPE with row b's tokens at positions start_B[b] + [0, L). [B, L, H, K] -> same."""
    return jax.vmap(lambda x_LHK, s: rope(x_LHK[None], s, theta)[0])(x_BLHK, start_B)
