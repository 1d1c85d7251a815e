"""Tokenizing throughput of `engine.prepare` on the Python standard library.

    nice python bench/prepare.py --vocab 8192

The corpus: the running Python's standard library sources (the `python-stdlib` data,
engine/run/data.py `stdlib_files`, each file one document). A byte-level BPE of `--vocab`
tokens is trained on it by `tokenizers` (or `--tokenizer PATH` is used). Then, on the same
documents, tokens per second (EOS included) of:

    prepare, 1 process        engine/text/prepare.py `prepare(processes=1)`, one-thread
                              tokenizer (TOKENIZERS_PARALLELISM=false)
    prepare, N processes      the same with one process per core: reading, pickling the
                              text to the workers and writing the .bin included
    encode_batch, 1 thread    `Tokenizer.encode_batch` on every document at once, in
                              memory, nothing written: the ceiling of one core
    encode_batch, N threads   the same with tokenizers' own thread pool: the ceiling

Each figure is the best of `--reps` runs; the token counts of all four must agree.
Invalid UTF-8 in a source file becomes U+FFFD (errors="replace") everywhere.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def train_bpe(paths: list[str], vocab: int, out: str) -> float:
    """A byte-level BPE with an <|endoftext|> EOS trained on the files; seconds taken."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator((Path(p).read_bytes().decode("utf-8", "replace") for p in paths),
                            trainer)
    tok.save(out)
    return time.perf_counter() - t0


def best(f, reps: int) -> tuple[float, int]:
    """(the shortest of `reps` calls in seconds, the tokens the call reports)."""
    times, tokens = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = f()
        times.append(time.perf_counter() - t0)
    return min(times), tokens


def main() -> None:
    from engine.run.data import stdlib_files
    from engine.text.prepare import prepare
    from engine.text.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizer", default=None, help="use this tokenizer.json, no training")
    p.add_argument("--processes", type=int, default=os.cpu_count())
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    root, rel = stdlib_files()
    paths = [os.path.join(root, r) for r in rel]
    nbytes = sum(os.path.getsize(x) for x in paths)
    print(f"corpus: {len(paths)} files, {nbytes / 1e6:.1f} MB under {root}")
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = args.tokenizer
        if tok_path is None:
            tok_path = os.path.join(tmp, "tokenizer.json")
            seconds = train_bpe(paths, args.vocab, tok_path)
            print(f"trained a {args.vocab}-token BPE in {seconds:.1f} s")
        tok = load_tokenizer(tok_path)
        texts = [Path(x).read_bytes().decode("utf-8", "replace") for x in paths]
        out = os.path.join(tmp, "stdlib.bin")

        def run_prepare(n):
            return lambda: prepare(tok_path, paths, out, errors="replace", processes=n)["tokens"]

        def run_encode_batch():
            return sum(len(e.ids) + 1 for e in tok.tok.encode_batch(texts,
                                                                    add_special_tokens=False))

        rows = []
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        rows.append(("prepare, 1 process", *best(run_prepare(1), args.reps)))
        rows.append(("encode_batch, 1 thread", *best(run_encode_batch, args.reps)))
        rows.append((f"prepare, {args.processes} processes",
                     *best(run_prepare(args.processes), args.reps)))
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        rows.append((f"encode_batch, {os.cpu_count()} threads", *best(run_encode_batch, args.reps)))
    counts = {n for _, _, n in rows}
    print(f"{'':<26}{'seconds':>9}{'tokens':>13}{'tok/s':>13}")
    for name, seconds, n in rows:
        print(f"{name:<26}{seconds:>9.2f}{n:>13,}{n / seconds:>13,.0f}")
    print("token counts agree" if len(counts) == 1 else f"token counts differ: {sorted(counts)}")


if __name__ == "__main__":
    main()
