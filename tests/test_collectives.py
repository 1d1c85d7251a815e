"""Each collective against a plain-jnp reference on per-device arrays, values and grads.

Every device's local block is one row of a stacked array X[dev, ...] (dev row-major over
the mesh); the reference computes each device's result by looping over devices, with no
collectives, so its gradient is an independent check of the collective's transpose."""
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import collectives

MESHES = {(8,): ("a",), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}


def make_mesh(shape):
    names = MESHES[shape]
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def groups(shape, names, axes):
    """For every device (row-major index), its group along `axes` in row-major order of
    those axes, and its position in that group."""
    coords = list(itertools.product(*(range(n) for n in shape)))
    where = [names.index(a) for a in axes]
    out = []
    for c in coords:
        members = [i for i, d in enumerate(coords)
                   if all(d[k] == c[k] for k in range(len(shape)) if k not in where)]
        members.sort(key=lambda i: tuple(coords[i][k] for k in where))
        out.append((members, members.index(coords.index(c))))
    return out


def run_sharded(mesh, f, X):
    """Apply f per device to X[dev] and stack the per-device results the same way."""
    spec = P(mesh.axis_names)
    return jax.shard_map(lambda x: f(x[0])[None], mesh=mesh, in_specs=spec, out_specs=spec)(X)


def reference(kind, X, shape, names, axes, **kw):
    """Per-device results of collective `kind`, computed without collectives."""
    rows = []
    for members, pos in (groups(shape, names, axes)):
        n = len(members)
        blocks = [X[m] for m in members]
        if kind == "gather":
            rows.append(jnp.concatenate(blocks, axis=kw["dim"]))
        elif kind == "reduce_scatter":
            rows.append(jnp.split(sum(blocks), n, axis=kw["dim"])[pos])
        elif kind == "all_reduce":
            rows.append(sum(blocks))
        elif kind == "all_reduce_max":
            rows.append(jnp.max(jnp.stack(blocks), axis=0))
        elif kind == "ring_shift":
            rows.append(blocks[(pos - kw["shift"]) % n])
        elif kind == "all_to_all":
            rows.append(jnp.concatenate(
                [jnp.split(b, n, axis=kw["split_dim"])[pos] for b in blocks], axis=kw["concat_dim"]))
        elif kind == "axis_index":
            rows.append(jnp.full(X.shape[1:], pos, X.dtype))
    return jnp.stack(rows)


def sharded_fn(kind, axes, **kw):
    axis = axes if len(axes) > 1 else axes[0]
    return {
        "gather": lambda x: collectives.gather(x, axis, dim=kw.get("dim")),
        "reduce_scatter": lambda x: collectives.reduce_scatter(x, axis, dim=kw.get("dim")),
        "all_reduce": lambda x: collectives.all_reduce(x, axis),
        "all_reduce_max": lambda x: collectives.all_reduce_max(x, axis),
        "ring_shift": lambda x: collectives.ring_shift(x, axis, kw.get("shift")),
        "all_to_all": lambda x: collectives.all_to_all(x, axis, kw.get("split_dim"),
                                                       kw.get("concat_dim")),
        "axis_index": lambda x: jnp.full(x.shape, collectives.axis_index(axis), x.dtype),
    }[kind]


def axis_choices(names):
    """Every single axis and, for multi-axis meshes, the pair of the first two."""
    return [(a,) for a in names] + ([names[:2]] if len(names) > 1 else [])


CASES = [("gather", dict(dim=0)), ("gather", dict(dim=1)),
         ("reduce_scatter", dict(dim=0)), ("reduce_scatter", dict(dim=1)),
         ("all_reduce", {}), ("all_reduce_max", {}), ("axis_index", {}),
         ("ring_shift", dict(shift=1)), ("ring_shift", dict(shift=-1)),
         ("all_to_all", dict(split_dim=0, concat_dim=1)), ("all_to_all", dict(split_dim=1, concat_dim=0))]
DIFFERENTIABLE = {"gather", "reduce_scatter", "all_reduce", "ring_shift", "all_to_all"}
SINGLE_AXIS_ONLY = {"ring_shift", "all_to_all"}


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{'-'.join(map(str, kw.values()))}" for k, kw in CASES])
def test_collective_matches_reference(shape, kind, kw):
    names = MESHES[shape]
    mesh = make_mesh(shape)
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32)  # 8 divides every group size
    for axes in axis_choices(names):
        if kind in SINGLE_AXIS_ONLY and len(axes) > 1:
            continue
        f = sharded_fn(kind, axes, **kw)
        ref = jax.jit(lambda x: reference(kind, x, shape, names, axes, **kw))
        want = ref(X)
        got = jax.jit(lambda x: run_sharded(mesh, f, x))(X)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{kind} over {axes}")
        if kind in DIFFERENTIABLE:
            W = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
            g_got = jax.jit(jax.grad(lambda x: jnp.sum(run_sharded(mesh, f, x) * W)))(X)
            g_want = jax.jit(jax.grad(lambda x: jnp.sum(ref(x) * W)))(X)
            np.testing.assert_allclose(g_got, g_want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"grad of {kind} over {axes}")


