"""`python -m engine.train --layout fsdp4xtp2`: train a decoder-only transformer with
explicit FSDP + Megatron TP, one jit(shard_map) per step.

On a CPU-only machine the CLI forces as many host devices as the layout needs before
jax is imported (layout size / processes, with several processes). Bad input exits 2
with one line on stderr. Several processes (`--coordinator`, or a cluster's environment,
see engine/run/distributed.py) run one program over all their devices; process 0 prints and
writes the metrics file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

from engine.cli import config_file
from engine.cli.args import (
    LIMITS,
    UsageError,
    check_apart,
    check_host_memory,
    check_output_file,
    force_host_devices,
    keep_freed_memory,
    parse,
)
from engine.cli.given import auto_pins
from engine.cli.models import with_documents
from engine.config import ConfigError
from engine.cost import profile
from engine.run import distributed
from engine.run.data import DataError, data_problems, load_data
from engine.text.tokenizer import TokenizerError, load_tokenizer


def moe_summary(cfg) -> str:
    """` E=8 top-2 S=1 dropless` (or `capacity 1.25`) for a mixture of experts, else empty."""
    if not cfg.moe:
        return ""
    drops = f"capacity {cfg.capacity_factor:g}" if cfg.capacity_factor > 0 else "dropless"
    return f" E={cfg.experts} top-{cfg.top_k} S={cfg.shared_experts} {drops}"


def load_checked_tokenizer(cfg, args):
    """--tokenizer loaded (None when not given), its vocab checked against the model's."""
    if args.tokenizer is None:
        return None
    try:
        tok = load_tokenizer(args.tokenizer)
    except TokenizerError as e:
        raise UsageError(str(e)) from None
    if tok.vocab_size > cfg.vocab:
        raise UsageError(f"--tokenizer {args.tokenizer} has {tok.vocab_size:,} tokens but the "
                         f"model's vocab is {cfg.vocab:,} (need --vocab >= {tok.vocab_size})")
    return tok


def load_checked_data(cfg, tcfg, args):
    """--data loaded and checked against the model, the tokenizer and the sequence length
    (no jax needed)."""
    tok = load_checked_tokenizer(cfg, args)
    data = load_data(args.data, cfg.vocab, args.data_dtype, tok, args.text_field, args.errors)
    need_val = args.eval_every is not None or args.eval_only
    problems = data_problems(data, tcfg.seq, cfg.vocab, need_val=need_val,
                             vocab_limit=LIMITS["vocab"])
    if problems:
        raise DataError("; ".join(problems))
    return data


def run(cfg, tcfg, parallel, layout, args) -> int:
    """Train (or, with --eval-only, evaluate); returns the exit code. Data and
    checkpoints are checked before compiling."""
    from engine.run.checkpoint import CheckpointError

    data = load_checked_data(cfg, tcfg, args)
    # the data's end-of-document id (None: it has none) decides --document-mask auto
    cfg = with_documents(cfg, args, data.eos_id)
    distributed.initialize(args)
    keep_freed_memory()  # after initialize: it asks jax for the backend
    try:
        if args.eval_only:
            return _eval_only(cfg, tcfg, parallel, layout, args, data)
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
    if now["schedule_steps"] is None:  # the checkpoint's horizon: `_schedule_horizon` says so
        del now["schedule_steps"]
    return [f"{k}={now[k]} (checkpoint: {saved.get(k)})" for k in now
            if k in saved and now[k] != saved[k]]  # fields added since it was written: no note


def schedule_summary(parallel, layout) -> str:
    """`, pp schedule 1f1b over 8 microbatches` (or `, 4 microbatches accumulated` without
    pp), else empty."""
    m = parallel.microbatches
    if layout.degree("pp") > 1:
        chunks = (f" ({parallel.pp_virtual} chunks per device)"
                  if parallel.pp_schedule == "interleaved" else "")
        return f", pp schedule {parallel.pp_schedule}{chunks} over {m} microbatches"
    return f", {m} microbatches accumulated" if m > 1 else ""


