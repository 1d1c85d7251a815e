"""`python -m engine.train --layout fsdp4xtp2`: train a decoder-only transformer with
explicit FSDP + Megatron TP, one jit(shard_map) per step.

On a CPU-only machine the CLI forces as many host devices as the layout needs before
jax is imported (layout size / processes, with several processes). Bad input exits 2
with one line on stderr. Several processes (`--coordinator`, or a cluster's environment,
see engine/run/distributed.py) run one program over all their devices; process 0 prints and
writes the metrics file.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from engine.cli import config_file
from engine.cli.args import (
    LIMITS,
    UsageError,
    check_output_file,
    force_host_devices,
    keep_freed_memory,
    parse,
)
from engine.config import ConfigError, ParallelConfig
from engine.cost import profile
from engine.run import distributed
from engine.run.data import DataError, data_problems, load_data


def moe_summary(cfg) -> str:
    """` E=8 top-2 S=1 dropless` (or `capacity 1.25`) for a mixture of experts, else empty."""
    if not cfg.moe:
        return ""
    drops = f"capacity {cfg.capacity_factor:g}" if cfg.capacity_factor > 0 else "dropless"
    return f" E={cfg.experts} top-{cfg.top_k} S={cfg.shared_experts} {drops}"


def load_checked_data(cfg, tcfg, args):
    """--data loaded and checked against the model and sequence length (no jax needed)."""
    data = load_data(args.data, cfg.vocab, args.data_dtype)
    problems = data_problems(data, tcfg.seq, cfg.vocab, need_val=args.eval_every is not None,
                             vocab_limit=LIMITS["vocab"])
    if problems:
        raise DataError("; ".join(problems))
    return data


def run(cfg, tcfg, parallel, layout, args) -> int:
    """Train; returns the exit code. Data and checkpoints are checked before compiling."""
    from engine.run.checkpoint import CheckpointError

    data = load_checked_data(cfg, tcfg, args)
    distributed.initialize(args)
    keep_freed_memory()  # after initialize: it asks jax for the backend
    try:
        return _train(cfg, tcfg, parallel, layout, args, data)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _by_processes(ckpt) -> str:
    n = ckpt.meta.get("processes", 1)
    return f" by {n} processes" if n > 1 else ""


def _open_checkpoints(cfg, args, say=print):
    """The checkpoint to resume from (or None), after checking the directory."""
    from engine.run import checkpoint

    if not args.checkpoint_dir:
        return None
    directory = args.checkpoint_dir
    found = checkpoint.list_checkpoints(directory)
    if found and not args.resume:
        raise UsageError(f"{directory} already holds checkpoints up to step {found[-1][0]}; "
                         f"pass --resume to continue, or choose another --checkpoint-dir")
    checkpoint.check_writable(directory)
    ckpt = checkpoint.latest(directory, lazy=True) if args.resume else None
    if args.resume and ckpt is None:
        say(f"no checkpoint in {directory} yet; starting from step 0")
    if ckpt is not None:
        checkpoint.check_model(ckpt, cfg)
    return ckpt


def _settings_changed(ckpt, tcfg, args) -> list[str]:
    """Training settings that differ from the checkpoint's (allowed; they change the run)."""
    saved = dict(ckpt.meta.get("train", {}), data=ckpt.meta.get("data", {}).get("source"))
    now = dict(dataclasses.asdict(tcfg), data=args.data)
    return [f"{k}={now[k]} (checkpoint: {saved.get(k)})" for k in now
            if k in saved and now[k] != saved[k]]  # fields added since it was written: no note


def _check_memory(cfg, devices) -> None:
    """Refuse a model whose params, grads and Adam moments (4 f32 copies) exceed host RAM."""
    from engine.parallel.params import param_count

    need = 16 * param_count(cfg)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if devices[0].platform == "cpu" and need > have:
        raise UsageError(f"model needs {need / 2**30:.1f} GiB for params, grads and Adam state "
                         f"(16 bytes x {param_count(cfg):,} params); this host has "
                         f"{have / 2**30:.1f} GiB")


