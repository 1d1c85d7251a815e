"""Mixture of experts: the ep layouts side by side, and the expert matmul choice.

    nice python bench/moe.py --layouts ep8 ep4xfsdp2 fsdp8 --model moe-small --steps 3
    nice python bench/moe.py --matmuls --tokens 4096 --experts 8 --top-k 2

Layouts: one row per layout of `moe-small` (or `--model`): tokens/s (median of `--steps`
steps after a warm-up, bench/timing.py) and the compiled step's peak memory per device
(`memory_analysis()`: arguments + temp + unaliased outputs, engine/cost/memory.py's
`measure`). Under fsdp8 the experts are replicated over the batch axis and gathered
over fsdp like every weight; under ep they are sharded and the tokens move.

Matmuls: the experts' three matmuls forward + backward on A = tokens*top_k routed rows
(uniformly random experts), as layers/moe.py could run them: padded dense einsums on an
[E, T, D] buffer (every expert's worst case, dropless) against `jax.lax.ragged_dot` on
the rows sorted by expert. Median of `--reps` calls after one warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_fn(f, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmuls(T: int, E: int, K: int, D: int, F: int, reps: int) -> None:
    import jax
    import jax.numpy as jnp

    dt = jnp.bfloat16
    key = jax.random.key(0)
    kx, kg, ku, kd, ke = jax.random.split(key, 5)
    x_AD = jax.random.normal(kx, (T * K, D), jnp.float32).astype(dt)
    w = {n: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dt)
         for n, k, s in (("g", kg, (E, D, F)), ("u", ku, (E, D, F)), ("d", kd, (E, F, D)))}
    e_A = jax.random.randint(ke, (T * K,), 0, E)

    def ragged(x_AD, w, e_A):
        order = jnp.argsort(e_A)
        sizes_E = jnp.bincount(e_A, length=E).astype(jnp.int32)
        dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes_E, preferred_element_type=jnp.float32)
        xs = x_AD[order]
        h = (jax.nn.silu(dot(xs, w["g"])) * dot(xs, w["u"])).astype(dt)
        return jnp.zeros((T * K, D), jnp.float32).at[order].set(dot(h, w["d"]))

    def padded(x_AD, w, e_A):
        oh_AE = jax.nn.one_hot(e_A, E, dtype=jnp.int32)
        row_A = jnp.sum((jnp.cumsum(oh_AE, 0) - 1) * oh_AE, 1)
        buf_ETD = jnp.zeros((E, T, D), dt).at[e_A, row_A].set(x_AD)
        mm = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(mm("ETD,EDF->ETF", buf_ETD, w["g"]))
             * mm("ETD,EDF->ETF", buf_ETD, w["u"])).astype(dt)
        return mm("ETF,EFD->ETD", h, w["d"])[e_A, row_A]

    print(f"expert matmuls, T={T} K={K} E={E} D={D} F={F} bf16, median of {reps}:")
    for name, f in (("padded einsum", padded), ("ragged_dot", ragged)):
        fwd = jax.jit(f)
        both = jax.jit(jax.grad(lambda x, w, e: jnp.sum(f(x, w, e) ** 2), (0, 1)))
        print(f"  {name:14s} fwd {time_fn(fwd, x_AD, w, e_A, reps=reps) * 1e3:8.1f} ms   "
              f"fwd+bwd {time_fn(both, x_AD, w, e_A, reps=reps) * 1e3:8.1f} ms")


def layouts(names, model: str, batch: int, seq: int, steps: int) -> None:
    import jax

    from bench.timing import compiled_step, time_steps
    from engine.config import TrainConfig, model_config
    from engine.cost.memory import measure
    from engine.parallel.layout import Layout
    from engine.run.step import Trainer

    cfg = model_config(model)
    tcfg = TrainConfig(batch=batch, seq=seq, steps=steps)
    print(f"{model} (E={cfg.experts} top-{cfg.top_k}, bf16, remat full), batch {batch} x "
          f"seq {seq}, median of {steps} steps:")
    print(f"  {'layout':14s} {'tokens/s':>10s} {'peak MiB/device':>16s}")
    for name in names:
        lay = Layout.parse(name)
        trainer = Trainer(cfg, tcfg, lay, lay.mesh())
        step, params, opt_state, tokens, _ = compiled_step(trainer)
        peak = measure(step)["peak"]
        median, *_ = time_steps(step, params, opt_state, tokens, steps)
        print(f"  {name:14s} {batch * seq / median:10,.0f} {peak / 2**20:16.1f}")
        del step, params, opt_state
        jax.clear_caches()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matmuls", action="store_true", help="padded einsum vs ragged_dot")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--mlp-dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layouts", nargs="*", default=["ep8", "ep4xfsdp2", "fsdp8"])
    p.add_argument("--model", default="moe-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.matmuls:
        matmuls(args.tokens, args.experts, args.top_k, args.d_model, args.mlp_dim, args.reps)
        return
    from engine.cli.args import force_host_devices, keep_freed_memory

    force_host_devices(8)
    keep_freed_memory()
    layouts(args.layouts, args.model, args.batch, args.seq, args.steps)


if __name__ == "__main__":
    main()
