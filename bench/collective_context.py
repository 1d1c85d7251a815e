"""What an all-reduce costs between the compute that feeds it and the compute that reads
it, against its time alone, on the forced host devices.

    python bench/collective_context.py
    python bench/collective_context.py --rows 256 2048 --chain 40 --rounds 7

Timed alone, every device arrives at a collective at once. In a step, each device's
operand is the output of its own compute, and on shared cores the devices reach the
collective at different times. So the cost model times a CPU all-reduce in a chain like
the last one below (`engine.cost.microbench_comm.in_chain_seconds`), and the other kinds
alone (`microbench_comm.group_collective_seconds`). This compiles three programs over all
devices, each a chain of `--chain` links on a per-device x [R, W] in f32 (w [W, W],
`microbench_comm.chain_program`):

- compute: x = tanh(x @ w);
- sync: the same, then x + all_reduce(x[0, 0]) * 0 (a sync, no bytes to speak of);
- all-reduce: the same, then all_reduce(x) / n (R·W·4 bytes a device).

They are timed in turn, one call each a round (a slow spell falls on all three), and
each link's extra seconds are the median over rounds of (program - compute) / chain.
Printed per R: the all-reduce alone (`microbench_comm.collective_run`),
the sync's and the all-reduce's extra seconds a link, the all-reduce's over its time
alone, and the cores the all-reduce chain kept busy (process CPU time over wall time).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import force_host_devices  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/collective_context.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="forced host devices (default: 8)")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 2048], metavar="R",
                   help="rows of each device's activation (default: 256 2048)")
    p.add_argument("--width", type=int, default=512, metavar="W", help="(default: 512)")
    p.add_argument("--chain", type=int, default=40, help="links per program (default: 40)")
    p.add_argument("--rounds", type=int, default=7, help="calls of each program (default: 7)")
    return p


def programs(mesh, chain: int):
    """{name: jitted shard_map of a chain of `chain` links} (module docstring)."""
    import collectives
    from engine.cost.microbench_comm import chain_program

    n = mesh.size
    links = {
        "compute": lambda y: y,
        "sync": lambda y: y + collectives.all_reduce(y[0, 0], "d") * 0,
        "all-reduce": lambda y: collectives.all_reduce(y, "d") / n,
    }
    return {name: chain_program(mesh, link, chain) for name, link in links.items()}


def timed(f, *args) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    import jax

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    jax.block_until_ready(f(*args))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def measure(mesh, rows: int, width: int, chain: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from engine.cost import microbench_comm

    fs = programs(mesh, chain)
    x = jax.device_put(jnp.full((mesh.size * rows, width), 1 / width, jnp.float32),
                       NamedSharding(mesh, P("d")))
    w = jax.device_put(jnp.full((width, width), 1 / width, jnp.float32),
                       NamedSharding(mesh, P()))
    for f in fs.values():
        jax.block_until_ready(f(x, w))
    runs = {name: [] for name in fs}
    for _ in range(rounds):
        for name, f in fs.items():
            runs[name].append(timed(f, x, w))
    extra = {name: statistics.median((t - c[0]) / chain for (t, _), c in
                                     zip(runs[name], runs["compute"]))
             for name in ("sync", "all-reduce")}
    grid = Mesh(np.array(mesh.devices).reshape(1, mesh.size), ("r", "d"))
    alone = microbench_comm.collective_run("all-reduce", grid, ("r", "d"), rows * width,
                                      jnp.float32, reps=5)
    cores = statistics.median(c / t for t, c in runs["all-reduce"])
    return dict(rows=rows, mib=rows * width * 4 / 2**20, alone=alone, **extra, cores=cores)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.devices - 1, *args.rows, args.width, args.chain, args.rounds) < 1:
        parser.error("--devices must be at least 2; --rows, --width, --chain and --rounds "
                     "at least 1")
    force_host_devices(args.devices)
    import jax
    from tabulate import tabulate

    mesh = jax.make_mesh((args.devices,), ("d",))
    print(f"{args.devices} devices; a link: [R, {args.width}] @ [{args.width}, "
          f"{args.width}] in f32, tanh; {args.chain} links; median over {args.rounds} rounds")
    rows = []
    for r in args.rows:
        m = measure(mesh, r, args.width, args.chain, args.rounds)
        rows.append([m["rows"], f"{m['mib']:.2f}", f"{m['alone'] * 1e3:.2f}",
                     f"{m['sync'] * 1e3:.2f}", f"{m['all-reduce'] * 1e3:.2f}",
                     f"{m['all-reduce'] / m['alone']:.2f}", f"{m['cores']:.2f}"])
    print(tabulate(rows, headers=["R", "MiB a device", "alone ms", "sync ms a link",
                                  "all-reduce ms a link", "in chain / alone",
                                  "cores busy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
