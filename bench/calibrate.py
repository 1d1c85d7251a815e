"""Calibrate the `cpu` hardware profile on this machine and write it for the predictor.

    python bench/calibrate.py [--out PATH]

Measures (median of repeated timed calls after a warm-up): the host's matmul FLOP/s per
operand dtype (f32; bf16 with f32 accumulation) over the dots of the `small` model's
step on fsdp8 (remat full, the training CLI's batch and sequence), every distinct dot
timed in the layout XLA:CPU's dot library takes with all 8 devices at once
(engine/cost/microbench.py `dot_seconds`): the step's FLOPs over their measured seconds,
the rate that prices matmuls; the rate of the copies that lay a dot operand out in that
layout (`relayout_bw`: a bf16 [4096, 512] transpose copy on each of the 8 devices at
once, `microbench.relayout_bandwidth`, summed over them); beside the dots, plain matmuls
on one device alone (`matmul_measured`: two of the step's shapes, not used in pricing,
and 2048^3; the best rate is the MFU peak); the host's memory
bandwidth, as the sum over the 8 devices of a fused `1.5 * x + y` each streams at once
(engine/cost/microbench.py `bandwidth`), on arrays the cache holds together (`hbm`:
the 8 devices' arrays 1/8 of the last-level cache in all) and on arrays half that
cache's size each (`hbm_cold`: the rate of a scan's stacked inputs and outputs, five
passes less one, `microbench.cold_bandwidth`, so the first touch of fresh pages stays in
`fault_cost`; beside
it, not used in pricing, `hbm_cold_scan`: that rate measured on a scan's stack itself,
`microbench.stacking_bandwidth`, 1 MiB per slice), with freed
memory kept in the process as the training step runs (engine/run/host.py); elementwise FLOP/s of
arithmetic (`vector_flops`: 32 multiply-adds an element, one fused loop) and exponentials
per second (`transcendental_flops`: one an element a pass), one device; and all-gather / reduce-scatter /
all-reduce / ppermute time vs bytes on the forced 8-device mesh, fitted to
`t = latency * hops + ring_fraction * bytes / bandwidth` (engine/cost/price.py); and
what a collective run beside compute adds to it, over its own time (`beside_cost`:
a layer's matmuls and a weight all-gather alone and in one program); and what first
touching freshly mapped memory costs a byte (`fault_cost`: the kernel's page faults, the
price of a step's temporaries mapped anew each step, engine/run/host.py).
`bench/roofline.py` re-measures the rates its step needs in the same run
(engine/cost/microbench.py); this file is the profile for `--predict-only --hardware cpu`.
"""
from __future__ import annotations

import argparse
import json
import os
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

from engine.cli.args import keep_freed_memory  # noqa: E402
from engine.config import TrainConfig, model_config  # noqa: E402
from engine.cost.calibration import CALIBRATION_PATH  # noqa: E402
from engine.cost.ledger import step_ledger  # noqa: E402
from engine.cost.microbench import (  # noqa: E402
    arithmetic_chain,
    bandwidth,
    cold_bandwidth,
    dot_seconds,
    exp_pass,
    fault_cost,
    last_level_cache,
    relayout_bandwidth,
    stacking_bandwidth,
    timed,
)
from engine.cost.microbench_comm import beside_cost, collective_times, fit  # noqa: E402
from engine.parallel.layout import Layout  # noqa: E402


def matmul_flops(m: int, k: int, n: int, dtype) -> float:
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * m * k * n / timed(f, a, b, reps=7)


def step_matmul_rate(mesh: Mesh, dtype: str) -> float:
    """FLOP/s of the host over the matmuls of the `small` model's step on fsdp over every
    device of `mesh` in `dtype` ("f32" | "bf16"), remat full: each distinct dot timed in
    the layout XLA:CPU's dot library takes, every device running it at once
    (`dot_seconds`; the operand copies into it are priced apart, `relayout_bw`), the
    step's dot FLOPs over their summed seconds, times the device count (the profile's devices then share the
    rate: a shared host's per-device time is multiplied by the device count). The step's
    own dots include what plain matmuls miss: the attention's batched [B, H] score and
    value dots."""
    cfg = model_config("small", dtype=dtype, remat="full")
    rows = step_ledger(cfg, TrainConfig(), Layout.parse(f"fsdp{mesh.size}"), pack=True)
    seconds = dot_seconds(rows, mesh)
    dots = [r for r in rows if r.dot in seconds]
    return mesh.size * sum(r.flops * r.count for r in dots) / sum(
        seconds[r.dot] * r.count for r in dots)


