"""Microbenchmarks for the `cpu` profile, run on all devices of the mesh at once.

On forced host-CPU devices every device is a thread of one host: the rate one device
gets depends on what the others do at the same time. So each microbenchmark runs under
`shard_map` over every device, each device doing one device's share, and its wall time
is what the step pays for that op (no x n_devices afterwards):

- `dot_seconds`: each distinct `dot_general` of a ledger (operand shapes, dtypes,
  dimension numbers; `Row.dot`), run alone with those per-device operands in the layout
  XLA:CPU's dot library takes, and `relayout_bandwidth`: the copies that lay an operand
  out in it (`Row.relayout`), a transpose copy of the step's typical such operand;
- `bandwidth`: `y = 1.5 * x + y` passes in a loop on per-device arrays of the step's
  typical activation size (reads two, writes one), and `cold_bandwidth`: the same passes
  on arrays of half the host's last-level cache per device (`cold_elems`: every pass
  streams from memory), the time of five passes less one's, so the first touch of the
  output's fresh pages is left to `fault_cost`: the rate of a scan's stacked inputs and
  outputs (`Row.scan_stack`);
- `vector_rate`: 32 multiply-adds an element a pass (`arithmetic_chain`), passes in a
  loop on the same arrays (FLOPs counted as the ledger counts them: one per elementwise
  op per element), and `transcendental_rate`: one exponential an element a pass
  (`exp_pass`), the rate of exp, log, logistic and the like (`price.TRANSCENDENTAL`);
- the collectives (`engine.cost.microbench_comm`): each distinct collective of a
  ledger timed at its group size, the per-kind fits over all devices, and what a
  collective beside compute adds;
- `fault_cost`: seconds per byte of first touching freshly mapped memory (the kernel's
  page faults), one thread, with plain numpy: the step's temporaries above a thread's
  heap are mapped anew every step (engine/run/host.py).

`in_run_profile` measures all of these for one ledger just before the step is timed,
so predictions and measurement see the same machine load (`bench/roofline.py`);
`bench/calibrate.py` writes the generic ones to the calibration file.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import mmap
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from engine.cost.hardware import Hardware
from engine.cost.ledger import ledger
from engine.parallel.layout import Layout


def timed(f, *args, reps: int = 5) -> float:
    """Median seconds of `f(*args)` after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def paired_seconds(f, base, *args, reps: int = 5) -> float:
    """Median over `reps` back-to-back pairs of (seconds of `f(*args)` less seconds of
    `base(*args)`), after one warm-up call of each: the time `f` adds to a program
    `base` stands for (its dispatch), the two timed moments apart so the host's load
    moves both alike. At least 1e-7."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(base(*args))
    diffs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(base(*args))
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    return max(statistics.median(diffs), 1e-7)


def fault_cost(nbytes: int = 64 << 20, reps: int = 9) -> float:
    """Seconds per byte the first touch of freshly mapped memory adds to writing it, on
    one thread: a new anonymous mapping of `nbytes` written once and unmapped, less the
    same write into memory already touched, timed in pairs (`paired_seconds`). The
    kernel's page fault and zero fill of each page: what a step pays for temporaries
    mapped anew each step (engine/run/host.py `mapped_each_step`)."""
    warm = np.ones(nbytes, np.uint8)

    def fresh():
        with mmap.mmap(-1, nbytes) as m:
            a = np.frombuffer(m, np.uint8)
            a.fill(1)
            del a  # release the buffer before the mapping closes

    return paired_seconds(fresh, lambda: warm.fill(1), reps=reps) / nbytes


def dispatch_program(mesh: Mesh, spec):
    """A trivial all-device program on operands sharded as `spec`: what calling a
    compiled program costs, which the ops inside the step do not pay."""
    return jax.jit(jax.shard_map(lambda *xs: sum(x.reshape(-1)[:1].astype(jnp.float32)
                                                 for x in xs),
                                 mesh=mesh, in_specs=spec, out_specs=spec))


def flat_mesh(devices) -> Mesh:
    """One axis "d" over `devices`: each times the same program on its own operands."""
    return Mesh(np.array(devices), ("d",))


def _device_timer(mesh: Mesh, fn, shapes_dtypes, reps: int = 5, base=None):
    """A function of no arguments that returns the wall seconds of `fn` run on every
    device at once, each on its own operands of `shapes_dtypes` [(shape, dtype)], less
    the seconds of `base` on the same operands, timed in pairs with it: by default the
    dispatch of a trivial program (ops inside the compiled step do not pay it). Compiled
    once, timed at each call; the operands are made for each call and dropped after it,
    so many timers hold no device memory."""
    n = mesh.size
    sharding = NamedSharding(mesh, P("d"))

    def compiled(g):
        return jax.jit(jax.shard_map(lambda *xs: g(*(x[0] for x in xs))[None], mesh=mesh,
                                     in_specs=P("d"), out_specs=P("d")))

    program = compiled(fn)
    base = dispatch_program(mesh, P("d")) if base is None else compiled(base)

    def seconds():
        args = [jax.device_put(jnp.full((n, *shape), 0.5, dtype), sharding)
                for shape, dtype in shapes_dtypes]
        return paired_seconds(program, base, *args, reps=reps)
    return seconds


def _per_device(mesh: Mesh, fn, shapes_dtypes, reps: int = 5, base=None) -> float:
    """Wall seconds of `fn` run on every device at once, less `base`'s
    (`_device_timer`), timed once."""
    return _device_timer(mesh, fn, shapes_dtypes, reps, base)()


def _looped(body, k: int):
    """x -> body applied k times in a while loop (each pass depends on the last), so
    one dispatch is amortized over k executions."""
    return lambda x, *rest: lax.fori_loop(0, k, lambda _, y: body(y, *rest), x)


def canonical_dot(lhs: tuple, rhs: tuple, dims) -> tuple[tuple, tuple]:
    """The same matmul as `dot_general(lhs, rhs, dims)` in XLA's preferred layout:
    [batch, M, K] x [batch, K, N] shapes (free and contracted dims flattened)."""
    (lc, rc), (lb, rb) = dims
    prod = lambda shape, ds: math.prod(shape[d] for d in ds)
    batch, k = prod(lhs, lb), prod(lhs, lc)
    m = prod(lhs, [d for d in range(len(lhs)) if d not in (*lc, *lb)])
    n = prod(rhs, [d for d in range(len(rhs)) if d not in (*rc, *rb)])
    return (batch, m, k), (batch, k, n)


def dot_seconds(rows, mesh: Mesh, canonical: bool = True, passes: int = 1) -> dict:
    """{Row.dot: seconds of one execution on every device at once} for every distinct dot,
    timed as the canonical matmul XLA:CPU's dot library runs (`canonical_dot`: [batch, M,
    K] x [batch, K, N]), or with `canonical=False` as written (row-major operands, so the
    copies XLA adds to lay out an operand in another order are in its time). The step
    makes those copies once per operand and layout, shared by the dots that read it, as
    ops of their own: the ledger has them as rows (`Row.relayout`, priced at
    `relayout_bandwidth`); timed canonical, medium tp8's dots sum to about what a
    profiler trace puts on the step's dot ops, timed as written to well over it
    (bench/results/2026-11-28-dot-layout-xeon2c.md).
    A dot of mixed operand dtypes (an f32 cotangent times a bf16 weight) is timed
    with both in the wider dtype: XLA converts the narrow one first, and that convert is
    priced as a row of its own.

    With `passes` > 1 every dot is timed again in each of that many passes over all of
    them, and its fastest pass kept: on a shared host a slow spell falls on the dots
    timed during it, and one pass over the dots of a few programs makes their ratios
    move by far more than they differ (see `engine.plan.DOT_PASSES`)."""
    timers = {}
    batched = (((2,), (1,)), ((0,), (0,)))
    for key in sorted({r.dot for r in rows if r.dot is not None}, key=repr):
        lhs, rhs, lt, rt, dims, result = key
        if lt != rt:
            lt = rt = max(lt, rt, key=lambda d: jnp.dtype(d).itemsize)
        if canonical:
            lhs, rhs, dims = *canonical_dot(lhs, rhs, dims), batched
        fn = lambda a, b, dims=dims, result=result: lax.dot_general(
            a, b, dims, preferred_element_type=jnp.dtype(result))
        timers[key] = _device_timer(mesh, fn, [(lhs, jnp.dtype(lt)), (rhs, jnp.dtype(rt))])
    out = {}
    for _ in range(passes):
        for key, time_it in timers.items():
            out[key] = min(out.get(key, math.inf), time_it())
    return out


def _weighted_median(items):
    """The value of the first of `items` [(order, weight, value)], sorted, at which the
    running weight reaches half the total; None for no items."""
    items = sorted(items)
    half, acc = sum(w for _, w, _ in items) / 2, 0.0
    for _, weight, value in items:
        acc += weight
        if acc >= half:
            return value
    return None


def typical_elems(rows) -> int:
    """f32 elements of the step's typical memory row: the byte-weighted median of one
    execution's bytes / 3 (a fused elementwise op reads about two arrays, writes one)."""
    one = _weighted_median((r.bytes, r.total_bytes, r.bytes) for r in rows
                           if r.kind == "memory" and r.bytes)
    return 1 << 20 if one is None else max(int(one / 12), 1024)


