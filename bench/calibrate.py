"""Calibrate the `cpu` hardware profile on this machine and write it for the predictor.

    python bench/calibrate.py [--out PATH]

Measures (median of repeated timed calls after a warm-up): matmul FLOP/s per operand
dtype (f32; bf16 with f32 accumulation) on the shapes the `small` model runs (their
median prices matmuls) and on 2048^3 (the best rate is the MFU peak); memory bandwidth (a fused `a * x + y` on 64 MiB arrays); elementwise FLOP/s (a
chain of exp/mul/add on a cache-resident array); and all-gather / reduce-scatter /
all-reduce / ppermute time vs bytes on the forced 8-device mesh, fitted to
`t = latency * hops + ring_fraction * bytes / bandwidth` (engine/cost/price.py).
`bench/roofline.py` re-measures the rates its step needs in the same run
(engine/cost/microbench.py); this file is the profile for `--predict-only --hardware cpu`.
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
from jax.sharding import Mesh  # noqa: E402

from engine.cost.hardware import CALIBRATION_PATH  # noqa: E402
from engine.cost.microbench import call_overhead, collective_times, fit, timed  # noqa: E402


def matmul_flops(m: int, k: int, n: int, dtype) -> float:
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * m * k * n / timed(f, a, b, reps=7)


def memory_bandwidth(n_bytes: int = 64 << 20) -> float:
    x = jnp.ones(n_bytes // 4, jnp.float32)
    f = jax.jit(lambda x, y: 1.5 * x + y)
    return 3 * n_bytes / timed(f, x, x, reps=7)


def vector_flops(n: int = 1 << 18, depth: int = 16) -> float:
    def chain(x):
        for _ in range(depth):
            x = jnp.exp(-x * x) + 0.5
        return x
    return 4 * depth * n / timed(jax.jit(chain), jnp.ones(n, jnp.float32), reps=7)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(CALIBRATION_PATH))
    args = p.parse_args(argv)
    shapes = {"small_mlp": (4096, 256, 768), "small_qkv": (4096, 256, 256), "cube": (2048,) * 3}
    measured = {f"{name}/{dt}": matmul_flops(*shape, dtype)
                for name, shape in shapes.items()
                for dt, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
    # pricing rate: what the step's own shapes reach; MFU peak: the large matmul, the
    # best rate a matmul reaches (engine/mfu.py's measurement for the training CLI)
    peak = {dt: statistics.median(v for k, v in measured.items() if k.endswith(dt)
                                  and not k.startswith("cube")) for dt in ("float32", "bfloat16")}
    mfu_peak = {dt: max(v for k, v in measured.items() if k.endswith(dt))
                for dt in ("float32", "bfloat16")}
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    points = collective_times(mesh, [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22],
                              overhead=call_overhead(mesh))
    profile = {
        "peak_flops": peak, "mfu_peak": mfu_peak, "matmul_measured": measured,
        "hbm": memory_bandwidth(), "vector_flops": vector_flops(),
        "collective_fit": {k: fit(k, v, mesh.size) for k, v in points.items()},
        "collective_points": points,
        "when": time.strftime("%Y-%m-%d %H:%M"), "load_avg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    print(json.dumps({k: profile[k] for k in ("peak_flops", "mfu_peak", "hbm", "vector_flops",
                                              "collective_fit", "load_avg")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
