"""Attention forward+backward: time and compiled memory of reference, chunked, blocked, Pallas.

Usage (from the repo root):
    python bench/attention.py                                # L = 1024 2048 4096 8192
    python bench/attention.py --lengths 256 512 1024 --dtype bfloat16 --batch 16
    python bench/attention.py --heads 16 --kv-heads 4 --head-dim 128 --no-causal
    python bench/attention.py --pallas-max-length 8192       # opt in to long Pallas runs

For each length it jits value-and-VJP of each implementation on random inputs,
reads the compiled program's `.memory_analysis()` (temp = scratch XLA allocates
beyond arguments and outputs; total = arguments + outputs + temp - aliased, an upper
bound on the peak: on CPU `peak_memory_in_bytes` counts arguments and outputs only),
then reports the median wall time of --runs calls after a warm-up call. Ratios are against the dense
reference. On CPU the Pallas kernels run in interpret mode (a loop over the grid),
so its time says nothing about a GPU and it is capped at --pallas-max-length.
The dense reference is skipped when its [B, H, L, L] f32 tensors would exceed
--reference-max-gib.
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

from engine.cost.memory import measure as measure_memory  # noqa: E402
from engine.cost.microbench import timed  # noqa: E402
from layers.kernels import (BlockSizes, blocked_attention, chunked_attention,  # noqa: E402
                            pallas_attention, reference_attention)

MIB = 2**20
# Dense fwd+bwd keeps about this many [B, H, L, L] f32 tensors alive at once
# (scores, probabilities, and their gradients).
DENSE_SCORE_COPIES = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool


@dataclasses.dataclass(frozen=True)
class Measurement:
    seconds: float
    temp_bytes: int
    total_bytes: int


def make_inputs(shape: Shape, seed: int = 0):
    """q_BLHK, k_BSGK, v_BSGK and a cotangent do_BLHK, drawn on the host."""
    rng = np.random.default_rng(seed)
    B, L, H, G, K = shape.batch, shape.length, shape.heads, shape.kv_heads, shape.head_dim
    draw = lambda *dims: jnp.asarray(rng.standard_normal(dims, np.float32), shape.dtype)
    return draw(B, L, H, K), draw(B, L, G, K), draw(B, L, G, K), draw(B, L, H, K)


def measure(attend, shape: Shape, runs: int) -> Measurement:
    """Compiles o and (dq, dk, dv) of `attend`; memory from XLA, median time of `runs`."""

    def forward_backward(q_BLHK, k_BSGK, v_BSGK, do_BLHK):
        o_BLHK, vjp = jax.vjp(attend, q_BLHK, k_BSGK, v_BSGK)
        return (o_BLHK, *vjp(do_BLHK))

    inputs = make_inputs(shape)
    compiled = jax.jit(forward_backward).lower(*inputs).compile()
    memory = measure_memory(compiled)
    return Measurement(timed(compiled, *inputs, reps=runs), memory["temp"], memory["peak"])


def implementations(shape: Shape, blocks: BlockSizes, args) -> dict:
    """name -> attend(q, k, v), or -> the reason it is skipped at this length."""
    causal = shape.causal
    dense_gib = DENSE_SCORE_COPIES * shape.batch * shape.heads * shape.length**2 * 4 / 2**30
    impls = {}
    if dense_gib <= args.reference_max_gib:
        impls["reference"] = lambda q, k, v: reference_attention(q, k, v, causal=causal)
        chunks = BlockSizes(block_q=args.chunk)
        impls["chunked"] = lambda q, k, v: chunked_attention(q, k, v, causal=causal,
                                                             blocks=chunks)
    else:
        impls["reference"] = impls["chunked"] = f"skipped: ~{dense_gib:.0f} GiB of dense scores"
    impls["blocked"] = lambda q, k, v: blocked_attention(q, k, v, causal=causal, blocks=blocks)
    if shape.length <= args.pallas_max_length:
        impls["pallas"] = lambda q, k, v: pallas_attention(q, k, v, causal=causal, blocks=blocks)
    else:
        impls["pallas"] = f"skipped: L > --pallas-max-length={args.pallas_max_length}"
    return impls


def ratio(value: float, reference: float | None) -> str:
    return "" if reference is None else f"{value / reference:.2f}"


def rows_for_length(shape: Shape, blocks: BlockSizes, args) -> list[list]:
    """One table row per implementation at one sequence length."""
    rows, reference = [], None
    for name, attend in implementations(shape, blocks, args).items():
        if isinstance(attend, str):
            rows.append([shape.length, name, "", "", "", "", "", attend])
            continue
        m = measure(attend, shape, args.runs)
        if name == "reference":
            reference = m
        rows.append([
            shape.length,
            name,
            f"{1e3 * m.seconds:.1f}",
            f"{m.temp_bytes / MIB:.1f}",
            f"{m.total_bytes / MIB:.1f}",
            ratio(m.seconds, reference and reference.seconds),
            ratio(m.temp_bytes, reference and reference.temp_bytes),
            "interpret mode" if name == "pallas" and jax.default_backend() == "cpu" else "",
        ])
        print(f"  L={shape.length} {name}: {1e3 * m.seconds:.1f} ms", file=sys.stderr)
    return rows


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64, help="queries per chunk (chunked)")
    parser.add_argument("--runs", type=int, default=3, help="timed calls after warm-up")
    parser.add_argument(
        "--pallas-max-length",
        type=int,
        default=4096 if jax.default_backend() == "cpu" else 1 << 20,
        help="longest L for Pallas (default 4096 on CPU, where it runs interpreted)",
    )
    parser.add_argument("--reference-max-gib", type=float, default=16.0)
    return parser.parse_args()


def main():
    args = parse_args()
    blocks = BlockSizes(block_q=args.block_q, block_k=args.block_k)
    print(
        f"backend={jax.default_backend()} B={args.batch} H={args.heads} G={args.kv_heads} "
        f"K={args.head_dim} dtype={args.dtype} causal={args.causal} "
        f"blocks=({args.block_q}, {args.block_k}) median of {args.runs} runs"
    )
    rows = []
    for length in args.lengths:
        shape = Shape(
            args.batch, length, args.heads, args.kv_heads, args.head_dim, args.dtype, args.causal
        )
        rows += rows_for_length(shape, blocks, args)
    headers = ["L", "impl", "fwd+bwd ms", "temp MiB", "total MiB", "time/ref", "temp/ref", "note"]
    print(tabulate(rows, headers=headers, stralign="right"))


if __name__ == "__main__":
    main()
