"""Checkpoint save and restore of a model whose params + Adam moments hold >= 2 GiB, on
2 processes x 4 forced CPU devices (as `engine.launch` runs them), then a restore into
another layout in 1 process.

    python bench/checkpoint.py                      # d_model 1024, 12 layers: 2.3 GiB
    python bench/checkpoint.py --d-model 256 --layers 2   # a quick look
    python bench/checkpoint.py --dir D --phases restore,relayout   # D's newest checkpoint

Three phases, each in fresh processes (so each peak RSS is that phase's own):
  save     2 processes, fsdp8: a normal step (median of 3); a blocking save (every
           process's snapshot + write, the slowest); an asynchronous save (what the step
           waits for: the snapshot; then the next step, which overlaps the background
           write, and the write's own time); then 2 more steps, whose losses are kept.
  restore  2 processes, fsdp8: restore by pieces; seconds and each process's peak RSS
           (getrusage's ru_maxrss, the whole process's high-water mark) over its own
           share of the state (the bytes its devices hold, a replicated region once a
           device; also printed counting it once, as restored replicas share one host
           buffer on the CPU until a step writes new ones), and what
           the restore added: that peak less the RSS just before the restore began
           (Python, jax, the XLA client, the Trainer: about 200 MiB), over the share.
           Every worker sets glibc's malloc as engine.train does (engine/run/host.py).
  relayout 1 process x 8 devices, fsdp2xtp4: restore by pieces; every restored array is
           compared bit for bit with the checkpoint; the 2 steps after it are compared
           with the saving run's (another layout sums in another order: relative
           difference printed).
Prints figures; asserts nothing. Figures of the default model on the 2-core CPU host:
bench/results/2026-11-28-checkpoint-cpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--phases", default="save,restore,relayout",
                   help="which phases to run, comma-separated; restore and relayout alone "
                        "read the newest checkpoint a save phase left in --dir")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a worker
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def rss_mib() -> float:
    """The peak resident set of this process so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args) -> dict:
    """One process of one phase; returns its figures."""
    layout_name = "fsdp2xtp4" if args.phase == "relayout" else "fsdp8"
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count="
                               f"{8 // args.processes}")
    import jax

    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.processes, process_id=args.process_id)
    import numpy as np
    from jax.sharding import NamedSharding

    from engine.cli.args import keep_freed_memory

    keep_freed_memory()  # glibc's malloc settings of an engine.train run (engine/run/host.py)

    from engine.config import TrainConfig, model_config
    from engine.parallel.layout import Layout
    from engine.run import checkpoint, distributed
    from engine.run.data import device_batch, load_data
    from engine.run.step import Trainer

    cfg = model_config("small", d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.d_model // 64, n_kv_heads=args.d_model // 64,
                       head_dim=64, mlp_dim=4 * args.d_model, dtype="f32")
    tcfg = TrainConfig(batch=args.batch, seq=args.seq, steps=100, warmup=2)
    layout = Layout.parse(layout_name)
    trainer = Trainer(cfg, tcfg, layout, layout.mesh())
    data = load_data("synthetic", cfg.vocab)
    sharding = NamedSharding(trainer.mesh, trainer.batch_spec)

    def batch(i):
        return device_batch(data, sharding, tcfg.seed, i, tcfg.batch, tcfg.seq)

    def step(params, opt, i):
        t0 = time.perf_counter()
        params, opt, m = trainer.train_step(params, opt, batch(i))
        loss = distributed.host_value(m["loss"])
        return params, opt, loss, time.perf_counter() - t0

    def share(tree, replicas: bool = True) -> int:
        """Bytes this process's devices hold; with `replicas` False, a region several of
        them hold (a replicated array) once."""
        held = {(i, str(s.index)): s.data.nbytes for i, x in enumerate(jax.tree.leaves(tree))
                for s in x.addressable_shards}
        return sum(s.data.nbytes for x in jax.tree.leaves(tree)
                   for s in x.addressable_shards) if replicas else sum(held.values())

    meta = {"model": {f: getattr(cfg, f) for f in checkpoint.SHAPE_FIELDS}}
    out = {"process": args.process_id}
    if args.phase == "save":
        params, opt = trainer.init(tcfg.seed)
        out["state_gib"] = sum(x.nbytes for x in jax.tree.leaves((params, opt))) / 2**30
        times = []
        for i in range(4):  # the first compiles
            params, opt, _, dt = step(params, opt, i)
            times.append(dt)
        out["step_s"] = float(np.median(times[1:]))
        t0 = time.perf_counter()
        checkpoint.save(args.dir, 4, params, opt, meta, 10)
        out["blocking_save_s"] = time.perf_counter() - t0
        from engine.run.writer import Writer

        params, opt, _, _ = step(params, opt, 4)
        writer = Writer()
        t0 = time.perf_counter()
        snap = checkpoint.snapshot(params, opt)  # the state after 5 steps
        writer.submit(checkpoint.write, args.dir, 5, snap, meta, 10)
        out["async_save_wait_s"] = time.perf_counter() - t0
        params, opt, loss5, out["overlapped_step_s"] = step(params, opt, 5)
        writer.wait()
        out["async_write_s"] = time.perf_counter() - t0
        params, opt, loss6, _ = step(params, opt, 6)
        out["next_losses"] = [loss5, loss6]
        return out
    ckpt = checkpoint.latest(args.dir, lazy=True)
    before = current_rss_mib()
    t0 = time.perf_counter()
    params, opt = checkpoint.restore(ckpt, trainer)
    jax.block_until_ready((params, opt))
    out.update(restore_s=time.perf_counter() - t0, rss_before_mib=before,
               peak_rss_mib=rss_mib(), rss_after_mib=current_rss_mib(),
               share_mib=share((params, opt)) / 2**20, step=ckpt.step,
               unique_mib=share((params, opt), replicas=False) / 2**20)
    if args.phase == "relayout":
        whole = checkpoint.read(ckpt.path)
        saved = {**whole.params, **{f"opt{k}": v for k, v in whole.opt_state.items()}}
        got = [np.asarray(x) for x in jax.tree.leaves((params, opt))]
        out["bitwise_equal"] = all(np.array_equal(a, b) for a, b in zip(
            got, [*whole.params.values(), *whole.opt_state.values()], strict=True)) and \
            len(saved) == len(got)
        del whole, saved, got
        losses = []
        for i in (5, 6):
            params, opt, loss, _ = step(params, opt, i)
            losses.append(loss)
        out["next_losses"] = losses
    return out


