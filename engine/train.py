"""`python -m engine.train --layout fsdp4xtp2`: train a decoder-only transformer with
explicit FSDP + Megatron TP, one jit(shard_map) per step.

On a CPU-only machine the CLI forces as many host devices as the layout needs before
jax is imported. Bad input exits 2 with one line on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from engine.config import ATTENTIONS, PRESETS, TrainConfig, config_problems, model_config
from engine.layout import Layout, LayoutError
from layers.config import DTYPES, REMAT


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.train", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layout", default="single",
                   help="mesh axes outermost first with sizes: single, dp8, fsdp8, tp8, "
                        "fsdp4xtp2, dp2xfsdp2xtp2, ...")
    m = p.add_argument_group("model (a preset, then any dimension overridden)")
    m.add_argument("--model", default="small", choices=sorted(PRESETS))
    for flag, field, what in [("--d-model", "d_model", "D"), ("--layers", "n_layers", "N"),
                              ("--heads", "n_heads", "H"), ("--kv-heads", "n_kv_heads", "G"),
                              ("--head-dim", "head_dim", "K"), ("--mlp-dim", "mlp_dim", "F"),
                              ("--vocab", "vocab", "V")]:
        m.add_argument(flag, dest=field, type=int, default=None, help=f"override {what}")
    m.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="compute dtype of matmuls (params and optimizer state are f32)")
    m.add_argument("--remat", default="full", choices=REMAT,
                   help="what the backward recomputes (see layers/block.py)")
    m.add_argument("--attention", default="reference", choices=ATTENTIONS)
    t = p.add_argument_group("training")
    d = TrainConfig()
    t.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    t.add_argument("--batch", type=int, default=d.batch, help="global sequences per step")
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    t.add_argument("--seed", type=int, default=d.seed)
    o = p.add_argument_group("output")
    o.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    o.add_argument("--metrics-file", default=None, help="JSONL, one object per step")
    o.add_argument("--peak-flops", type=float, default=None,
                   help="MFU denominator in FLOP/s (default: spec sheet, or a matmul "
                        "measured at start-up on CPU)")
    return p


def parse(argv) -> tuple:
    """argv -> (ModelConfig, TrainConfig, Layout, args); raises UsageError/LayoutError."""
    args = build_parser().parse_args(argv)
    cfg = model_config(args.model, **{k: getattr(args, k) for k in (
        "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab")},
        dtype=args.dtype, remat=args.remat, attention=args.attention)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
                       warmup=args.warmup, seed=args.seed)
    problems = config_problems(cfg, tcfg)
    if args.log_every < 1:
        problems.append(f"log_every={args.log_every} must be >= 1")
    if problems:
        raise UsageError("; ".join(problems))
    layout = Layout.parse(args.layout)
    layout.check(cfg, tcfg.batch)
    return cfg, tcfg, layout, args


def force_host_devices(n: int) -> None:
    """Ask XLA's CPU backend for n devices unless the user already chose a count.
    Must run before jax is imported; harmless on accelerators (only the host backend)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def run(cfg, tcfg, layout, args) -> int:
    import jax
    import numpy as np

    from engine import mfu
    from engine.data import synthetic_tokens
    from engine.optim import schedule
    from engine.params import param_count
    from engine.step import Trainer

    mesh = layout.mesh()
    trainer = Trainer(cfg, tcfg, layout, mesh)
    devices = list(mesh.devices.flat)
    if args.peak_flops:
        peak, peak_src = args.peak_flops, "--peak-flops"
    else:
        peak, peak_src = mfu.peak_flops(cfg.compute_dtype, devices)
    tokens_per_step = tcfg.batch * tcfg.seq
    flops_per_step = mfu.flops_per_token(cfg, tcfg.seq) * tokens_per_step
    print(f"layout {layout} on {len(devices)} {devices[0].platform} device(s); "
          f"model {args.model} ({param_count(cfg) / 1e6:.2f}M params, D={cfg.d_model} "
          f"N={cfg.n_layers} H={cfg.n_heads} G={cfg.n_kv_heads} K={cfg.head_dim} "
          f"F={cfg.mlp_dim} V={cfg.vocab}); {cfg.dtype} compute, remat {cfg.remat}, "
          f"{cfg.attention} attention; {tokens_per_step} tokens/step; "
          f"peak {peak / 1e12:.2f} TFLOP/s ({peak_src})", flush=True)

    params, opt_state = trainer.init(tcfg.seed)
    batch = lambda step: trainer.put_batch(
        synthetic_tokens(tcfg.seed, step, tcfg.batch, tcfg.seq, cfg.vocab))
    t0 = time.perf_counter()
    step_fn = trainer.train_step.lower(params, opt_state, batch(0)).compile()
    print(f"compiled the step in {time.perf_counter() - t0:.1f} s", flush=True)

    lr_at = schedule(tcfg)
    metrics_file = open(args.metrics_file, "w") if args.metrics_file else None
    window_t, window_n = 0.0, 0
    try:
        for step in range(tcfg.steps):
            tokens = batch(step)
            t0 = time.perf_counter()
            params, opt_state, metrics = step_fn(params, opt_state, tokens)
            loss, grad_norm = (float(v) for v in jax.device_get((metrics["loss"],
                                                                 metrics["grad_norm"])))
            dt = time.perf_counter() - t0
            window_t, window_n = window_t + dt, window_n + 1
            if not math.isfinite(loss):
                print(f"error: loss is {loss} at step {step + 1}; stopping", file=sys.stderr)
                return 1
            record = dict(step=step + 1, loss=loss, grad_norm=grad_norm,
                          lr=float(lr_at(step)), tokens_per_s=tokens_per_step / dt,
                          step_time_s=dt, mfu=flops_per_step / dt / peak)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if (step + 1) % args.log_every == 0 or step + 1 == tcfg.steps:
                avg = window_t / window_n
                print(f"step {step + 1:>5}/{tcfg.steps} | loss {loss:.4f} | grad norm "
                      f"{grad_norm:.3f} | lr {record['lr']:.2e} | "
                      f"{tokens_per_step / avg:,.0f} tok/s | {avg * 1e3:.0f} ms/step | "
                      f"MFU {100 * flops_per_step / avg / peak:.1f}%", flush=True)
                window_t, window_n = 0.0, 0
    except KeyboardInterrupt:
        print(f"interrupted after step {step}", file=sys.stderr)
        return 130
    finally:
        if metrics_file:
            metrics_file.close()
    return 0


def main(argv=None) -> int:
    try:
        cfg, tcfg, layout, args = parse(sys.argv[1:] if argv is None else argv)
        force_host_devices(layout.size)
        return run(cfg, tcfg, layout, args)
    except (UsageError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
