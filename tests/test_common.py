"""layers.common.einsum: the bf16 custom VJP against plain autodiff of the same math.

The reference rounds what the custom rule rounds (operands and cotangent to bf16) and
then computes in f32, so both sides multiply the same bf16 values exactly and differ
only in f32 accumulation order: 1e-5 relative to the largest magnitude is ~100 ulps of
f32, far below one bf16 step (4e-3), so a rule that rounded a result to bf16, dropped a
term or swapped operands would fail."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from layers.common import einsum

bf16, f32 = jnp.bfloat16, jnp.float32
RTOL = 1e-5
CASES = [  # (eq, x shape, w shape), the contractions the layers use
    ("BLD,DF->BLF", (2, 8, 16), (16, 24)),
    ("BLF,FD->BLD", (2, 8, 24), (24, 16)),
    ("BLD,DHK->BLHK", (2, 8, 16), (16, 4, 6)),
    ("BLHK,HKD->BLD", (2, 8, 4, 6), (4, 6, 16)),
    ("BD,DV->BV", (3, 16), (16, 32)),
]


def rounded(x):
    """x's bf16 value in f32, with an identity gradient (a plain round trip through bf16
    would round the cotangent too)."""
    return x + jax.lax.stop_gradient(x.astype(bf16).astype(f32) - x)


def close(got, want, what):
    err, bound = float(jnp.max(jnp.abs(got - want))), RTOL * float(jnp.max(jnp.abs(want)))
    assert err <= bound, f"{what}: error {err:.2e} > {bound:.2e}"


def operands(xs, ws, seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kx, xs, f32), jax.random.normal(kw, ws, f32), kc)


@pytest.mark.parametrize("eq,xs,ws", CASES)
def test_bf16_einsum_value_and_grads(eq, xs, ws):
    x, w, kc = operands(xs, ws)
    y = jax.jit(lambda x, w: einsum(eq, x, w, dtype=bf16))(x, w)
    ref = lambda x, w: jnp.einsum(eq, rounded(x), rounded(w), precision="highest")
    assert y.dtype == f32
    close(y, ref(x, w), f"{eq} value")
    ct = jax.random.normal(kc, y.shape, f32)
    _, vjp = jax.vjp(lambda x, w: einsum(eq, x, w, dtype=bf16), x, w)
    _, vjp_ref = jax.vjp(ref, x, w)
    for got, want, name in zip(jax.jit(vjp)(ct), vjp_ref(rounded(ct)), "xw"):
        assert got.dtype == f32, f"{eq} d{name} dtype {got.dtype}"
        close(got, want, f"{eq} d{name}")


def test_grads_keep_each_operands_dtype():
    """A bf16 operand gets a bf16 grad and an f32 one an f32 grad, as autodiff gives."""
    x, w, _ = operands((2, 8, 16), (16, 24))
    dx, dw = jax.grad(lambda x, w: jnp.sum(einsum("BLD,DF->BLF", x, w, dtype=bf16)),
                      (0, 1))(x.astype(bf16), w)
    assert (dx.dtype, dw.dtype) == (bf16, f32)


def test_f32_is_plain_einsum():
    x, w, _ = operands((2, 8, 16), (16, 24))
    got = jax.grad(lambda x, w: jnp.sum(einsum("BLD,DF->BLF", x, w) ** 2), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.einsum("BLD,DF->BLF", x, w) ** 2), (0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_array_equal(g, h)


def test_under_shard_map_with_vma():
    """Column-parallel shape: x varies over the batch axis, w over tp; grads keep the
    operands' varying axes (check_vma on) and match the unsharded rule."""
    mesh = jax.make_mesh((2, 4), ("b", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, w, kc = operands((4, 8, 16), (16, 24))
    ct = jax.random.normal(kc, (4, 8, 24), f32)

    def loss(x, w, ct):
        return jnp.sum(einsum("BLD,DF->BLF", x, w, dtype=bf16) * ct)

    def sharded(x, w, ct):
        def per_shard(x, w, ct):
            dx, dw = jax.grad(loss, (0, 1))(jax.lax.pcast(x, "tp", to="varying"),
                                             jax.lax.pcast(w, "b", to="varying"), ct)
            return jax.lax.psum(dx, "tp"), jax.lax.psum(dw, "b")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P("b"), P(None, "tp"), P("b", None, "tp")),
                             out_specs=(P("b"), P(None, "tp")))(x, w, ct)

    got = jax.jit(sharded)(x, w, ct)
    want = jax.grad(loss, (0, 1))(x, w, ct)
    for g, h, name in zip(got, want, "xw"):
        close(g, h, f"d{name}")
