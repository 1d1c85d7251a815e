"""Rotary position embedding (rotate-half form, as in LLaMA's HF port)."""
import jax
import jax.numpy as jnp


def rope(x_BLHK: jax.Array, offset: int | jax.Array = 0, theta: float = 10_000.0) -> jax.Array:
    """Rotate pairs (k, k + K/2) of each head by angle pos / theta^(2k/K).

    x: [B, L, H, K] with positions offset + [0, L). Returns [B, L, H, K] in x's dtype.
    """
    pos_L = offset + jnp.arange(x_BLHK.shape[1], dtype=jnp.float32)
    return rope_at(x_BLHK, pos_L, theta)


def rope_at(x_BLHK: jax.Array, pos_L: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """RoPE with token l at global position pos_L[l] (any order: a context-parallel
    rank's load-balanced chunks). x: [B, L, H, K], pos: [L] -> [B, L, H, K]."""
    K = x_BLHK.shape[3]
    freq_k = theta ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * 2.0 / K)
    angle_Lk = pos_L.astype(jnp.float32)[:, None] * freq_k[None, :]
    cos_L1k, sin_L1k = jnp.cos(angle_Lk)[:, None, :], jnp.sin(angle_Lk)[:, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_L1k - x2 * sin_L1k, x2 * cos_L1k + x1 * sin_L1k], axis=-1)
    return out.astype(x_BLHK.dtype)


def rope_rows(x_BLHK: jax.Array, start_B: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """RoPE with row b's tokens at positions start_B[b] + [0, L). [B, L, H, K] -> same."""
    return jax.vmap(lambda x_LHK, s: rope(x_LHK[None], s, theta)[0])(x_BLHK, start_B)