def run_phase(args, phase: str, processes: int) -> list[dict]:
    from engine.cli.launch import free_port

    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--phase", phase, "--process-id", str(i),
         "--processes", str(processes), "--port", str(port), "--dir", args.dir,
         "--d-model", str(args.d_model), "--layers", str(args.layers),
         "--batch", str(args.batch), "--seq", str(args.seq)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True) for i in range(processes)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"phase {phase} failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> None:
    args = parser().parse_args()
    if args.phase:
        print(json.dumps(worker(args)), flush=True)
        return
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    os.makedirs(args.dir, exist_ok=True)
    phases = args.phases.split(",")
    if unknown := set(phases) - {"save", "restore", "relayout"}:
        sys.exit(f"unknown phase {min(unknown)}: choose from save, restore, relayout")
    save = run_phase(args, "save", 2) if "save" in phases else []
    restore = run_phase(args, "restore", 2) if "restore" in phases else []
    relayout = run_phase(args, "relayout", 1) if "relayout" in phases else []
    if save:
        report_save(args, save)
    report_restore(restore, relayout, save)


def report_save(args, save: list[dict]) -> None:
    print(f"state (params + Adam moments, f32): {save[0]['state_gib']:.2f} GiB; "
          f"checkpoint dir {args.dir}")
    print(f"normal step: {max(r['step_s'] for r in save):.2f} s")
    print(f"blocking save: {max(r['blocking_save_s'] for r in save):.2f} s")
    print(f"async save: the step waits {max(r['async_save_wait_s'] for r in save):.2f} s "
          f"(snapshot); the write ends {max(r['async_write_s'] for r in save):.2f} s after "
          f"the save began; the overlapped step {max(r['overlapped_step_s'] for r in save):.2f}"
          f" s = {max(r['overlapped_step_s'] for r in save) / max(r['step_s'] for r in save):.2f}"
          f"x a normal step")


def report_restore(restore: list[dict], relayout: list[dict], save: list[dict]) -> None:
    for name, rows in (("restore fsdp8, 2 processes", restore),
                       ("restore fsdp2xtp4, 1 process", relayout)):
        for r in rows:
            print(f"{name}, process {r['process']}: {r['restore_s']:.2f} s; peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB = {r['peak_rss_mib'] / r['share_mib']:.2f}x "
                  f"its share of the state ({r['share_mib']:.0f} MiB, {r['unique_mib']:.0f} "
                  f"MiB counting a replicated region once); RSS before the "
                  f"restore {r['rss_before_mib']:.0f} MiB, so the restore added "
                  f"{(r['peak_rss_mib'] - r['rss_before_mib']) / r['share_mib']:.2f}x; "
                  f"RSS after it {r['rss_after_mib']:.0f} MiB")
    if not relayout:
        return
    r = relayout[0]
    print(f"fsdp8 x 2 processes -> fsdp2xtp4 x 1 process: restored state bit-identical: "
          f"{r['bitwise_equal']}; next 2 losses {r['next_losses']}", end="")
    if save:
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["next_losses"], save[0]["next_losses"])]
        print(f" vs the saving run's {save[0]['next_losses']} (relative difference max "
              f"{max(diffs):.1e})", end="")
    print()


if __name__ == "__main__":
    main()
