"""Per-device peak memory of one training step three ways: XLA:CPU's, the hand model's
and the program's liveness.

    python bench/memory.py
    python bench/memory.py --presets tiny --layouts fsdp8 --dtypes bf16 --attention chunked

For each (preset, layout, dtype), remat full, one row: the measured peak
(`engine.cost.memory.measure` of the compiled step: arguments + temp + unaliased
outputs; compile only, no run), `engine.cost.memory.predict` (the hand enumeration) and
`engine.cost.liveness.peak_bytes` of the traced step without and with the fusion rule,
each in MiB with its ratio to the measured peak.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli.args import OneLineParser, UsageError, force_host_devices  # noqa: E402

MiB = 2 ** 20
SEQ = {"tiny": 64, "small": 256}  # the sequence lengths engine/cost/memory.py was read at


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python bench/memory.py",
                                description=__doc__.split("\n\n")[0])
    from engine.config import PRESETS

    p.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    p.add_argument("--layouts", nargs="+", default=["fsdp8", "fsdp4xtp2", "single"])
    p.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
    p.add_argument("--attention", default="reference",
                   help="attention kernel (memory.predict models reference and chunked on "
                        "cpu; for the others its column is '-')")
    p.add_argument("--batch", type=_positive, default=16)
    p.add_argument("--seq", type=_positive, default=None,
                   help="tokens per row (default: 64 for tiny, 256 for small)")
    return p


def rows(args) -> list[dict]:
    from engine.config import ParallelConfig, TrainConfig, model_config
    from engine.cost import liveness, memory
    from engine.cost.ledger import trace_step
    from engine.parallel.layout import Layout
    from engine.parallel.validate import problems
    from engine.run.step import Trainer

    out = []
    for preset in args.presets:
        for name in args.layouts:
            for dtype in args.dtypes:
                cfg = model_config(preset, dtype=dtype, remat="full", attention=args.attention)
                seq = SEQ.get(preset, 256) if args.seq is None else args.seq
                tcfg = TrainConfig(batch=args.batch, seq=seq)
                layout = Layout.parse(name)
                bad = problems(cfg, tcfg, ParallelConfig(), layout)
                if bad:
                    raise UsageError(f"{preset} {name} {dtype}: {bad[0]}")
                trainer = Trainer(cfg, tcfg, layout, layout.mesh(), ParallelConfig())
                measured = memory.measure(memory.compile_step(
                    trainer, {"xla_backend_optimization_level": 0}))["peak"]
                try:
                    hand = memory.predict(cfg, tcfg, layout, "cpu", trainer=trainer).peak
                except memory.Unsupported:  # blocked / pallas on cpu: liveness only
                    hand = None
                closed = trace_step(cfg, tcfg, layout)
                live, _ = liveness.peak_bytes(closed)
                fused, _ = liveness.peak_bytes(closed, fuse=True)
                out.append(dict(preset=preset, layout=name, dtype=dtype, seq=tcfg.seq,
                                measured=measured, hand=hand, liveness=live,
                                liveness_fused=fused))
                print(_line(out[-1]), flush=True)
    return out


def _line(r: dict) -> str:
    m = r["measured"]
    cells = [f"{r['preset']:6s} {r['layout']:10s} {r['dtype']:5s} L={r['seq']:<4d}",
             f"{m / MiB:8.2f}"]
    for key in ("hand", "liveness", "liveness_fused"):
        cells.append(f"{'-':>17s}" if r[key] is None
                     else f"{r[key] / MiB:8.2f} ({r[key] / m:5.2f}x)")
    return " | ".join(cells)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        from engine.parallel.layout import Layout

        force_host_devices(max(Layout.parse(name).size for name in args.layouts))
        print("model  layout     dtype L     | measured |    hand model    |     liveness     "
              "| liveness, fused   (MiB per device; ratio to measured)")
        rows(args)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
