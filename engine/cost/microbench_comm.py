"""Collective microbenchmarks for the `cpu` profile, run on all devices of the mesh at
once (as `engine.cost.microbench`'s compute ones are):

- `group_collective_seconds`: each distinct collective of a ledger (kind, group size,
  bytes, dtype), every group of its size at once: an all-reduce between the matmuls
  that write its operand and read its result (`in_chain_seconds`), the other kinds
  alone (`collective_run`);
- `collective_times` / `fit`: each collective's time vs bytes over one axis of all
  devices, fitted to `latency * hops + ring_fraction * bytes / bandwidth` (the
  calibration file's, and the in-run price of a collective not timed on its own);
- `beside_cost`: what a collective run beside compute adds to that compute.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import collectives
from engine.cost.ledger import WIDENED_KINDS
from engine.cost.microbench import dispatch_program, paired_seconds
from engine.cost.price import collective_key, ring_factor


COLLECTIVE_OPS = {
    "all-gather": lambda x: collectives.gather(x, "d", dim=0),
    "reduce-scatter": lambda x: collectives.reduce_scatter(x, "d", dim=0),
    "all-reduce": lambda x: collectives.all_reduce(x, "d"),
    "collective-permute": lambda x: collectives.ring_shift(x, "d"),
    "all-to-all": lambda x: collectives.all_to_all(x, "d", 0, 0),
}


def collective_run(kind: str, mesh: Mesh, axes, elems: int, dtype, reps: int) -> float:
    """Seconds of one `kind` over the mesh axis "d", every device holding `elems`
    elements of `dtype` (the array sharded over `axes`), less the dispatch of a trivial
    program on the same operands, timed in pairs with it (`paired_seconds`): a dispatch
    timed once for all of them, a moment of load apart, was larger than a small
    collective's whole time and priced it at nothing."""
    spec = P(axes)
    f = jax.jit(jax.shard_map(COLLECTIVE_OPS[kind], mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((mesh.size * elems,), dtype), NamedSharding(mesh, spec))
    return paired_seconds(f, dispatch_program(mesh, spec), x, reps=reps)


def collective_times(mesh: Mesh, sizes_bytes, reps: int = 5) -> dict:
    """{kind: [(bytes as the ledger counts them, seconds)]} over one axis of all devices.
    Ledger bytes: the gathered output for all-gather, the pre-reduce input otherwise."""
    n = mesh.size
    out = {}
    for kind in COLLECTIVE_OPS:
        out[kind] = []
        for nbytes in sizes_bytes:
            per_device = nbytes // n if kind == "all-gather" else nbytes
            out[kind].append((nbytes, collective_run(kind, mesh, "d", per_device // 4,
                                                     jnp.float32, reps)))
    return out


CHAIN_LINKS, CHAIN_WIDTH = 10, 512


def chain_program(mesh: Mesh, link, links: int, spec=P("d")):
    """jitted shard_map of `links` links x_rw = link(tanh(x_rw @ w_ww)) on each device's
    rows x [R, W] (sharded over `spec`) and w [W, W] (replicated): compute whose every
    link writes the operand of what `link` adds and reads its result."""
    def body(x_rw, w_ww):
        for _ in range(links):
            x_rw = link(jnp.tanh(x_rw @ w_ww))
        return x_rw
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec))