def _schedule_horizon(ckpt, tcfg, say):
    """`tcfg` with the learning-rate schedule's horizon of the checkpoint's run when
    resuming without --lr-schedule-steps: more --steps continue the run at the
    schedule's floor instead of bending the schedule back up. A checkpoint with no
    optimizer state (a model imported by engine.convert) has no schedule to keep."""
    if ckpt is None or tcfg.schedule_steps is not None or ckpt.meta.get("optimizer") == "fresh":
        return tcfg
    saved = ckpt.meta.get("train", {})
    horizon = saved.get("schedule_steps") or saved.get("steps")
    if not horizon or horizon == tcfg.steps:
        return tcfg
    say(f"note: the learning-rate schedule keeps the checkpoint's horizon, step {horizon} "
        f"(--steps {tcfg.steps}); pass --lr-schedule-steps to set another")
    return dataclasses.replace(tcfg, schedule_steps=horizon)


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

    check_host_memory(cfg)
    ckpt = _open_checkpoints(cfg, args, say)
    asked, tcfg = tcfg, _schedule_horizon(ckpt, tcfg, say)
    mesh = layout.mesh()
    trainer = Trainer(cfg, tcfg, layout, mesh, parallel)
    devices = list(mesh.devices.flat)
    peak, peak_src = _peak(cfg, args, devices)
    say("config: " + config_file.to_toml(config_file.resolved(args)).strip().replace("\n", ", "))
    kernel = (f"{cp_kernel(cfg.attention)} attention over cp ({parallel.cp_comm})"
              if layout.degree("cp") > 1 else
              f"{resolve_attention(cfg.attention, tcfg.seq)} attention")
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"layout {layout} on {len(devices)} {devices[0].platform} device(s){procs}; "
        f"model {args.model_name} ({param_count(cfg) / 1e6:.2f}M params, D={cfg.d_model} "
        f"N={cfg.n_layers} H={cfg.n_heads} G={cfg.n_kv_heads} K={cfg.head_dim} "
        f"F={cfg.mlp_dim} V={cfg.vocab}{moe_summary(cfg)}); {cfg.dtype} compute, "
        f"{cfg.activations} activations, remat {cfg.remat}, {kernel}"
        f"{schedule_summary(parallel, layout)}; "
        f"{tcfg.batch * tcfg.seq} tokens/step; peak {peak / 1e12:.2f} TFLOP/s ({peak_src})")
    say(f"data {data.describe()}")
    if cfg.document_eos is not None:
        say(f"documents: end-of-document id {cfg.document_eos}; a token attends only to "
            f"its own document; RoPE positions "
            f"{'restart at each document' if cfg.document_positions else 'in the window'}")
    if kernel.startswith("pallas") and devices[0].platform == "cpu":
        say("note: no accelerator, so the Pallas kernels run in interpret mode: the same "
            "kernel code, much slower")

    if ckpt is None and args.init_from_hf:
        from engine.hf import convert

        params, opt_state = convert.init_params(args.init_from_hf, trainer)
        start = 0
        say(f"initialised from {args.init_from_hf} (fresh optimizer)")
    elif ckpt is None:
        params, opt_state = trainer.init(tcfg.seed)
        start = 0
    else:
        params, opt_state = checkpoint.restore(ckpt, trainer)
        start = ckpt.step
        say(f"resumed from {ckpt.path} (step {start}, written under layout "
            f"{ckpt.meta.get('layout')}{_by_processes(ckpt)})")
        if changed := _settings_changed(ckpt, asked, args):
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
    return Session(trainer, step_fn, params, opt_state, batch, start, tcfg.steps, peak, tcfg)


