"""Matmul in a compute dtype with f32 accumulation, forward and backward."""
import functools

import jax
import jax.numpy as jnp


def einsum(eq: str, x: jax.Array, w: jax.Array, dtype=jnp.float32,
           out=jnp.float32) -> jax.Array:
    """`jnp.einsum(eq, x, w)` with both operands cast to `dtype`, accumulated in f32 and
    returned in `out` (the activation dtype: f32, or bf16 to halve what the activations
    hold; the cast follows the f32 accumulation, so the sum is rounded once).

    bf16 x bf16 with `preferred_element_type=f32` is the fast native path on CPUs with
    AVX-512-bf16 and on accelerators; a plain bf16 result would round each product sum.
    In a low-precision `dtype` the backward stays on that path too: plain autodiff would
    multiply the f32 cotangent by a bf16 operand, which XLA runs as an f32 x f32 matmul
    (half the speed on such CPUs). Here the cotangent is cast to `dtype`, both backward
    matmuls accumulate in f32, and each operand's grad comes back in its own dtype,
    unrounded. Every index of `x` and of `w` must appear in the other operand or the
    output (a contraction, no reduction of one operand alone)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(eq, x.astype(dtype), w.astype(dtype),
                          preferred_element_type=jnp.float32).astype(out)
    return _lowp_einsum(eq, jnp.dtype(dtype), jnp.dtype(out))(x, w)


@functools.cache
def _lowp_einsum(eq: str, dtype, out_dtype):
    """custom_vjp (x, w) -> `eq` in `out_dtype` (f32 accumulation) with operands and
    cotangent in `dtype`."""
    ins, out = eq.split("->")
    x_sub, w_sub = ins.split(",")
    for sub, other in ((x_sub, w_sub + out), (w_sub, x_sub + out)):
        if set(sub) - set(other):
            raise ValueError(f"einsum {eq!r}: indices {set(sub) - set(other)} appear in one "
                             "operand only")

    def dot(spec, a_lp, b_lp, out=jnp.float32):  # both operands already in `dtype`
        return jnp.einsum(spec, a_lp, b_lp, preferred_element_type=out)

    def fwd(x, w):
        x_lp, w_lp = x.astype(dtype), w.astype(dtype)
        # the residuals carry the operands' dtypes as zero-size arrays (dtypes are not
        # pytree leaves), so each grad is returned in its operand's dtype
        tags = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
        # the product is formed in `out_dtype` by the dot itself (f32 accumulation in the
        # MXU / tensor cores; XLA:CPU computes it in f32 and rounds once), so what a
        # remat policy saves as the dot's output is the activation, not an f32 copy
        return dot(eq, x_lp, w_lp, out_dtype), (x_lp, w_lp, tags)

    def bwd(res, ct):
        x_lp, w_lp, (x_tag, w_tag) = res
        ct_lp = ct.astype(dtype)
        dx = dot(f"{out},{w_sub}->{x_sub}", ct_lp, w_lp)
        # the operand holding w's leading index goes first, so the dot's product comes
        # out in w's order with no transpose after it (XLA would fold one into the dot
        # and transpose the other operand instead)
        dw = dot(f"{x_sub},{out}->{w_sub}", x_lp, ct_lp) if w_sub[0] in x_sub else \
            dot(f"{out},{x_sub}->{w_sub}", ct_lp, x_lp)
        return dx.astype(x_tag.dtype), dw.astype(w_tag.dtype)

    f = jax.custom_vjp(lambda x, w: fwd(x, w)[0])
    f.defvjp(fwd, bwd)
    return f
