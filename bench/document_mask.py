"""What the document mask costs or saves: attention forward+backward with and without
segment ids, per kernel, for windows packed with documents of a given length.

Usage (from the repo root):
    python bench/document_mask.py                          # L = 2048, documents of 256
    python bench/document_mask.py --length 4096 --doc-length 512 1024 --kernels blocked

For each kernel it jits value-and-VJP on random inputs, causal, once without segment
ids and once with the ids of documents of --doc-length tokens (the last one cut by the
window), and prints the median wall time of --runs calls after a warm-up call, the
ratio masked / plain, and the share of the causal score tiles (of --block keys) that
some query still sees (what a kernel that skips fully masked tiles must compute).
Pallas is left out on CPU (interpret mode times the interpreter, not the kernel).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

from engine.cost.microbench import timed  # noqa: E402
from layers.documents import document_ids  # noqa: E402
from layers.kernels import KERNELS, BlockSizes  # noqa: E402
from layers.kernels.shared import SegmentIds  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048, help="tokens per window (L)")
    p.add_argument("--doc-length", type=int, nargs="+", default=[256],
                   help="tokens per document (EOS included)")
    p.add_argument("--kernels", nargs="+", default=["reference", "chunked", "blocked"],
                   choices=sorted(KERNELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128, help="key block / query chunk size")
    p.add_argument("--runs", type=int, default=5)
    return p.parse_args(argv)


def visible_tiles(ids_L: np.ndarray, block: int) -> float:
    """Share of the causal (query block, key block) tiles in which some query sees a
    key of its own document."""
    n = len(ids_L) // block
    first, last = ids_L[::block], ids_L[block - 1::block]
    causal = [(i, j) for i in range(n) for j in range(i + 1)]
    return sum(last[j] >= first[i] for i, j in causal) / len(causal)


def main(argv=None):
    args = parse(argv)
    B, L, H, G, K = args.batch, args.length, args.heads, args.kv_heads, args.head_dim
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, L, H, K), jnp.float32)
    k = jax.random.normal(keys[1], (B, L, G, K), jnp.float32)
    v = jax.random.normal(keys[2], (B, L, G, K), jnp.float32)
    do = jax.random.normal(keys[3], (B, L, H, K), jnp.float32)
    blocks = BlockSizes(block_q=args.block, block_k=args.block)
    rows = []
    for doc in args.doc_length:
        tokens = np.ones((B, L), np.int32)
        tokens[:, doc - 1::doc] = 0  # EOS (id 0) ends every document
        ids = document_ids(jnp.asarray(tokens), 0)
        share = visible_tiles(np.asarray(ids[0]), args.block)
        for name in args.kernels:
            attend = KERNELS[name]
            extra = {} if name == "reference" else dict(blocks=blocks)

            def run(q, k, v, do, seg, attend=attend, extra=extra):
                f = lambda q, k, v: attend(q, k, v, causal=True, segment_ids=seg, **extra)
                o, vjp = jax.vjp(f, q, k, v)
                return o, vjp(do)

            plain = timed(jax.jit(lambda q, k, v, do: run(q, k, v, do, None)), q, k, v, do,
                          reps=args.runs)
            masked = timed(jax.jit(lambda q, k, v, do, ids: run(q, k, v, do,
                                                                 SegmentIds(ids, ids))),
                           q, k, v, do, ids, reps=args.runs)
            rows.append([name, L, doc, f"{plain * 1e3:.1f}", f"{masked * 1e3:.1f}",
                         f"{masked / plain:.2f}", f"{share:.2f}"])
    print(tabulate(rows, headers=["kernel", "L", "doc", "plain ms", "masked ms",
                                  "masked/plain", "tiles seen"]))


if __name__ == "__main__":
    main()