def stream_pass(y, x):
    """One pass of the bandwidth benchmarks: reads two f32 arrays, writes one."""
    return 1.5 * x + y


def bandwidth(mesh: Mesh, elems: int, k: int = 20) -> float:
    """Bytes/s one device moves while every device streams `y = 1.5 * x + y` (k passes
    in a loop) at once."""
    t = _per_device(mesh, _looped(stream_pass, k), [((elems,), jnp.float32)] * 2)
    return 12 * k * elems / t


def cold_bandwidth(mesh: Mesh, elems: int | None = None, k: tuple[int, int] = (1, 5),
                   reps: int = 5) -> float:
    """Bytes/s one device streams out of cache (`stream_pass` on `cold_elems` arrays),
    every device at once: the rate of a scan's stacked inputs and outputs. Timed as the
    difference of a k[1]-pass and a k[0]-pass loop, in pairs (`paired_seconds`): arrays
    this large are mapped anew for each call's output, so one loop's time also holds
    the first touch of those pages, which a step pays for its temporaries in
    `price.fault_seconds` (the stack among them), not at this rate."""
    elems = elems or cold_elems()
    lo, hi = k
    t = _per_device(mesh, _looped(stream_pass, hi), [((elems,), jnp.float32)] * 2, reps,
                    base=_looped(stream_pass, lo))
    return 12 * (hi - lo) * elems / t


