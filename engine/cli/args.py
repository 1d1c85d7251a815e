"""The flags `engine.train`, `engine.plan`, `engine.generate` and the bench scripts share:
the model, parallel and training flags (`build_parser`), their parsing into the frozen
configs (`parse`), and the helpers that turn bad input into one line and exit code 2.

Nothing here imports jax at module level, so a CLI can force host devices first."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from collectives.ring import COMMS, TP_COMMS
from engine.cli.given import given_flags
from engine.cli.models import model_from_flags
from engine.cli.oneline import DefaultsFormatter, OneLineParser, UsageError
from engine.config import (
    GRAD_REDUCES,
    LR_SCHEDULES,
    PRESETS,
    ConfigError,
    ParallelConfig,
    TrainConfig,
)
from engine.cost import profile
from engine.parallel import validate
from engine.parallel.layout import Layout
from engine.parallel.pipeline import SCHEDULES
from engine.parallel.zero import ZERO, ZERO_LEVELS
from engine.planner.space import ineffective
from engine.run import distributed
from engine.run.data import BIN_DTYPES
from engine.text.documents import ERRORS
from layers import roles
from layers.block import REMAT_MODES
from layers.config import DTYPES
from layers.kernels.context import CP_COMMS

TRAIN_DESCRIPTION = ("`python -m engine.train --layout fsdp4xtp2`: train a decoder-only "
                     "transformer with explicit FSDP + Megatron TP, one jit(shard_map) per step.")

# The switches that say how a layout's axes move bytes: flag, axis, registry. Each entry of
# a registry carries the one description `--help` and docs/parallelism.md print.
SWITCHES = (("--tp-comm", "tp", TP_COMMS), ("--cp-comm", "cp", CP_COMMS),
            ("--zero", "fsdp", ZERO_LEVELS), ("--pp-schedule", "pp", SCHEDULES))


def described(registry: dict) -> str:
    """`name: doc; name: doc` of a registry whose entries have a `doc`."""
    return "; ".join(f"{name}: {entry.doc}" for name, entry in registry.items())


def switch_table() -> str:
    """The markdown table of every switch value and its description (docs/parallelism.md
    holds it between its `switches` markers; a test keeps the two equal)."""
    rows = ["| flag | axis | value | what it does |", "|---|---|---|---|"]
    rows += [f"| `{flag}` | {axis} | `{name}` | {entry.doc} |"
             for flag, axis, registry in SWITCHES for name, entry in registry.items()]
    return "\n".join(rows)


GROUPS = ("model", "parallel", "batch", "training", "output", "data", "checkpoints",
          "processes")
DOCUMENT_MASKS = ("auto", "on", "off")


def build_parser(prog: str = "python -m engine.train", description: str | None = None,
                 parents=(), groups=GROUPS, layout: bool = True) -> argparse.ArgumentParser:
    """The training flags; tools that take the same model flags pass their own prog,
    description, parent parsers (for their extra flags), the flag `groups` they use and
    whether they take --layout (the planner chooses it). A group left out is not accepted
    on the command line; its flags' defaults are still set, so `parse` sees every
    attribute."""
    p = OneLineParser(prog=prog, description=description or TRAIN_DESCRIPTION,
                parents=list(parents), formatter_class=DefaultsFormatter)
    unused = argparse.ArgumentParser(add_help=False)  # holds the groups left out
    group = lambda name, title: (p if name in groups else unused).add_argument_group(title)
    (p if layout else unused).add_argument("--layout", default="single",
                   help="mesh axes outermost first with sizes: single, dp8, fsdp8, tp8, "
                        "fsdp4xtp2, dp2xfsdp2xtp2, ... (axes: "
                        + "; ".join(f"{r.name}: {r.doc}" for r in roles.ROLES.values())
                        + "); training only: auto = the planner's choice for the devices "
                          "at hand, with its --zero, --prefetch, --tp-comm, --cp-comm and "
                          "--remat (engine/planner/search.py)")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="flag settings from a TOML file; flags given override it "
                        "(docs/run_config.md)")
    m = group("model", "model (a preset, then any dimension overridden)")
    m.add_argument("--model", default=None, choices=sorted(PRESETS),
                   help="preset dimensions (engine/config.py; default small, or the "
                        "resumed checkpoint's model when it was imported from Hugging Face)")
    m.add_argument("--init-from-hf", default=None, metavar="HF_DIR",
                   help="start from a Hugging Face Llama / Mistral / Mixtral directory's "
                        "weights and config (step 0, fresh optimizer; docs/huggingface.md); "
                        "dimension flags must agree with its config.json")
    m.add_argument("--vocab-multiple", type=int, default=128,
                   help="--init-from-hf: pad the params' vocab to this multiple")
    for flag, field, what in [("--d-model", "d_model", "D"), ("--layers", "n_layers", "N"),
                              ("--heads", "n_heads", "H"), ("--kv-heads", "n_kv_heads", "G"),
                              ("--head-dim", "head_dim", "K"), ("--mlp-dim", "mlp_dim", "F"),
                              ("--vocab", "vocab", "V"),
                              ("--experts", "experts", "E, routed experts (0: dense MLP)"),
                              ("--top-k", "top_k", "the experts each token is routed to"),
                              ("--shared-experts", "shared_experts",
                               "experts every token passes through")]:
        m.add_argument(flag, dest=field, type=int, default=None, help=f"override {what}")
    m.add_argument("--capacity-factor", type=float, default=None,
                   help="each expert takes at most ceil(C*seq*top_k/experts) of a "
                        "sequence's tokens, the rest pass through (0: dropless, default)")
    m.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="compute dtype of matmuls (params and optimizer state are f32)")
    m.add_argument("--activations", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="auto: bf16 on GPUs and TPUs (with --hardware: that profile's "
                        "platform), f32 on the CPU (engine/config.py); "
                        "dtype of the activations between matmuls: matmul results, the "
                        "residual stream and what the backward keeps (bf16 halves "
                        "activation memory; norms, softmax and the loss compute in f32)")
    m.add_argument("--remat", default="full", choices=REMAT_MODES,
                   help="what the backward recomputes; alternate: torchtitan's per-op selective "
                        "checkpointing (see layers/block.py)")
    m.add_argument("--attention", default="auto", choices=validate.ATTENTIONS,
                   help="auto: blocked flash from 1024 tokens, else chunked (dense scores, "
                        "causal tiles skipped, flash backward); reference: plain dense "
                        "softmax, autodiff; pallas runs in interpret mode on CPU")
    x = group("parallel", "where bytes move (see docs/architecture.md)")
    x.add_argument("--tp-comm", default="allreduce", choices=COMMS,
                   help="on the tp axis: " + described(TP_COMMS))
    x.add_argument("--cp-comm", default="allgather", choices=list(CP_COMMS),
                   help="on the cp axis: " + described(CP_COMMS))
    x.add_argument("--zero", type=int, default=3, choices=ZERO,
                   help="on the fsdp axis: " + described(ZERO_LEVELS))
    x.add_argument("--grad-reduce", default="compute", choices=GRAD_REDUCES,
                   help="zero 2 and 3: the dtype fsdp reduce-scatters weight grads in: "
                        "compute = the compute dtype the weights were gathered in; f32 = "
                        "the params' (twice the bytes; as PyTorch FSDP's mixed precision "
                        "by default)")
    x.add_argument("--microbatches", type=int, default=1,
                   help="split each device's batch into M microbatches and accumulate "
                        "their grads before one optimizer update")
    x.add_argument("--pp-schedule", default="1f1b", choices=list(validate.SCHEDULES),
                   help="on the pp axis: " + described(SCHEDULES))
    x.add_argument("--pp-virtual", type=int, default=1, metavar="V",
                   help="--pp-schedule interleaved: layer chunks per device (circular: "
                        "device s runs chunks s, s+pp, ...); layers divisible by pp x V")
    x.add_argument("--prefetch", action="store_true",
                   help="zero 3: gather layer i+1's weights before layer i's compute")
    b = group("batch", "batch")
    d = TrainConfig()
    b.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    b.add_argument("--batch", type=int, default=d.batch, help="global sequences per step")
    t = group("training", "training")
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in the run")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    t.add_argument("--lr-schedule-steps", dest="schedule_steps", type=int, default=None,
                   metavar="N", help="the step the schedule's decay ends at (default: --steps; "
                                     "resuming, the checkpoint's)")
    t.add_argument("--lr-schedule", default=d.schedule, choices=list(LR_SCHEDULES),
                   help="after warmup: " + "; ".join(f"{k}: {v}" for k, v in
                                                     LR_SCHEDULES.items()))
    t.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="the last step's lr as a fraction of --lr")
    t.add_argument("--decay-fraction", type=float, default=d.decay_fraction,
                   help="warmup-stable-decay: the fraction of the steps that decay")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW's decoupled weight decay (none on norm scales)")
    t.add_argument("--adam-b1", type=float, default=d.b1, help="Adam's first-moment decay")
    t.add_argument("--adam-b2", type=float, default=d.b2, help="Adam's second-moment decay")
    t.add_argument("--adam-eps", type=float, default=d.eps, help="Adam's epsilon")
    t.add_argument("--clip-norm", type=float, default=d.clip_norm,
                   help="clip the global gradient norm to this")
    t.add_argument("--seed", type=int, default=d.seed,
                   help="init and batch order are functions of the seed")
    o = group("output", "output")
    o.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    o.add_argument("--metrics-file", default=None,
                   help="JSONL, one object per step; an existing file is appended to on "
                        "--resume and refused otherwise")
    o.add_argument("--overwrite-metrics", action="store_true",
                   help="replace an existing --metrics-file")
    o.add_argument("--peak-flops", type=float, default=None,
                   help="MFU denominator in FLOP/s (default: spec sheet, or a matmul "
                        "measured at start-up on CPU)")
    o.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="profiler trace of steps A..B (inclusive, from 1) and, at the end, "
                        "a table of their time per scope and collective, measured vs "
                        "predicted (engine/cost/profile.py)")
    o.add_argument("--profile-dir", default="profile", help="where --profile-steps writes")
    o.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard scalars of every step into DIR (needs the tensorboard "
                        "extra; engine/run/tensorboard.py)")
    o.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="the same scalars to Weights & Biases project PROJECT (needs the "
                        "wandb extra; WANDB_MODE=offline keeps the run local; "
                        "engine/run/wandb_log.py)")
    g = group("data", "data (see engine/run/data.py)")
    g.add_argument("--data", default="synthetic",
                   help="synthetic, python-stdlib, or a PATH.txt / PATH.jsonl (bytes as "
                        "tokens) / PATH.bin (flat token array, nanoGPT's format)")
    g.add_argument("--data-dtype", default="uint16", choices=BIN_DTYPES,
                   help="token dtype of a .bin file without a sidecar")
    g.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer.json or a directory holding one: .txt and "
                        ".jsonl data are tokenized with it; a .bin's sidecar must name it "
                        "(default: bytes, or the .bin's sidecar)")
    g.add_argument("--text-field", default="text", help="the text field of .jsonl data")
    g.add_argument("--errors", default="strict", choices=ERRORS,
                   help="invalid UTF-8 in .txt / .jsonl data: strict refuses it (naming "
                        "file, line and byte), replace turns it into U+FFFD")
    g.add_argument("--document-mask", default="auto", choices=DOCUMENT_MASKS,
                   help="packed documents (docs/packing.md): on = a token attends only to "
                        "earlier tokens of its own document in the window (documents end "
                        "at the data's end-of-document token); auto = on when the data has "
                        "one")
    g.add_argument("--document-positions", action="store_true",
                   help="with the document mask: RoPE positions restart at 0 at each "
                        "document (default: positions in the window, as torchtitan)")
    g.add_argument("--eval-every", type=int, default=None,
                   help="validation loss, perplexity and bits per byte every N steps and "
                        "at the end (off when unset)")
    g.add_argument("--eval-batches", type=int, default=4,
                   help="validation batches averaged per evaluation")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate the newest checkpoint of --checkpoint-dir and exit "
                        "(no training)")
    c = group("checkpoints", "checkpoints (see engine/run/checkpoint.py)")
    c.add_argument("--checkpoint-dir", default=None, help="where checkpoints are written")
    c.add_argument("--checkpoint-every", type=int, default=50,
                   help="checkpoint every N steps and at the last step")
    c.add_argument("--keep", type=int, default=3, help="keep the newest N checkpoints")
    c.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True,
                   help="copy the state to host memory at a save and write it in a "
                        "background thread while training goes on (engine/run/writer.py)")
    c.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir "
                        "(any layout; appends to --metrics-file)")
    h = group("processes", "several processes (see engine/run/distributed.py; "
                           "python -m engine.launch starts them on one machine)")
    h.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service; default: a cluster's "
                        "environment (SLURM, Open MPI, Cloud TPU), else one process")
    h.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    h.add_argument("--process-id", type=int, default=None, help="this process, 0-based")
    p.set_defaults(**vars(unused.parse_args([])))
    return p


def parse(argv, parser: argparse.ArgumentParser | None = None, auto: bool = False) -> tuple:
    """argv -> (ModelConfig, TrainConfig, ParallelConfig, Layout, args); raises
    UsageError / ConfigError (`engine.parallel.validate`'s problems, one line). With `auto`,
    `--layout auto` returns Layout None: the planner chooses it (`engine.plan.auto`)."""
    from engine.cli import config_file

    parser = parser or build_parser()
    path, argv = config_file.expand(argv, parser)
    args = parser.parse_args(argv)
    args.config = path
    args.given = given_flags(parser, argv)  # a flag that cannot take effect is refused
    cfg = model_from_flags(args)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
                       warmup=args.warmup, seed=args.seed, schedule_steps=args.schedule_steps,
                       schedule=args.lr_schedule, min_lr_ratio=args.min_lr_ratio,
                       decay_fraction=args.decay_fraction, weight_decay=args.weight_decay,
                       b1=args.adam_b1, b2=args.adam_b2, eps=args.adam_eps,
                       clip_norm=args.clip_norm)
    parallel = ParallelConfig(zero=args.zero, prefetch=args.prefetch, tp_comm=args.tp_comm,
                              cp_comm=args.cp_comm, microbatches=args.microbatches,
                              pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual,
                              grad_reduce=args.grad_reduce)
    problems = validate.config_problems(cfg, tcfg, parallel) + flag_problems(args, cfg, tcfg)
    if problems:
        raise UsageError("; ".join(problems))
    if auto and args.layout == "auto":
        if distributed.process_count(args) > 1 or args.coordinator is not None:
            raise UsageError("--layout auto plans for the devices of one process; "
                             "name a layout to train with several processes")
        return cfg, tcfg, parallel, None, args
    layout = Layout.parse(args.layout)
    problems = distributed.flag_problems(args, layout.size) + ineffective(
        cfg, parallel, layout, args.given)
    if problems:
        raise UsageError("; ".join(problems))
    validate.check(cfg, tcfg, parallel, layout)
    return cfg, tcfg, parallel, layout, args


def parse_or_exit(argv, parser: argparse.ArgumentParser) -> tuple:
    """`parse` for tools sharing the training flags: bad input prints one line and
    exits 2 (SystemExit), like the training CLI."""
    try:
        return parse(sys.argv[1:] if argv is None else argv, parser)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# Far beyond anything this engine trains; past them a typo, not a plan.
LIMITS = dict(steps=10**9, batch=2**20, seq=2**20, d_model=2**17, n_layers=2**12,
              n_heads=2**12, n_kv_heads=2**12, head_dim=2**12, mlp_dim=2**20, vocab=2**24)


def flag_problems(args, cfg, tcfg) -> list[str]:
    """Non-positive, absurd or contradictory numbers among the flags."""
    values = {**dataclasses.asdict(cfg), **dataclasses.asdict(tcfg)}
    problems = [f"{name}={values[name]} is absurd (limit {limit:,})"
                for name, limit in LIMITS.items() if values[name] > limit]
    for name in ("log_every", "checkpoint_every", "keep", "eval_batches", "eval_every",
                 "schedule_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            problems.append(f"{name}={getattr(args, name)} must be >= 1")
    if not 0 <= args.seed < 2**32:
        problems.append(f"seed={args.seed} must be in [0, 2**32)")
    problems += optimizer_problems(tcfg)
    if args.peak_flops is not None and not args.peak_flops > 0:
        problems.append(f"peak_flops={args.peak_flops} must be > 0")
    if args.document_positions and args.document_mask == "off":
        problems.append("--document-positions needs the document mask (--document-mask "
                        "auto or on)")
    if args.tensorboard is not None:
        from engine.run import tensorboard
        if not tensorboard.available():
            problems.append(f"--tensorboard needs tensorboardX: {tensorboard.EXTRA}")
    if args.wandb is not None:
        from engine.run import wandb_log
        if not wandb_log.available():
            problems.append(f"--wandb needs wandb: {wandb_log.EXTRA}")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir")
    if args.eval_only and not args.checkpoint_dir:
        problems.append("--eval-only needs --checkpoint-dir")
    problems += profile.flag_problems(args.profile_steps, args.profile_dir, tcfg.steps)
    return problems


def check_host_memory(cfg) -> None:
    """Raise UsageError (one line) when training `cfg` cannot fit this host's available
    memory (`engine.run.host.memory_problem`) and jax computes on the host's CPU. For
    every tool that materialises a model: call it before building anything."""
    import jax

    from engine.run.host import memory_problem

    if jax.default_backend() == "cpu" and (problem := memory_problem(cfg)):
        raise UsageError(problem)


def host_memory_or_exit(cfg) -> None:
    """`check_host_memory` for the bench scripts: one line on stderr and exit 2."""
    try:
        check_host_memory(cfg)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def optimizer_problems(tcfg) -> list[str]:
    """Optimizer settings outside the range where they mean something (NaN fails all)."""
    t = tcfg
    checks = [("weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
              ("adam_b1", t.b1, 0 <= t.b1 < 1, "in [0, 1)"),
              ("adam_b2", t.b2, 0 <= t.b2 < 1, "in [0, 1)"),
              ("adam_eps", t.eps, t.eps > 0, "> 0"),
              ("clip_norm", t.clip_norm, t.clip_norm > 0, "> 0"),
              ("min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
              ("decay_fraction", t.decay_fraction, 0 < t.decay_fraction <= 1, "in (0, 1]")]
    return [f"{name}={v} must be {want}" for name, v, ok, want in checks if not ok]


def keep_freed_memory() -> None:
    """On XLA:CPU, keep the step's freed buffers in the process (engine/run/host.py). Changes
    process-wide malloc settings, so tools call it from `main`, not the library."""
    import jax

    from engine.run import host

    if jax.default_backend() == "cpu":
        host.keep_freed_memory()


def force_host_devices(n: int) -> None:
    """Ask XLA's CPU backend for n devices unless the user already chose a count.
    Must run before jax is imported; harmless on accelerators (only the host backend)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def check_output_file(path: str, flag: str) -> None:
    """Raise UsageError (one line) unless `path` can be opened for writing; a file the
    check creates is removed again. Run before compiling, so a typo costs no compile."""
    existed = os.path.lexists(path)
    try:
        open(path, "a").close()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
    if not existed:
        os.remove(path)


def check_apart(inputs: dict, outputs: dict) -> None:
    """Raise UsageError (one line) when an output of the run ({flag: path}: a file or a
    directory it writes) is one of its inputs ({flag: path}), or a directory holding one,
    or another output; None paths are left out. Run before anything is opened for
    writing: a metrics file named like the data file would truncate the data."""
    real = lambda paths: {f: (p, os.path.realpath(p)) for f, p in paths.items() if p}
    ins, outs = real(inputs), real(outputs)

    def same(a: str, b: str) -> bool:
        if a == b:
            return True
        try:
            return os.path.samefile(a, b)  # hard links, bind mounts
        except OSError:
            return False

    named = list(outs.items())
    for i, (oflag, (opath, o)) in enumerate(named):
        for iflag, (ipath, x) in ins.items():
            if same(o, x):
                raise UsageError(f"{oflag} {opath} is {iflag} {ipath}: writing it would "
                                 f"destroy the input; choose another {oflag}")
            if x.startswith(o.rstrip(os.sep) + os.sep):
                raise UsageError(f"{oflag} {opath} holds {iflag} {ipath}: choose an "
                                 f"{oflag} apart from the run's inputs")
        for oflag2, (opath2, o2) in named[i + 1:]:
            if same(o, o2):
                raise UsageError(f"{oflag} and {oflag2} are both {opath}: choose two paths")