@pytest.mark.parametrize("shape", list(MESHES))
def test_broadcast_grad_is_all_reduce(shape):
    """broadcast moves nothing forward; its transpose sums the cotangents of the group."""
    names = MESHES[shape]
    mesh = make_mesh(shape)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(8, 4, 3)), jnp.float32)
    # replicated in, per-device out: device d's result is x * W[d]
    f = jax.shard_map(lambda x, w: (collectives.broadcast(x, names) * w[0])[None], mesh=mesh,
                      in_specs=(P(), P(names)), out_specs=P(names))
    np.testing.assert_allclose(f(x, W), x[None] * W, rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(f(x, W)))(x)
    np.testing.assert_allclose(g, jnp.sum(W, axis=0), rtol=1e-5, atol=1e-6)
    for axes in axis_choices(names):
        axis = axes if len(axes) > 1 else axes[0]
        # broadcasting over an axis the value already varies on is a no-op
        h = jax.shard_map(lambda x: collectives.broadcast(x[0], axis)[None], mesh=mesh,
                          in_specs=P(names), out_specs=P(names))
        np.testing.assert_array_equal(h(W), W)


def test_absent_axis_moves_nothing():
    x = jnp.arange(6.0).reshape(2, 3)
    for f in (lambda v: collectives.gather(v, None, 0), lambda v: collectives.reduce_scatter(v, (), 1),
              lambda v: collectives.all_reduce(v, None), lambda v: collectives.broadcast(v, ()),
              lambda v: collectives.ring_shift(v, None), lambda v: collectives.all_reduce_max(v, None)):
        np.testing.assert_array_equal(f(x), x)
    assert collectives.axis_size(None) == 1 and int(collectives.axis_index(None)) == 0


# -- collective matmuls (collectives/ring.py) ---------------------------------------------
# Each ring helper against the plain collective it decomposes (checked above against the
# per-device loop), values and grads, with a per-device weight as a tp-sharded one would be.
RING_CASES = [((8,), "a", 1), ((4, 2), "a", 0), ((4, 2), "b", 1)]


def ring_inputs(seed, x_shape, w_shape):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(8, *s)), jnp.float32) for s in (x_shape, w_shape))


def run_pair(mesh, f, X, W):
    """f(x, w) per device on rows X[dev], W[dev]; outputs (a tree) stacked the same way."""
    spec = P(mesh.axis_names)
    g = lambda x, w: jax.tree.map(lambda y: y[None], f(x[0], w[0]))
    return jax.shard_map(g, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(X, W)


def assert_same_values_and_grads(mesh, got_f, want_f, X, W, what):
    got = jax.jit(lambda x, w: run_pair(mesh, got_f, x, w))(X, W)
    want = jax.jit(lambda x, w: run_pair(mesh, want_f, x, w))(X, W)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=what)
    rng = np.random.default_rng(7)
    R = jax.tree.map(lambda y: jnp.asarray(rng.normal(size=y.shape), jnp.float32), want)

    def dot(f):  # <f(x, w), R>: its grad is the transpose of f applied to R
        return lambda x, w: sum(jnp.sum(y * r) for y, r in
                                zip(jax.tree.leaves(run_pair(mesh, f, x, w)), jax.tree.leaves(R)))

    g_got = jax.jit(jax.grad(dot(got_f), argnums=(0, 1)))(X, W)
    g_want = jax.jit(jax.grad(dot(want_f), argnums=(0, 1)))(X, W)
    for g, w, name in zip(g_got, g_want, ("dx", "dw")):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{what} {name}")


@pytest.mark.parametrize("shape,axis,dim", RING_CASES)
def test_gather_apply_is_f_of_gather(shape, axis, dim):
    """A tuple-valued f (as Q, K, V share one ring), chunk-wise along `dim`."""
    mesh = make_mesh(shape)
    X, W = ring_inputs(2, (2, 4, 3) if dim == 1 else (4, 2, 3), (3, 5))
    f = lambda x, w: (jnp.einsum("BLD,DF->BLF", x, w), jnp.tanh(x))
    assert_same_values_and_grads(
        mesh, lambda x, w: collectives.gather_apply(x, lambda c: f(c, w), axis, dim),
        lambda x, w: f(collectives.gather(x, axis, dim), w), X, W, f"gather_apply over {axis}")


