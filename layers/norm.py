"""RMSNorm, and the SwiGLU product: elementwise steps whose backward recomputes them from
their inputs instead of keeping f32 intermediates."""
import functools

import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x_BLD: jax.Array, scale_D: jax.Array, eps: float = 1e-5) -> jax.Array:
    """`x / rms(x) * scale` over D, computed in f32, returned in x's dtype.
    [B, L, D] -> [B, L, D].

    The backward keeps only x (in its own dtype) and the scale and recomputes the rest:
    differentiated as written it would keep x upcast to f32 and the normalized x (two
    f32 copies of the stream per norm) from the forward to the backward."""
    return _rms_norm(x_BLD, scale_D, eps)


@functools.partial(jax.checkpoint, static_argnums=2)
def _rms_norm(x_BLD, scale_D, eps):
    dtype = x_BLD.dtype
    x_BLD = x_BLD.astype(jnp.float32)
    ms_BL1 = jnp.mean(jnp.square(x_BLD), axis=-1, keepdims=True)
    return (x_BLD * lax.rsqrt(ms_BL1 + eps) * scale_D.astype(jnp.float32)).astype(dtype)


@jax.checkpoint
def swiglu(g_BLF: jax.Array, u_BLF: jax.Array) -> jax.Array:
    """silu(g) * u, [..., F] -> [..., F] in g's dtype. The backward keeps g and u and
    recomputes sigmoid(g) and silu(g) (autodiff as written would keep both as well)."""
    return jax.nn.silu(g_BLF) * u_BLF