def typical_relayout(rows) -> tuple[tuple[int, int], str]:
    """The [rows, columns] and dtype of the step's typical dot operand copy
    (`Row.relayout`, the byte-weighted median by total bytes, its dimensions before the
    last flattened), else a [4096, 512] bf16 array (an activation of `medium` on tp8,
    [B·L, D], which its weight grads read transposed)."""
    got = _weighted_median((r.total_bytes, r.total_bytes, (r.shape, r.dtype))
                           for r in rows if r.relayout)
    if got is None:
        return (4096, 512), "bfloat16"
    shape, dtype = got
    return (math.prod(shape[:-1]), shape[-1]), dtype


def relayout_bandwidth(mesh: Mesh, shape: tuple[int, int] = (4096, 512),
                       dtype: str = "bfloat16") -> float:
    """Bytes/s (read + written) one device moves copying a [rows, columns] array into
    its transpose, every device at once: the price of the copies that lay a dot operand
    out for XLA:CPU's dot library (`Row.relayout`). One copy a call, as the step runs
    them (the same `copy` fusion; in a loop each copy also paid a copy of the loop's
    carry, at a quarter of this rate on this host)."""
    t = _per_device(mesh, lambda x: x.T, [(shape, jnp.dtype(dtype))])
    return 2 * math.prod(shape) * jnp.dtype(dtype).itemsize / t