def host_bandwidth(mesh: Mesh, elems: int, k: int) -> float:
    """Bytes/s of the host: the per-device rate with every device of `mesh` streaming
    `elems`-element f32 arrays at once, times the device count (the profile's devices
    then share it: engine/cost/price.py multiplies a shared host's per-device time)."""
    return mesh.size * bandwidth(mesh, elems, k)


def vector_flops(n: int = 1 << 18) -> float:
    """Elementwise arithmetic FLOP/s of one device: 32 multiply-adds an element."""
    return 64 * n / timed(jax.jit(arithmetic_chain), jnp.ones(n, jnp.float32), reps=7)


def transcendental_flops(n: int = 1 << 18, k: int = 16) -> float:
    """Exponentials per second of one device: k passes of one an element."""
    passes = jax.jit(lambda x: jax.lax.fori_loop(0, k, lambda _, y: exp_pass(y), x))
    return k * n / timed(passes, jnp.ones(n, jnp.float32), reps=7)


# the figures the summary prints, with their unit
SHOWN = {"peak_flops": "FLOP/s", "mfu_peak": "FLOP/s", "hbm": "B/s", "hbm_cold": "B/s",
         "relayout_bw": "B/s", "vector_flops": "FLOP/s", "transcendental_flops": "exp/s",
         "collective_fit": "", "beside_cost": "of a collective's time",
         "fault_cost": "s/B"}


def _figure(x) -> str:
    if isinstance(x, dict):
        return ", ".join(f"{k} {_figure(v)}" for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return " ".join(_figure(v) for v in x)
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def summary(profile: dict) -> list[str]:
    """One line per headline figure of the profile (`SHOWN`): the file holds the rest."""
    return [f"{name:<21} {_figure(profile[name])} {unit}".rstrip()
            for name, unit in SHOWN.items() if name in profile]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(CALIBRATION_PATH))
    args = p.parse_args(argv)
    keep_freed_memory()
    shapes = {"small_mlp": (4096, 256, 768), "small_qkv": (4096, 256, 256), "cube": (2048,) * 3}
    measured = {f"{name}/{dt}": matmul_flops(*shape, dtype)
                for name, shape in shapes.items()
                for dt, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
    # MFU peak: the large matmul, the best rate a matmul reaches (engine/run/mfu.py's
    # measurement for the training CLI)
    mfu_peak = {dt: max(v for k, v in measured.items() if k.endswith(dt))
                for dt in ("float32", "bfloat16")}
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    # pricing rate: what the step's own dots reach with every device at once
    peak = {"float32": step_matmul_rate(mesh, "f32"), "bfloat16": step_matmul_rate(mesh, "bf16")}
    warm = last_level_cache() // (16 * 4 * mesh.size)  # two arrays per device: 1/8 of it in all
    points = collective_times(mesh, [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22])
    profile = {
        "peak_flops": peak, "mfu_peak": mfu_peak, "matmul_measured": measured,
        "hbm": host_bandwidth(mesh, warm, k=20),
        "hbm_cold": mesh.size * cold_bandwidth(mesh),
        "hbm_cold_scan": mesh.size * stacking_bandwidth(mesh, 1 << 18),
        "vector_flops": vector_flops(), "transcendental_flops": transcendental_flops(),
        "collective_fit": {k: fit(k, v, mesh.size) for k, v in points.items()},
        "beside_cost": beside_cost(mesh), "fault_cost": fault_cost(),
        "relayout_bw": mesh.size * relayout_bandwidth(mesh),
        "collective_points": points,
        "when": time.strftime("%Y-%m-%d %H:%M"), "load_avg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    for line in summary(profile):
        print(line)
    print(f"wrote {args.out} (every figure, with the collectives' measured points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
