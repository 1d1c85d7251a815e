"""`python -m engine.convert from-hf HF_DIR --checkpoint-dir CK`: a Hugging Face Llama,
Mistral or Mixtral directory (config.json, safetensors) into a step-0 checkpoint that
`engine.train --resume` fine-tunes on any layout and `engine.generate` samples from;
`python -m engine.convert to-hf --checkpoint-dir CK --out DIR`: a checkpoint back into
an HF directory that `transformers` loads (engine/hf/convert.py; docs/huggingface.md).
Bad input exits 2 with one line on stderr."""
from __future__ import annotations

import sys

from engine.cli.args import DefaultsFormatter, OneLineParser, UsageError


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m engine.convert", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    imp = sub.add_parser("from-hf", help="HF directory -> shardwise checkpoint (step 0)",
                         formatter_class=DefaultsFormatter)
    imp.add_argument("hf_dir", help="directory with config.json and model.safetensors "
                                    "(or model.safetensors.index.json and its shards)")
    imp.add_argument("--checkpoint-dir", required=True, help="an empty or new directory")
    imp.add_argument("--vocab-multiple", type=int, default=128,
                     help="pad the vocab of the params to this multiple, so that any tp "
                          "dividing it fits (padding ids are kept out of loss and logits)")
    exp = sub.add_parser("to-hf", help="shardwise checkpoint -> HF directory",
                         formatter_class=DefaultsFormatter)
    exp.add_argument("--checkpoint-dir", required=True)
    exp.add_argument("--out", required=True, help="the HF directory to write")
    exp.add_argument("--step", type=int, default=None, help="default: the newest")
    exp.add_argument("--dtype", default="bf16", choices=("bf16", "f32"),
                     help="dtype of the safetensors tensors")
    exp.add_argument("--max-shard-size", default="50GB",
                     help="split the safetensors files above this size (as save_pretrained)")
    exp.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return p


def _checkpoint(directory: str, step: int | None) -> str:
    from engine.run import checkpoint

    found = dict(checkpoint.list_checkpoints(directory))
    if not found:
        raise UsageError(f"no checkpoint in {directory}")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise UsageError(f"no checkpoint of step {step} in {directory} (steps: "
                         f"{', '.join(map(str, sorted(found)))})")
    return found[step]


def run(args) -> int:
    from engine.hf import convert, io

    if args.command == "from-hf":
        if args.vocab_multiple < 1:
            raise UsageError(f"--vocab-multiple {args.vocab_multiple} must be >= 1")
        path = convert.import_hf(args.hf_dir, args.checkpoint_dir, args.vocab_multiple)
        print(f"wrote {path}")
        return 0
    try:
        max_bytes = io.parse_size(args.max_shard_size)
    except ValueError:
        raise UsageError(f"--max-shard-size {args.max_shard_size}: not a size") from None
    files = convert.export_hf(_checkpoint(args.checkpoint_dir, args.step), args.out,
                              args.dtype, max_bytes, args.force)
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


def main(argv=None) -> int:
    from engine.config import ConfigError
    from engine.hf.io import HFError
    from engine.run.checkpoint import CheckpointError

    try:
        return run(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    except (UsageError, HFError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