def last_level_cache() -> int:
    """Bytes of the host's largest CPU cache (Linux sysfs: cpu0's `cache/index*/size`,
    e.g. "32768K"), else 32 MiB."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = Path(f).read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


def cold_elems() -> int:
    """f32 elements per array of `bandwidth` out of cache: a device's two arrays
    together the size of the host's last-level cache, so with the devices streaming at
    once no pass finds the last one's data there. Above a thread's heap (engine/run/host.py)
    a call's output is mapped anew and faulted in: `cold_bandwidth` times passes apart
    from that."""
    return last_level_cache() // 8


def stacking_bandwidth(mesh: Mesh, elems: int, n: int = 4) -> float:
    """Bytes/s one device moves for a scan's stacked data, every device at once: a
    scan stacking its f32[elems] carry n times and a reverse scan summing the stack,
    less the same two loops without the stack, over the bytes the ledger charges the
    stack (its `Row.scan_stack` rows' share). A check of the `cold_bandwidth` stream rate,
    which prices those bytes, against the traffic itself."""
    def stacked(c):
        c2, ys = lax.scan(lambda c, _: (c * 1.0001, c), c, None, length=n)
        return lax.scan(lambda a, y: (a + y, None), c2, ys, reverse=True)[0]

    def unstacked(c):
        c2 = lax.fori_loop(0, n, lambda i, c: c * 1.0001, c)
        return lax.fori_loop(0, n, lambda i, a: a + c, c2)

    shapes = [((elems,), jnp.float32)]
    extra = _per_device(mesh, stacked, shapes) - _per_device(mesh, unstacked, shapes)
    rows = ledger(jax.make_jaxpr(stacked)(jnp.ones(elems, jnp.float32)), Layout.parse("single"))
    return sum(r.scan_stack * r.total_bytes for r in rows) / max(extra, 1e-9)


def arithmetic_chain(x, depth: int = 32):
    """`depth` multiply-adds in a row (2 ledger FLOPs each; one fused loop, so 64
    FLOPs per element read and written: compute-bound, not memory-bound)."""
    for _ in range(depth):
        x = x * 0.999 + 0.001
    return x


def exp_pass(x):
    """`exp(-x)`: one exponential an element in a loop of its own, as the step's softmax
    and silu each have one in their fused loops (the negation folds into it)."""
    return jnp.exp(-x)


def vector_rate(mesh: Mesh, elems: int, k: int = 10) -> float:
    """Elementwise arithmetic FLOP/s one device gets (`arithmetic_chain`, k passes in a
    loop) while every device runs it."""
    t = _per_device(mesh, _looped(arithmetic_chain, k), [((elems,), jnp.float32)])
    return 64 * k * elems / t


def transcendental_rate(mesh: Mesh, elems: int, k: int = 20) -> float:
    """Exponentials per second one device gets (`exp_pass`, k passes in a loop: one
    ledger FLOP per element each) while every device runs it."""
    t = _per_device(mesh, _looped(exp_pass, k), [((elems,), jnp.float32)])
    return k * elems / t


def in_run_profile(hw: Hardware, rows, devices, collective_sizes=None) -> Hardware:
    """`hw` with every rate the ledger's rows need measured now on `devices`, all at
    once: per-dot seconds, bandwidth and vector rate at the step's activation size, the
    rate of the dot operands' relayout copies at their typical size, the bandwidth out
    of cache, the cost of faulting in fresh memory (`fault_cost`, one
    thread), and (with more than one device) per-collective seconds, the
    collective fits and what a collective beside compute adds (`beside_cost`). Compute
    is then not multiplied by the device count (`concurrent_rates`: the measurements
    already share the host)."""
    from engine.cost.microbench_comm import (beside_cost, collective_times, fit,
                                             group_collective_seconds)

    mesh = flat_mesh(devices)
    elems = typical_elems(rows)
    fit_, measured, beside = dict(hw.collective_fit), {}, 0.0
    if mesh.size > 1:
        measured = group_collective_seconds(rows, devices)
        beside = beside_cost(mesh)
        big = max((r.bytes for r in rows if r.kind == "collective"), default=1 << 20)
        sizes = collective_sizes or sorted({1 << 14, 1 << 17, 1 << 20,
                                            max(1 << 14, int(big) // 64 * 64)})
        sizes = [s - s % (4 * mesh.size) for s in sizes]
        fit_ = {k: fit(k, pts, mesh.size)
                for k, pts in collective_times(mesh, sizes).items()}
    return dataclasses.replace(
        hw, dot_seconds=dot_seconds(rows, mesh),
        relayout_bw=relayout_bandwidth(mesh, *typical_relayout(rows)),
        hbm=bandwidth(mesh, elems), cold_hbm=cold_bandwidth(mesh),
        vector_flops=vector_rate(mesh, elems), transcendental_flops=transcendental_rate(mesh, elems),
        mem_eff=1.0, concurrent_rates=True, collective_fit=fit_, collective_seconds=measured,
        beside_cost=beside, fault_cost=fault_cost(),
        source=f"measured in this run on {mesh.size} devices at once")