def _eval_only(cfg, tcfg, parallel, layout, args, data) -> int:
    """Evaluate the newest checkpoint of --checkpoint-dir: --eval-batches validation
    batches of --batch x --seq on --layout with its switches (--zero, --microbatches,
    --pp-schedule, ...); one line (and one metrics record)."""
    import json

    from jax.sharding import NamedSharding

    from engine.run import checkpoint
    from engine.run.data import device_batch
    from engine.run.loop import eval_summary, evaluate
    from engine.run.step import Trainer

    ckpt = checkpoint.latest(args.checkpoint_dir, parts=("params",))
    if ckpt is None:
        raise UsageError(f"no checkpoint in {args.checkpoint_dir} to evaluate")
    is_main = distributed.is_main()
    mesh = layout.mesh()
    trainer = Trainer(cfg, tcfg, layout, mesh, parallel)
    params = checkpoint.restore_params(ckpt, trainer)
    sharding = NamedSharding(mesh, trainer.batch_spec)
    batch = lambda index, split: device_batch(data, sharding, tcfg.seed, index, tcfg.batch,
                                              tcfg.seq, split)
    record = dict(step=ckpt.step, **evaluate(trainer.loss, params, batch, args.eval_batches,
                                             data.bytes_per_token))
    if is_main:
        print(f"checkpoint {ckpt.path} (step {ckpt.step}); data {data.describe()}; "
              f"{args.eval_batches} batches of {tcfg.batch}x{tcfg.seq} tokens", flush=True)
        print(f"eval {ckpt.step:>5} | {eval_summary(record)}", flush=True)
        if args.metrics_file:
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


def _peak(cfg, args, devices) -> tuple[float, str]:
    """The MFU denominator and where it came from."""
    if args.peak_flops:
        return args.peak_flops, "--peak-flops"
    return distributed.peak_flops(cfg.compute_dtype, devices)


def _tokenizer_meta(data) -> dict:
    """{tokenizer, tokenizer_hash} of the data, for a checkpoint (generation checks it)."""
    if data.tokenizer is None:
        return {}
    name, digest = data.tokenizer
    return dict(tokenizer=name if digest == "bytes" else os.path.abspath(name),
                tokenizer_hash=digest)


def _train(cfg, tcfg, parallel, layout, args, data) -> int:
    """The run's locks, setup, then the loop with the hooks the flags ask for."""
    from engine.run.loop import loop

    is_main = distributed.is_main()  # process 0 prints, locks and writes the metrics file
    say = (lambda *a, **k: print(*a, **k, flush=True)) if is_main else (lambda *a, **k: None)
    with contextlib.ExitStack() as held:
        if args.checkpoint_dir:
            _lock_directory(args.checkpoint_dir, is_main, held, say)
        metrics = held.enter_context(_open_metrics(args)) if args.metrics_file and is_main \
            else None
        session = setup(cfg, tcfg, parallel, layout, args, data, say)
        if session is None:
            return 0
        hooks = _hooks(cfg, session.tcfg, parallel, layout, args, data, session, metrics, say)
        return loop(session, hooks, say)


def _lock_directory(directory, is_main, held, say) -> None:
    """Process 0 holds `directory`'s lock (engine/run/lock.py) until `held` closes; every
    process learns whether it got it, so all stop together when it did not."""
    from engine.run.checkpoint import CheckpointError, check_writable
    from engine.run.lock import DirectoryLock, LockError

    problem = None
    if is_main:
        try:
            check_writable(directory)  # a file, not a directory; read-only; disk full
            lock = held.enter_context(DirectoryLock(directory))
        except (LockError, CheckpointError) as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot write checkpoints to {directory}: {e.strerror or e}"
        else:
            if lock.previous:
                say(f"note: took over the lock of {directory} from a run that ended without "
                    f"releasing it ({lock.previous})")
    if not distributed.agree(problem is None):
        raise UsageError(problem or f"process 0 could not lock {directory}")


def _open_metrics(args):
    """The metrics file hook, the file locked against another run: an existing file is
    appended to on --resume, replaced with --overwrite-metrics, refused otherwise."""
    from engine.run.lock import LockError
    from engine.run.loop import MetricsFile

    path = args.metrics_file
    check_output_file(path, "--metrics-file")
    if os.path.isfile(path) and os.path.getsize(path) and not (args.resume or
                                                                args.overwrite_metrics):
        raise UsageError(f"--metrics-file {path} already holds metrics; pass --resume to "
                         f"append to it or --overwrite-metrics to replace it")
    try:
        return MetricsFile(path, append=not args.overwrite_metrics)
    except LockError as e:
        raise UsageError(str(e)) from None