def setup(cfg, tcfg, parallel, layout, args, data, say):
    """Mesh, trainer, state (fresh or resumed) and the compiled step as an
    `engine.run.loop.Session`; None when the checkpoint already reached --steps."""
    import jax
    from jax.sharding import NamedSharding

    from engine.parallel.params import param_count
    from engine.run import checkpoint
    from engine.run.data import device_batch
    from engine.run.loop import Session
    from engine.run.step import Trainer
    from layers.attention import cp_kernel, resolve_attention

    ckpt = _open_checkpoints(cfg, args, say)
    mesh = layout.mesh()
    trainer = Trainer(cfg, tcfg, layout, mesh, parallel)
    devices = list(mesh.devices.flat)
    _check_memory(cfg, devices)
    peak, peak_src = _peak(cfg, args, devices)
    say("config: " + config_file.to_toml(config_file.resolved(args)).strip().replace("\n", ", "))
    kernel = (f"{cp_kernel(cfg.attention)} attention over cp ({parallel.cp_comm})"
              if layout.degree("cp") > 1 else
              f"{resolve_attention(cfg.attention, tcfg.seq)} attention")
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"layout {layout} on {len(devices)} {devices[0].platform} device(s){procs}; "
        f"model {args.model} ({param_count(cfg) / 1e6:.2f}M params, D={cfg.d_model} "
        f"N={cfg.n_layers} H={cfg.n_heads} G={cfg.n_kv_heads} K={cfg.head_dim} "
        f"F={cfg.mlp_dim} V={cfg.vocab}{moe_summary(cfg)}); {cfg.dtype} compute, "
        f"{cfg.activations} activations, remat {cfg.remat}, {kernel}; "
        f"{tcfg.batch * tcfg.seq} tokens/step; peak {peak / 1e12:.2f} TFLOP/s ({peak_src})")
    say(f"data {data.describe()}")
    if kernel.startswith("pallas") and devices[0].platform == "cpu":
        say("note: no accelerator, so the Pallas kernels run in interpret mode: the same "
            "kernel code, much slower")

    if ckpt is None:
        params, opt_state = trainer.init(tcfg.seed)
        start = 0
    else:
        params, opt_state = checkpoint.restore(ckpt, trainer)
        start = ckpt.step
        say(f"resumed from {ckpt.path} (step {start}, written under layout "
            f"{ckpt.meta.get('layout')}{_by_processes(ckpt)})")
        if changed := _settings_changed(ckpt, tcfg, args):
            say("note: resuming with different settings: " + ", ".join(changed))
    if start >= tcfg.steps:
        say(f"the checkpoint already reached step {start} >= --steps {tcfg.steps}; "
            f"nothing to train")
        return None
    sharding = NamedSharding(mesh, trainer.batch_spec)
    batch = lambda index, split="train": device_batch(data, sharding, tcfg.seed, index,
                                                      tcfg.batch, tcfg.seq, split)
    t0 = time.perf_counter()
    step_fn = trainer.train_step.lower(params, opt_state, batch(start)).compile()
    say(f"compiled the step in {time.perf_counter() - t0:.1f} s")
    return Session(trainer, step_fn, params, opt_state, batch, start, tcfg.steps, peak)


def _peak(cfg, args, devices) -> tuple[float, str]:
    """The MFU denominator and where it came from."""
    if args.peak_flops:
        return args.peak_flops, "--peak-flops"
    return distributed.peak_flops(cfg.compute_dtype, devices)


def _train(cfg, tcfg, parallel, layout, args, data) -> int:
    """setup, then the loop with the hooks the flags ask for."""
    from engine.run.loop import Checkpoints, Evaluate, Log, MetricsFile, Rates, loop
    from engine.run.preempt import Preemption

    is_main = distributed.is_main()  # process 0 prints and writes the metrics file
    say = (lambda *a, **k: print(*a, **k, flush=True)) if is_main else (lambda *a, **k: None)
    if args.metrics_file and is_main:
        check_output_file(args.metrics_file, "--metrics-file")
    settings = config_file.resolved(args)
    session = setup(cfg, tcfg, parallel, layout, args, data, say)
    if session is None:
        return 0
    rates = Rates(cfg, tcfg, session.peak)
    hooks = [rates]
    if args.eval_every:
        hooks.append(Evaluate(args.eval_every, args.eval_batches, tcfg.steps))
    if args.metrics_file and is_main:
        hooks.append(MetricsFile(args.metrics_file, append=args.resume))
    if args.tensorboard and is_main:
        from engine.run.tensorboard import TensorBoard

        hooks.append(TensorBoard(args.tensorboard))
    hooks.append(Log(args.log_every, tcfg.steps, rates, say))
    if args.checkpoint_dir:
        meta = dict(rng=dict(seed=tcfg.seed), model=dataclasses.asdict(cfg),
                    train=dataclasses.asdict(tcfg), parallel=dataclasses.asdict(parallel),
                    layout=str(layout), data=dict(source=args.data, dtype=args.data_dtype),
                    config=settings)
        hooks.append(Checkpoints(args.checkpoint_dir, args.checkpoint_every, args.keep,
                                 tcfg.steps, meta, say, asynchronous=args.async_save,
                                 preemption=Preemption()))
    if args.profile_steps:
        hooks.append(profile.Profile(args.profile_steps, args.profile_dir, cfg, tcfg, layout,
                                     parallel, say))
    return loop(session, hooks, say)


def main(argv=None) -> int:
    try:
        cfg, tcfg, parallel, layout, args = parse(sys.argv[1:] if argv is None else argv,
                                                  auto=True)
        if layout is None:
            from engine.planner import search as plan

            force_host_devices(plan.AUTO_HOST_DEVICES)
            cfg, parallel, layout = plan.auto(
                cfg, tcfg, base=ParallelConfig(grad_reduce=parallel.grad_reduce))
        force_host_devices(layout.size // distributed.process_count(args))
        return run(cfg, tcfg, parallel, layout, args)
    except (UsageError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the loop (which reports its own): setup, compile
        print("interrupted before training started", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