def in_chain_seconds(mesh: Mesh, axes, elems: int, dtype, reps: int,
                     links: int = CHAIN_LINKS) -> float:
    """Seconds one all-reduce over mesh axis "d" of `elems` elements of `dtype` a device
    adds to compute that writes its operand and reads its result: `chain_program` with
    x = all_reduce(tanh(x @ w)) / g, less the same chain without the all-reduce, timed in
    pairs (`paired_seconds`), over `links`. x [R, W] a device, W = min(`CHAIN_WIDTH`,
    elems). A step's all-reduce sits where this one does (a tp block's output, the
    loss's sums); on forced host devices it costs more there than alone, the devices
    arriving at it at different times from compute on shared cores:
    `python bench/collective_context.py` (bench/results/2026-11-28-collective-context-xeon2c.md)."""
    width = min(CHAIN_WIDTH, elems)
    g = mesh.shape["d"]
    spec = P(axes)
    reduce = chain_program(mesh, lambda y: collectives.all_reduce(y, "d") / g, links, spec)
    plain = chain_program(mesh, lambda y: y, links, spec)
    put = lambda shape, s: jax.device_put(  # noqa: E731
        jnp.full(shape, 1 / width, dtype), NamedSharding(mesh, s))
    x, w = put((mesh.size * max(elems // width, 1), width), spec), put((width, width), P())
    return paired_seconds(reduce, plain, x, w, reps=reps) / links


def group_collective_seconds(rows, devices, reps: int = 5) -> dict:
    """{price.collective_key: seconds of one execution} for every distinct collective of
    the ledger: the devices split into groups of the row's size, every group running it
    at once on operands of its bytes and dtype (the step runs a sub-axis collective in
    every group of that axis together, and on a shared host the groups share its cores).
    Timed at its own size, a collective needs no latency-per-hop extrapolation from the
    whole mesh to a group of two (`fit`). A bf16 collective of a kind a backend runs in
    f32 (`ledger.WIDENED_KINDS`, `collectives.widens_2byte`) is timed as that f32 op on
    as many elements: its casts are fusions of their own in the step, priced as the
    ledger's `Row.widen` rows. An all-reduce is timed between the matmuls that write its
    operand and read its result (`in_chain_seconds`), as a tp block's output is reduced in
    the step; the other kinds alone (`collective_run`): their output has another shape
    than their input, so they do not feed a chain of links of one shape."""
    n = len(devices)
    out = {}
    keys = {collective_key(r) for r in rows if r.kind == "collective" and r.bytes}
    for key in sorted(k for k in keys if k[0] in COLLECTIVE_OPS and 1 < k[1] and n % k[1] == 0):
        kind, g, nbytes, dtype = key
        mesh = Mesh(np.array(devices).reshape(n // g, g), ("r", "d"))
        dt = jnp.dtype(dtype)
        per_device = nbytes // g if kind == "all-gather" else nbytes
        elems = max(per_device // dt.itemsize // g * g, g)
        if dt == jnp.bfloat16 and kind in WIDENED_KINDS and collectives.widens_2byte(mesh):
            dt = jnp.dtype(jnp.float32)
        if kind == "all-reduce":
            out[key] = in_chain_seconds(mesh, ("r", "d"), elems, dt, reps)
        else:
            out[key] = collective_run(kind, mesh, ("r", "d"), elems, dt, reps)
    return out


def fit(kind: str, points, n: int) -> tuple[float, float]:
    """Least-squares (latency per hop, bandwidth) of t = hops*lat + frac*bytes/bw."""
    frac, hops = ring_factor(kind, n)
    x = np.array([frac * b for b, _ in points])
    t = np.array([s for _, s in points])
    slope, intercept = np.polyfit(x, t, 1)
    return max(float(intercept) / hops, 0.0), 1.0 / max(float(slope), 1e-15)


def beside_cost(mesh: Mesh, reps: int = 21) -> float:
    """Seconds a collective run beside compute adds to that compute, over its own
    seconds, every device at once: a layer's matmuls (six pairs of `small`'s fsdp8 MLP
    dots, [512, 256] x [256, 768] and back, bf16) and a layer's weight all-gather
    (768 KiB a device), each alone and both in one program, independent of each other
    as a prefetched gather is of the layer it runs under. XLA:CPU runs a device's
    independent ops at once, so on shared cores the two contend instead of overlapping:
    (both - matmuls - gather) / gather, the median over `reps` rounds of the three."""
    n = mesh.size

    def matmuls(x, w):
        for _ in range(6):
            y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
            x = jnp.tanh(y) @ w.T
        return x

    gather = lambda s: lax.all_gather(s, "d", tiled=True)  # noqa: E731
    sharding = NamedSharding(mesh, P("d"))
    put = lambda shape: jax.device_put(jnp.ones(shape, jnp.bfloat16), sharding)  # noqa: E731
    x, w, s = put((n * 512, 256)), put((n * 256, 768)), put((n * 4 * 256 * 768 // n,))
    program = lambda f, k: jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh, in_specs=(P("d"),) * k, out_specs=P("d") if k < 3 else (P("d"),) * 2))
    runs = [(program(matmuls, 2), (x, w)), (program(gather, 1), (s,)),
            (program(lambda x, w, s: (matmuls(x, w), gather(s)), 3), (x, w, s))]
    for f, args in runs:
        jax.block_until_ready(f(*args))
    extra = []
    for _ in range(reps):
        t = []
        for f, args in runs:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            t.append(time.perf_counter() - t0)
        extra.append((t[2] - t[0] - t[1]) / t[1])
    return max(statistics.median(extra), 0.0)