@pytest.mark.parametrize("shape,axis,dim", RING_CASES)
def test_apply_reduce_scatter_is_reduce_scatter_of_f(shape, axis, dim):
    mesh = make_mesh(shape)
    n = shape[MESHES[shape].index(axis)]
    X, W = ring_inputs(3, (2, 4 * n, 5) if dim == 1 else (4 * n, 2, 5), (5, 3))
    f = lambda h, w: jnp.einsum("BLF,FD->BLD", h, w)
    assert_same_values_and_grads(
        mesh, lambda h, w: collectives.apply_reduce_scatter(h, lambda c: f(c, w), axis, dim),
        lambda h, w: collectives.reduce_scatter(f(h, w), axis, dim), X, W,
        f"apply_reduce_scatter over {axis}")


COLLECTIVE_OP = r"(all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)(?:-start)?\("


def test_ring_matmuls_compile_to_collective_permutes_only():
    """Forward and backward of both rings: ppermutes, no all-gather or reduce-scatter."""
    mesh = make_mesh((8,))
    X, W = ring_inputs(4, (2, 4, 3), (3, 5))
    rings = {
        "gather_apply": lambda x, w: collectives.gather_apply(
            x, lambda c: jnp.einsum("BLD,DF->BLF", c, w), "a", 1),
        "apply_reduce_scatter": lambda x, w: collectives.apply_reduce_scatter(
            jnp.tile(x, (1, 8, 1)), lambda c: jnp.einsum("BLD,DF->BLF", c, w), "a", 1),
    }
    for name, f in rings.items():
        loss = lambda x, w: jnp.sum(jnp.sin(run_pair(mesh, f, x, w)))
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(X, W).compile().as_text()
        ops = re.findall(COLLECTIVE_OP, hlo)
        assert ops.count("collective-permute") >= 2 * 7, f"{name}: {ops}"
        assert not {"all-gather", "reduce-scatter"} & set(ops), f"{name}: {ops}"


def test_ring_helpers_without_an_axis_are_plain_f():
    x = jnp.arange(24.0).reshape(2, 4, 3)
    f = lambda c: (c * 2.0, jnp.sum(c, axis=-1, keepdims=True))
    for ring in (collectives.gather_apply, collectives.apply_reduce_scatter):
        for got, want in zip(ring(x, f, None, 1), f(x)):
            np.testing.assert_array_equal(got, want)
    for comm in collectives.COMMS:
        np.testing.assert_array_equal(collectives.column_parallel(x, jnp.sin, None, 1, comm),
                                      jnp.sin(x))
        np.testing.assert_array_equal(collectives.row_parallel(x, jnp.sin, None, 1, comm),
                                      jnp.sin(x))


# -- gather_many: several gathers as one all-gather ---------------------------------------
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,axis", [((8,), "a"), ((4, 2), "a"), ((2, 2, 2), ("a", "b"))])
def test_gather_many_is_each_gather(shape, axis, dtype, pack):
    """Arrays of different ranks gathered along different dims (first, middle, last),
    values and grads, against one `gather` each (checked above against the loop). The
    buffer holds an odd number of elements, so bf16's uint32 pairs need their padding.
    Gathers move data and the grads sum the same terms: equal to the bit in f32, and in
    bf16 to the rounding of the bf16 grads (the two reduce-scatters sum in f32, then
    round). Unpacked (`pack=False`, for a backend that gathers bf16 natively) bf16
    travels as itself."""
    names = MESHES[shape]
    mesh, spec = make_mesh(shape), P(names)
    rng = np.random.default_rng(5)
    shapes, dims = [(2, 3), (3, 2, 4), (4, 2), (2, 5, 3)], [0, 1, 1, 2]
    XS = [jnp.asarray(rng.normal(size=(8, *s)), dtype) for s in shapes]

    def per_device(f):
        return jax.shard_map(lambda *xs: [y[None] for y in f([x[0] for x in xs])], mesh=mesh,
                             in_specs=(spec,) * len(XS), out_specs=[spec] * len(XS))

    many = per_device(lambda xs: collectives.gather_many(xs, axis, dims, pack))
    each = per_device(lambda xs: [collectives.gather(x, axis, d) for x, d in zip(xs, dims)])
    want = jax.jit(each)(*XS)
    for g, w in zip(jax.jit(many)(*XS), want):
        np.testing.assert_array_equal(g, w)
    R = [jnp.asarray(rng.normal(size=w.shape), dtype) for w in want]
    dot = lambda f: lambda *xs: sum(jnp.sum((y * r).astype(jnp.float32))
                                    for y, r in zip(f(*xs), R))
    argnums = tuple(range(len(XS)))
    g_many = jax.jit(jax.grad(dot(many), argnums))(*XS)
    g_each = jax.jit(jax.grad(dot(each), argnums))(*XS)
    tol = 1e-6 if dtype == jnp.float32 else 2**-8  # one bf16 rounding
    for g, w in zip(g_many, g_each):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol)
    hlo = jax.jit(jax.value_and_grad(dot(many), argnums)).lower(*XS).compile().as_text()
    ops = re.findall(COLLECTIVE_OP, hlo)
    assert (ops.count("all-gather"), ops.count("reduce-scatter")) == (1, 1), ops
    # packed, bf16 travels as uint32 pairs, not widened to f32 by XLA:CPU; unpacked, as
    # XLA:CPU gathers it (in f32)
    gathered = re.search(r"= (\w+)\[[\d,]*\]\S* all-gather(?:-start)?\(", hlo).group(1)
    assert gathered == ("u32" if dtype == jnp.bfloat16 and pack else "f32"), gathered


