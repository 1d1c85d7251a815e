"""Predicted vs published MFU against sequence length for a run outside
bench/published.py's table: llm-foundry's MPT-7b on 8 H100 at 2k to 32k tokens
(scripts/train/benchmarking/README.md, "H100 80GB BF16"), priced with the row
conventions of bench/published.py and the attention kernel the run called.

    python bench/long_seq.py
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import published, published_runs  # noqa: E402

# (seq, micro-batch, activation checkpointing, tokens/s per GPU, the source's MFU): the
# README's MPT-7b rows on 8 h100_80gb, amp_bf16, FULL_SHARD
MPT_7B_H100 = [(2048, 6, False, 10643, 46.44), (4096, 16, True, 8611, 40.42),
               (8192, 8, True, 6935, 37.14), (32768, 2, True, 3318, 30.94)]


def main() -> int:
    base = published_runs._mpt("7b", "h100", 8, 6, False, 10643, 46.44)
    print("seq     predicted  published  error  (MFU %, this engine's convention)")
    for seq, micro, ac, tps, mfu in MPT_7B_H100:
        run = dataclasses.replace(base, seq=seq, batch=micro * 8, throughput=tps,
                                  remat="full" if ac else "none", source_mfu=mfu)
        e = published.evaluate(run, engine=False)
        print(f"{seq:<7d} {100 * e['predicted_mfu']:9.1f}  {100 * e['published_mfu']:9.1f}"
              f"  {100 * e['error']:+5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
