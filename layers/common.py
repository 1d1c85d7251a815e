"""Matmul in a compute dtype with f32 accumulation."""
import jax
import jax.numpy as jnp


def einsum(eq: str, *operands: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`jnp.einsum` with operands cast to `dtype` and an f32 result.

    bf16 x bf16 with `preferred_element_type=f32` is the fast native path on CPUs with
    AVX-512-bf16 and on accelerators; a plain bf16 result would round each product sum.
    """
    return jnp.einsum(eq, *(x.astype(dtype) for x in operands), preferred_element_type=jnp.float32)