@pytest.mark.parametrize("many", [False, True], ids=["gather", "gather_many"])
def test_cast_gathers_in_bf16_and_reduces_grads_in_f32(many):
    """`cast` with `keep_grad_dtype`: f32 inputs gathered as bf16 (the values of gathering x.astype(bf16), to the
    bit), the transpose reduce-scattering the bf16 cotangents in f32: each device's grad
    is the f32 sum of the 8 cotangent blocks (bf16 values, so exact in f32 but for
    f32's rounding of the sum: 1e-6). Without `keep_grad_dtype` the sum is rounded to bf16 (one
    rounding, 2^-9 relative), which this tolerance tells apart. The compiled
    reduce-scatter is f32."""
    mesh, spec = make_mesh((8,)), P("a")
    rng = np.random.default_rng(7)
    X = jnp.asarray(rng.normal(size=(8, 4, 6)), jnp.float32)
    R = jnp.asarray(rng.normal(size=(8, 32, 6)), jnp.bfloat16)  # each device's cotangent

    def f(cast):
        if many:
            g = lambda x: collectives.gather_many([x], "a", [0], cast=cast,
                                                  keep_grad_dtype=True)[0]
        else:
            g = lambda x: collectives.gather(x, "a", 0, cast=cast, keep_grad_dtype=True)
        return jax.shard_map(lambda x: g(x[0])[None], mesh=mesh, in_specs=spec,
                             out_specs=spec)

    cast_f = f(jnp.bfloat16)
    plain = jax.shard_map(lambda x: collectives.gather(x[0].astype(jnp.bfloat16), "a", 0)[None],
                          mesh=mesh, in_specs=spec, out_specs=spec)
    got = jax.jit(cast_f)(X)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jax.jit(plain)(X), np.float32))
    loss = lambda g: lambda x: jnp.sum((g(x) * R).astype(jnp.float32))
    grad = jax.jit(jax.grad(loss(cast_f)))(X)
    assert grad.dtype == jnp.float32
    # device d's grad: rows 4d..4d+3 of every device's cotangent, summed
    want = np.sum(np.asarray(R, np.float64), axis=0).reshape(8, 4, 6)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-6)
    rounded = np.asarray(jax.jit(jax.grad(loss(plain)))(X))
    assert np.max(np.abs(rounded - want)) > 1e-4  # the bf16 reduce rounds: told apart
    hlo = jax.jit(jax.grad(loss(cast_f))).lower(X).compile().as_text()
    reduced = re.search(r"= (\w+)\[[\d,]*\]\S* reduce-scatter(?:-start)?\(", hlo).group(1)
    assert reduced == "f32", reduced


def test_gather_many_without_an_axis_returns_its_inputs():
    xs = [jnp.arange(6.0).reshape(2, 3), jnp.arange(4.0)]
    for got, want in zip(collectives.gather_many(xs, None, [0, 0]), xs):
        np.testing.assert_array_equal(got, want)


def test_the_step_packs_its_gathers_only_where_the_backend_widens_bf16():
    """XLA:CPU runs bf16 collectives in f32, so a step on CPU devices (and a trace on an
    AbstractMesh on this host) packs them; the choice reaches the ZeRO-3 weights."""
    from engine.config import ParallelConfig, TrainConfig, model_config
    from engine.parallel.layout import Layout
    from engine.run.step import Trainer

    assert collectives.widens_2byte(make_mesh((8,)))
    abstract = jax.sharding.AbstractMesh((8,), ("a",))
    assert collectives.widens_2byte(abstract) == (jax.default_backend() == "cpu")
    layout = Layout.parse("fsdp8")
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=8, seq=16)
    for mesh in (layout.mesh(), layout.abstract_mesh()):
        trainer = Trainer(cfg, tcfg, layout, mesh, ParallelConfig(zero=3))
        assert trainer._model_axes.weights.pack is collectives.widens_2byte(mesh)
