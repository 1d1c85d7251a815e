"""shardwise against a GSPMD build of the same model, measured side by side in one run.

    python bench/compare_gspmd.py
    python bench/compare_gspmd.py --presets small --layouts fsdp8 fsdp4xtp2 --steps 8

The GSPMD build runs the very same layer code (`layers/`) with no mesh axes, which makes
it plain math on global arrays, under `jax.jit` with only `NamedSharding` annotations:
params and optimizer state as the param table stores them, the batch over the batch
axes. XLA's SPMD partitioner then decides every collective. Both builds start from the
same params and batch, use the same optimizer (for GSPMD the plain global norm is
right, the arrays being global) and are timed one after the other in the same process.
Prints tokens/s, their ratio, compile time, per-device temp and argument memory
(`memory_analysis`), collective count and bytes per step from each compiled HLO, and
the first step's loss of each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.parallel.validate import ATTENTIONS  # noqa: E402 (imports jax; no backend started)
from layers.block import REMAT_MODES  # noqa: E402

LAYOUTS = ["single", "fsdp8", "tp8", "fsdp4xtp2", "dp2xfsdp2xtp2"]


def gspmd_step(trainer):
    """The train step as one GSPMD program over the trainer's mesh and param table."""
    import jax
    import optax
    from jax.sharding import NamedSharding

    from engine.parallel.grads import clip_by_norm
    from engine.parallel.params import fsdp_dims
    from layers import model
    from layers.axes import Axes

    cfg, tcfg, mesh, dims = trainer.cfg, trainer.tcfg, trainer.mesh, fsdp_dims()

    def step(params, opt_state, tokens_BL):
        loss, grads = jax.value_and_grad(model.loss)(params, tokens_BL[:, :-1], tokens_BL[:, 1:],
                                                     dims, cfg, Axes())
        grad_norm = optax.global_norm(grads)
        grads = clip_by_norm(grads, grad_norm, tcfg.clip_norm)
        updates, opt_state = trainer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss,
                                                                  "grad_norm": grad_norm}

    named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state = (named(trainer.specs), named(trainer.opt_specs))
    return jax.jit(step, in_shardings=(*state, NamedSharding(mesh, trainer.batch_spec)),
                   out_shardings=(*state, None), donate_argnums=(0, 1))


def measure(step_fn, trainer, tokens, steps: int) -> dict:
    """Compile, then time `steps` steps after one warm-up; figures of the compiled step."""
    import jax

    from bench.timing import time_steps
    from engine.cost.hlo import collectives

    params, opt_state = trainer.init(trainer.tcfg.seed)
    t0 = time.perf_counter()
    compiled = step_fn.lower(params, opt_state, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    colls = collectives(compiled.as_text())
    step_s, _, _, first = time_steps(compiled, params, opt_state, tokens, steps)
    first_loss = float(jax.device_get(first["loss"]))
    n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)  # tokens: [B, L+1]
    return dict(tokens_per_s=n_tokens / step_s, step_s=step_s,
                compile_s=compile_s, loss=first_loss,
                temp_mib=mem.temp_size_in_bytes / 2**20,
                args_mib=mem.argument_size_in_bytes / 2**20,
                n_coll=sum(c.count for c in colls),
                coll_mib=sum(c.bytes * c.count for c in colls) / 2**20)


def compare(preset: str, layout_text: str, args) -> list:
    from engine.config import TrainConfig, model_config
    from engine.parallel.layout import Layout
    from engine.run.data import synthetic_tokens
    from engine.run.step import Trainer

    cfg = model_config(preset, dtype=args.dtype, remat=args.remat, attention=args.attention)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq)
    layout = Layout.parse(layout_text)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh())
    tokens = trainer.put_batch(synthetic_tokens(0, 0, tcfg.batch, tcfg.seq, cfg.vocab))
    sw = measure(trainer.train_step, trainer, tokens, args.steps)
    gs = measure(gspmd_step(trainer), trainer, tokens, args.steps)
    return [preset, layout_text,
            f"{sw['tokens_per_s']:,.0f}", f"{gs['tokens_per_s']:,.0f}",
            f"{sw['tokens_per_s'] / gs['tokens_per_s']:.2f}",
            f"{sw['compile_s']:.1f} / {gs['compile_s']:.1f}",
            f"{sw['temp_mib']:.0f} / {gs['temp_mib']:.0f}",
            f"{sw['args_mib']:.1f} / {gs['args_mib']:.1f}",
            f"{sw['n_coll']} / {gs['n_coll']}",
            f"{sw['coll_mib']:.1f} / {gs['coll_mib']:.1f}",
            f"{abs(sw['loss'] - gs['loss']) / abs(gs['loss']):.1e}"]


def settings_problems(args) -> list[str]:
    """`engine.parallel.validate`'s problems of every (preset, layout) asked for, each prefixed."""
    from engine.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, model_config
    from engine.parallel import validate
    from engine.parallel.layout import Layout

    problems = [f"unknown preset {p!r}" for p in args.presets if p not in PRESETS]
    tcfg = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps)
    for preset in (p for p in args.presets if p in PRESETS):
        cfg = model_config(preset, dtype=args.dtype, remat=args.remat, attention=args.attention)
        for text in args.layouts:
            try:
                found = validate.problems(cfg, tcfg, ParallelConfig(), Layout.parse(text))
            except ConfigError as e:
                found = [str(e)]
            problems += [f"{preset} {text}: {p}" for p in found]
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/compare_gspmd.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["small", "medium"])
    p.add_argument("--layouts", nargs="+", default=LAYOUTS)
    p.add_argument("--steps", type=int, default=5, help="timed steps per build (median)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    p.add_argument("--remat", default="full", choices=REMAT_MODES)
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="attention kernel of both builds (the CLI's --attention)")
    args = p.parse_args(argv)
    if problems := settings_problems(args):
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    from tabulate import tabulate

    from engine.cli.args import keep_freed_memory

    keep_freed_memory()
    rows = []
    for preset in args.presets:
        for layout in args.layouts:
            rows.append(compare(preset, layout, args))
            print(f"done {preset} {layout}", file=sys.stderr, flush=True)
    print(f"{args.dtype} compute, remat {args.remat}, {args.attention} attention, batch {args.batch} x seq {args.seq}; "
          f"median of {args.steps} steps; pairs are shardwise / GSPMD")
    print(tabulate(rows, headers=["preset", "layout", "shardwise tok/s", "GSPMD tok/s", "ratio",
                                  "compile s", "temp MiB", "args MiB", "collectives",
                                  "coll MiB/step", "loss diff"],
                   colalign=("left", "left") + ("right",) * 9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
