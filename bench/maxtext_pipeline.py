"""This engine's pipeline schedules side by side with MaxText's pipeline, one process.

    python bench/maxtext_pipeline.py --maxtext /tmp/maxtext
    python bench/maxtext_pipeline.py --maxtext /tmp/maxtext --pp 2 --factors 2 --rounds 2

--maxtext is an unpacked MaxText source tree (its `src/maxtext` package is imported from
there); it runs in an environment with flax and MaxText's other imports installed
(bench/results/2026-11-28-maxtext-pipeline-cpu.md says how), and the bench skips with
one line without them: MaxText is never a dependency of this project.

For each pp in --pp (layout pp{p}xfsdp{8/p}, MaxText ici_pipeline_parallelism=p with
ici_fsdp_parallelism=8/p) and M = f·p for f in --factors, the --model preset with 8
layers (f32 weights and activations, --remat; --batch rows of --seq tokens) compiles as
a whole train step (embedding, layers, head, loss, grads, AdamW) on 8 host devices:

    ours gpipe / 1f1b / interleaved V=2   `engine.run.step.Trainer` with --pp-schedule
    maxtext                               MaxText's `train_step`, one pipeline repeat
                                          (num_layers_per_pipeline_stage = 8/p): every
                                          forward iteration, then autodiff's reverse scan
    maxtext circular V=2                  num_pipeline_repeats = 2 (8/(2p) layers per
                                          stage): the layers pass round the stages twice
    ours / maxtext fsdp8 (--baseline)     each one's step without pp (fsdp 8, one
                                          microbatch): what each pays for its pipeline

The steps run in turn (`bench.timing.round_robin`, --rounds passes of one step each),
so a slow spell of the shared cores falls on all of them; each row gives the median
step, its ratio to ours gpipe's in the same passes (`paired_ratio`), the per-device
peak of `memory_analysis()` (argument + temp + output - alias, as
`engine.cost.memory.measure`) and the matmul FLOPs per device the compiled step
executes (`matmul_flops`), but for ours under pp, whose units run under conditionals
that the HLO text cannot count.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import OneLineParser, UsageError, force_host_devices  # noqa: E402

MiB = 2 ** 20
LAYERS = 8
REMAT = {"full": "full", "dots": "minimal"}  # ours -> MaxText's nearest policy


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python bench/maxtext_pipeline.py",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--maxtext", required=True, help="an unpacked MaxText source tree")
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4], choices=(2, 4))
    p.add_argument("--factors", nargs="+", type=int, default=[2, 4],
                   help="microbatches M = factor x pp")
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--model", default="medium", choices=("tiny", "medium"))
    p.add_argument("--remat", default="full", choices=tuple(REMAT),
                   help="ours; MaxText runs full as full, dots as minimal")
    p.add_argument("--rounds", type=int, default=3, help="timed passes")
    p.add_argument("--baseline", action="store_true",
                   help="also time each one's step without pp (fsdp8) in the same passes")
    return p


def matmul_flops(text: str) -> float:
    """2·(output elements)·(contracted size) summed over the compiled HLO's dots, each
    times its computation's executions per step (`engine.cost.hlo.parse`: while trip
    counts, calls, fusions). Exact for a program without conditionals."""
    import math
    import re

    from engine.cost import hlo

    array = re.compile(r"\w+\[([\d,]*)\]")

    def dims(result: str) -> list[int]:
        return [int(d) for d in array.search(result).group(1).split(",") if d]

    module = hlo.parse(text)
    total = 0.0
    for comp, instrs in module.computations.items():
        result_of = {ins.name: ins.result for ins in instrs}
        for ins in instrs:
            if ins.opcode != "dot":
                continue
            lhs = dims(result_of[ins.attributes.split(",")[0].strip().lstrip("%")])
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attributes)
            k = math.prod(lhs[int(i)] for i in contracted.group(1).split(",") if i)
            total += 2 * math.prod(dims(ins.result)) * k * module.multiplicity.get(comp, 0)
    return total


def our_step(cfg, tcfg, pp: int, M: int, schedule: str) -> tuple:
    """(label, [step, params, opt_state, tokens], peak bytes, matmul FLOPs) of this
    engine's step (pp = 1: fsdp8 with one microbatch; FLOPs None under pp, whose units
    run under conditionals)."""
    from bench.timing import compiled_step
    from engine.config import ParallelConfig
    from engine.cost import memory
    from engine.parallel.layout import Layout
    from engine.run.step import Trainer

    layout = Layout.parse(f"pp{pp}xfsdp{8 // pp}" if pp > 1 else "fsdp8")
    V = 2 if schedule == "interleaved" else 1
    par = ParallelConfig(microbatches=M, pp_schedule=schedule, pp_virtual=V) if pp > 1 \
        else ParallelConfig()
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), par)
    step, params, opt_state, tokens, _ = compiled_step(trainer)
    label = (f"ours {schedule}" + (f" V={V}" if V > 1 else "")) if pp > 1 else "ours fsdp8"
    flops = matmul_flops(step.as_text()) if pp == 1 else None
    return label, [step, params, opt_state, tokens], memory.measure(step)["peak"], flops


def maxtext_step(root: Path, cfg, args, pp: int, M: int, repeats: int) -> tuple:
    """(label, [step, state, rng, batch], peak bytes, matmul FLOPs) of MaxText's own
    train step on the same model, mesh shape, batch and microbatches (pp = 1: fsdp8, no
    pipeline)."""
    import jax
    import numpy as np
    from flax.linen import partitioning as nn_partitioning
    from maxtext.configs import pyconfig
    from maxtext.optimizers import optimizers
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, model_creation_utils

    from engine.cost import memory

    B, L = args.batch, args.seq
    config = pyconfig.initialize(
        [sys.argv[0], str(root / "src/maxtext/configs/base.yml")],
        run_name="maxtext_pipeline_bench", enable_checkpointing=False,
        enable_goodput_recording=False, skip_jax_distributed_system=True, hardware="cpu",
        pure_nnx=False, attention="dot_product", dtype="float32", weight_dtype="float32",
        base_emb_dim=cfg.d_model, base_num_decoder_layers=LAYERS,
        base_num_query_heads=cfg.n_heads, base_num_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, base_mlp_dim=cfg.mlp_dim, vocab_size=cfg.vocab,
        max_target_length=L, per_device_batch_size=B / 8,
        ici_pipeline_parallelism=pp, ici_fsdp_parallelism=8 // pp,
        num_pipeline_microbatches=M, num_layers_per_pipeline_stage=LAYERS // (pp * repeats),
        remat_policy=REMAT[args.remat], enable_dropout=False, dataset_type="synthetic",
        tokenizer_path="", packing=False)
    mesh = maxtext_utils.get_mesh_from_config(config)
    model = model_creation_utils.from_config(config, mesh=mesh)
    tx = optimizers.get_optimizer(config, maxtext_utils.create_learning_rate_schedule(config))
    init = functools.partial(maxtext_utils.init_initial_state, model, tx, config, True,
                             jax.random.PRNGKey(0))
    # outside the mesh context: flax's unbox applies sharding constraints to the
    # abstract state there, which jax refuses on ShapeDtypeStructs
    _, _, state_shardings = maxtext_utils.get_abstract_state(config, mesh, init, True)
    data_sharding = maxtext_utils.get_input_data_sharding(config, mesh)
    tokens_BL = np.random.RandomState(0).randint(0, cfg.vocab, (B, L + 1)).astype(np.int32)
    pos_BL = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    seg_BL = np.ones((B, L), np.int32)
    batch = jax.device_put(dict(inputs=tokens_BL[:, :-1], targets=tokens_BL[:, 1:],
                                inputs_position=pos_BL, targets_position=pos_BL,
                                inputs_segmentation=seg_BL, targets_segmentation=seg_BL),
                           data_sharding)
    fn, in_sh, out_sh, _, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, state_shardings, model, config)
    rng = jax.random.PRNGKey(1)
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
        state = jax.jit(init, out_shardings=state_shardings)()
        compiled = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh,
                           donate_argnums=donate).lower(state, batch, rng).compile()

    def step(state, rng, batch):  # bench.timing's (params, opt_state, tokens) order
        state, metrics = compiled(state, batch, rng)
        return state, rng, metrics

    label = "maxtext" + (f" circular V={repeats}" if repeats > 1 else "") + \
        ("" if pp > 1 else " fsdp8")
    return (label, [step, state, rng, batch], memory.measure(compiled)["peak"],
            matmul_flops(compiled.as_text()))


def parse(argv=None) -> argparse.Namespace:
    """The arguments; raises UsageError when a configuration cannot run."""
    args = build_parser().parse_args(argv)
    if min(*args.factors, args.batch, args.seq, args.rounds) < 1:
        raise UsageError("--factors, --batch, --seq and --rounds must be positive")
    for pp in args.pp:
        for f in args.factors:
            if args.batch % (8 // pp * f * pp):
                raise UsageError(f"--batch {args.batch} is not divisible by fsdp x M = "
                                 f"{8 // pp} x {f * pp}")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(args.maxtext)
    if importlib.util.find_spec("flax") is None or not (root / "src/maxtext").is_dir():
        print(f"skipped: needs flax installed and a MaxText tree at {root} (src/maxtext)")
        return 0
    force_host_devices(8)
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText's stubs for Google Cloud
    sys.path.insert(0, str(root / "src"))
    try:  # MaxText prints its stubs' notices on stdout: they go to stderr here
        with contextlib.redirect_stdout(sys.stderr):
            import maxtext.trainers.pre_train.train  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any import failure means: cannot compare here
        print(f"skipped: MaxText does not import here ({type(e).__name__}: {e})")
        return 0
    import jax
    from tabulate import tabulate

    from bench.timing import paired_ratio, round_robin
    from engine.config import TrainConfig, model_config

    cfg = model_config(args.model, dtype="f32", remat=args.remat, n_layers=LAYERS)
    tcfg = TrainConfig(batch=args.batch, seq=args.seq)
    rows = []
    for pp in args.pp:
        for f in args.factors:
            M = f * pp
            runs = [our_step(cfg, tcfg, pp, M, s) for s in ("gpipe", "1f1b", "interleaved")]
            with contextlib.redirect_stdout(sys.stderr):
                runs += [maxtext_step(root, cfg, args, pp, M, r) for r in (1, 2)]
                if args.baseline:
                    runs += [our_step(cfg, tcfg, 1, 1, "gpipe"),
                             maxtext_step(root, cfg, args, 1, 1, 1)]
            held = [r[1] for r in runs]
            for h in held:  # a first, untimed call of each
                h[1], h[2], _ = h[0](*h[1:])
                jax.block_until_ready(h[1])
            say = functools.partial(print, file=sys.stderr, flush=True)
            times = round_robin(held, args.rounds, say=say)
            for (label, _, peak, flops), t in zip(runs, times):
                rows.append([pp, M, label, f"{statistics.median(t):.3g}",
                             f"{paired_ratio(t, times[0]):.2f}", f"{peak / MiB:.1f}",
                             "-" if flops is None else f"{flops / 1e9:.2f}"])
            del runs, held
            say(f"  done pp={pp} M={M} at {time.strftime('%H:%M:%S')}")
    load = os.getloadavg()
    print(f"{args.model}, {LAYERS} layers, f32, remat {args.remat} (MaxText "
          f"{REMAT[args.remat]}), batch {args.batch} x seq {args.seq}, "
          f"pp{{p}}xfsdp{{8/p}} on 8 host devices, {args.rounds} rounds; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(tabulate(rows, ["pp", "M", "program", "step s", "/ ours gpipe", "peak MiB",
                          "matmul GFLOP"],
                   disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
