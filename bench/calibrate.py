"""Calibrate the `cpu` hardware profile on this machine and write it for the predictor.

    python bench/calibrate.py [--out PATH]

Measures (median of repeated timed calls after a warm-up): matmul FLOP/s per operand
dtype (f32; bf16 with f32 accumulation) on the shapes the `small` model runs and on
2048^3; memory bandwidth (a fused `a * x + y` on 64 MiB arrays); elementwise FLOP/s (a
chain of exp/mul/add on a cache-resident array); and all-gather / reduce-scatter /
all-reduce / ppermute time vs bytes on the forced 8-device mesh, fitted to
`t = latency * hops + ring_fraction * bytes / bandwidth` (engine/cost/price.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import collectives  # noqa: E402
from engine.cost.hardware import CALIBRATION_PATH  # noqa: E402
from engine.cost.price import RING  # noqa: E402


def timed(f, *args, reps: int = 7) -> float:
    """Median seconds of `f(*args)` after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_flops(m: int, k: int, n: int, dtype) -> float:
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * m * k * n / timed(f, a, b)


def memory_bandwidth(n_bytes: int = 64 << 20) -> float:
    x = jnp.ones(n_bytes // 4, jnp.float32)
    f = jax.jit(lambda x, y: 1.5 * x + y)
    return 3 * n_bytes / timed(f, x, x)


def vector_flops(n: int = 1 << 18, depth: int = 16) -> float:
    def chain(x):
        for _ in range(depth):
            x = jnp.exp(-x * x) + 0.5
        return x
    return 4 * depth * n / timed(jax.jit(chain), jnp.ones(n, jnp.float32))


def collective_times(sizes_bytes) -> dict:
    """{kind: [(bytes per device, seconds)]} over all 8 devices on one axis."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    ops = {
        "all-gather": lambda x: collectives.gather(x, "x", dim=0),
        "reduce-scatter": lambda x: collectives.reduce_scatter(x, "x", dim=0),
        "all-reduce": lambda x: collectives.all_reduce(x, "x"),
        "collective-permute": lambda x: collectives.ring_shift(x, "x"),
    }
    out = {}
    for kind, op in ops.items():
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out[kind] = []
        for nbytes in sizes_bytes:
            # `bytes` as the ledger counts it: the gathered output / the pre-reduce input
            per_device = nbytes // 8 if kind == "all-gather" else nbytes
            x = jax.device_put(np.ones(8 * per_device // 4, np.float32),
                               NamedSharding(mesh, P("x")))
            out[kind].append((nbytes, timed(f, x)))
    return out


def fit(kind: str, points, n: int = 8) -> tuple[float, float]:
    """Least-squares (latency per hop, bandwidth) of t = hops*lat + frac*bytes/bw."""
    bw_mult, hop_mult = RING[kind]
    frac = 1.0 if bw_mult is None else bw_mult * (n - 1) / n
    hops = 1 if hop_mult is None else hop_mult * (n - 1)
    x = np.array([frac * b for b, _ in points])
    t = np.array([s for _, s in points])
    slope, intercept = np.polyfit(x, t, 1)
    return max(float(intercept) / hops, 0.0), 1.0 / max(float(slope), 1e-15)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(CALIBRATION_PATH))
    args = p.parse_args(argv)
    shapes = {"small_mlp": (4096, 256, 768), "small_qkv": (4096, 256, 256), "cube": (2048,) * 3}
    measured = {f"{name}/{dt}": matmul_flops(*shape, dtype)
                for name, shape in shapes.items()
                for dt, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
    peak = {dt: statistics.median(v for k, v in measured.items() if k.endswith(dt)
                                  and not k.startswith("cube")) for dt in ("float32", "bfloat16")}
    points = collective_times([1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22])
    profile = {
        "peak_flops": peak, "matmul_measured": measured,
        "hbm": memory_bandwidth(), "vector_flops": vector_flops(),
        "collective_fit": {k: fit(k, v) for k, v in points.items()},
        "collective_points": points,
        "when": time.strftime("%Y-%m-%d %H:%M"), "load_avg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    print(json.dumps({k: profile[k] for k in ("peak_flops", "hbm", "vector_flops",
                                              "collective_fit", "load_avg")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
