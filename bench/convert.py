"""Seconds and peak resident memory of `engine.convert from-hf` and `to-hf` on a
random-init Llama of ~1 B params made with `save_pretrained` (bf16 on disk).

    python bench/convert.py [--work DIR] [--layers 16] [--d-model 2048]

The model is made, and each conversion runs, in a process of its own (`python -m
engine.convert`), timed from outside; a conversion's peak RSS is that child's ru_maxrss
(os.wait4). This process never imports torch or jax: Linux hands a child its parent's
high-water RSS at fork and keeps it across exec, so a large parent would hide the
child's own peak. --reuse keeps an HF directory made by an earlier run. Printed beside the model's bytes in the HF files
(bf16) and in the checkpoint (f32 params). Figures only, no assertions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)


def make(directory: str, layers: int, d: int) -> int:
    """save_pretrained a random-init Llama (Llama 3.2 1B's shape by default); params."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128_256, hidden_size=d, intermediate_size=4 * d,
                                   num_hidden_layers=layers, num_attention_heads=d // 64,
                                   num_key_value_heads=8, head_dim=64,
                                   tie_word_embeddings=True, dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def params(hf: str) -> int:
    """Params in an HF directory's safetensors files (headers only)."""
    from engine.hf.io import Reader

    reader = Reader(hf)
    return sum(int(np.prod(reader.shape(name))) for name in reader.names())


def run(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of `python -m engine.convert argv` in a child process
    (its own rusage, from wait4)."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "engine.convert", *argv], cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"engine.convert {argv[0]} failed")
    return seconds, usage.ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/shardwise-bench-convert")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--reuse", action="store_true", help="keep WORK/hf if it is there")
    p.add_argument("--make-only", default=None, help=argparse.SUPPRESS)  # the child's job
    args = p.parse_args()
    if args.make_only:
        print(make(args.make_only, args.layers, args.d_model))
        return
    hf, ck, out = (os.path.join(args.work, x) for x in ("hf", "ck", "out"))
    for d in (ck, out) if args.reuse and os.path.isdir(hf) else (args.work,):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    if not os.path.isdir(hf):
        subprocess.run([sys.executable, __file__, "--make-only", hf, "--layers",
                        str(args.layers), "--d-model", str(args.d_model)], check=True)
        print(f"made the model with save_pretrained in {time.perf_counter() - t0:.1f} s")
    n = params(hf)
    print(f"{n / 1e9:.3f} B params")
    imp = run(["from-hf", hf, "--checkpoint-dir", ck])
    exp = run(["to-hf", "--checkpoint-dir", ck, "--out", out, "--dtype", "bf16"])
    gib = lambda b: b / 2**30
    print(f"model bytes: {gib(2 * n):.2f} GiB bf16, {gib(4 * n):.2f} GiB f32")
    print(f"import: {imp[0]:.1f} s, peak RSS {imp[1]:.2f} GiB "
          f"({imp[1] / gib(2 * n):.2f}x bf16 bytes, {imp[1] / gib(4 * n):.2f}x f32 bytes)")
    print(f"export: {exp[0]:.1f} s, peak RSS {exp[1]:.2f} GiB "
          f"({exp[1] / gib(2 * n):.2f}x bf16 bytes, {exp[1] / gib(4 * n):.2f}x f32 bytes)")


if __name__ == "__main__":
    main()
