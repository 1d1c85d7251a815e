"""RMSNorm."""
import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x_BLD: jax.Array, scale_D: jax.Array, eps: float = 1e-5) -> jax.Array:
    """`x / rms(x) * scale` over D, computed in f32. [B, L, D] -> [B, L, D]."""
    x_BLD = x_BLD.astype(jnp.float32)
    ms_BL1 = jnp.mean(jnp.square(x_BLD), axis=-1, keepdims=True)
    return x_BLD * lax.rsqrt(ms_BL1 + eps) * scale_D.astype(jnp.float32)