def _hooks(cfg, tcfg, parallel, layout, args, data, session, metrics, say) -> list:
    """The loop's hooks, in order, for the flags given."""
    from engine.run.loop import Checkpoints, Evaluate, Log, Rates
    from engine.run.preempt import Preemption

    rates = Rates(cfg, tcfg, session.peak)
    hooks = [rates]
    if args.layout == "auto" or args.profile_steps:  # the cost model is on
        hooks += _step_prediction(cfg, layout, parallel, session, say)
    if args.eval_every:
        hooks.append(Evaluate(args.eval_every, args.eval_batches, tcfg.steps,
                              data.bytes_per_token))
    if metrics is not None:
        hooks.append(metrics)
    if args.tensorboard and distributed.is_main():
        from engine.run.tensorboard import TensorBoard

        hooks.append(TensorBoard(args.tensorboard))
    if args.wandb:
        hooks += _wandb(args)
    hooks.append(Log(args.log_every, tcfg.steps, rates, say))
    if args.checkpoint_dir:
        meta = dict(rng=dict(seed=tcfg.seed), model=dataclasses.asdict(cfg),
                    train=dataclasses.asdict(tcfg), parallel=dataclasses.asdict(parallel),
                    layout=str(layout), data=dict(source=args.data, dtype=args.data_dtype,
                                                  **_tokenizer_meta(data)),
                    config=config_file.resolved(args))
        if args.hf:  # the HF config this model came from: engine.convert to-hf writes it
            meta["hf"] = args.hf
            if args.init_from_hf:
                from engine.hf.convert import TOKENIZER_DIR, copy_tokenizer
                copy_tokenizer(args.init_from_hf,
                               os.path.join(args.checkpoint_dir, TOKENIZER_DIR))
        hooks.append(Checkpoints(args.checkpoint_dir, args.checkpoint_every, args.keep,
                                 tcfg.steps, meta, say, asynchronous=args.async_save,
                                 preemption=Preemption()))
    if args.profile_steps:
        hooks.append(profile.Profile(args.profile_steps, args.profile_dir, cfg, tcfg, layout,
                                     parallel, say))
    return hooks


def _step_prediction(cfg, layout, parallel, session, say) -> list:
    """The hook that puts the cost model's step time in every record
    (engine/cost/predicted.py), priced on the profile of the run's devices; none, with a
    note, for an accelerator the cost model has no profile of."""
    from engine.cost.predicted import StepPrediction
    from engine.planner.auto import device_profile

    devices = list(session.trainer.mesh.devices.flat)
    hw = device_profile(devices, lambda *a, **k: None)  # the hook's line names its source
    if hw is None:
        say(f"note: the cost model has no profile of {devices[0].device_kind!r}: no "
            f"predicted step time")
        return []
    return [StepPrediction(cfg, layout, parallel, hw, say)]


def _wandb(args) -> list:
    """Process 0's W&B hook (engine/run/wandb_log.py); every process learns whether it
    started, so all stop together (one line, exit 2) when it did not."""
    from engine.run.wandb_log import WandB, WandbError

    hook, problem = [], None
    if distributed.is_main():
        try:
            hook.append(WandB(args.wandb, config_file.resolved(args)))
        except WandbError as e:
            problem = str(e)
    if not distributed.agree(problem is None):
        raise UsageError(problem or f"process 0 could not start the W&B run {args.wandb}")
    return hook


def run_paths(args) -> tuple[dict, dict]:
    """({flag: path} the run reads, {flag: path} it writes) for `check_apart`."""
    data = args.data if args.data not in ("synthetic", "python-stdlib") else None
    inputs = {"--data": data, "--init-from-hf": getattr(args, "init_from_hf", None),
              "--tokenizer": getattr(args, "tokenizer", None)}
    outputs = {"--metrics-file": args.metrics_file, "--checkpoint-dir": args.checkpoint_dir,
               "--profile-dir": args.profile_dir if args.profile_steps else None}
    return inputs, outputs


def main(argv=None) -> int:
    try:
        cfg, tcfg, parallel, layout, args = parse(sys.argv[1:] if argv is None else argv,
                                                  auto=True)
        check_apart(*run_paths(args))  # before anything is planned, read or written
        if layout is None:
            from engine.planner import auto as plan

            force_host_devices(plan.AUTO_HOST_DEVICES)
            pinned, base = auto_pins(cfg, parallel, args.given)
            cfg, parallel, layout = plan.auto(cfg, tcfg, base=base, pinned=pinned)
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
