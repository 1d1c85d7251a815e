"""`python -m engine.prepare --tokenizer tok.json --input 'corpus/*.jsonl' --out data.bin`:
tokenize raw text into a flat token array for `engine.train --data data.bin`
(engine/text/prepare.py). Bad input exits 2 with one line on stderr."""
from __future__ import annotations

import os
import sys
import time

from engine.text.documents import ERRORS, DocumentError, expand_inputs
from engine.text.tokenizer import TokenizerError, describe, load_tokenizer

# engine.cli.args (and so jax) is imported inside the functions: the pool's workers start
# by importing this module (the spawn start method), and must start fast


def build_parser():
    from engine.cli.args import DefaultsFormatter, OneLineParser

    p = OneLineParser(prog="python -m engine.prepare", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsFormatter)
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes, a Hugging Face tokenizer.json, or a directory holding one")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="the token that ends a document (default: the tokenizer "
                        "directory's tokenizer_config.json, else a special token such as "
                        "<|endoftext|> or </s>)")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE",
                   help="files or globs (quoted; ** recursive): .jsonl (one document a line) "
                        "or plain text (.txt, .py, ...: one document a file)")
    p.add_argument("--out", required=True, help="the token file to write, PATH.bin")
    p.add_argument("--text-field", default="text", help="the JSONL field holding the text")
    p.add_argument("--errors", default="strict", choices=ERRORS,
                   help="invalid UTF-8: strict refuses it (naming file, line and byte), "
                        "replace turns it into U+FFFD")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def main(argv=None) -> int:
    from engine.cli.args import UsageError
    from engine.text.prepare import prepare, sidecar_path

    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        if not args.out.endswith(".bin"):
            raise UsageError(f"--out {args.out}: want a PATH.bin")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise UsageError(f"--out {args.out}: no such directory")
        if args.processes < 1:
            raise UsageError(f"processes={args.processes} must be >= 1")
        files = expand_inputs(args.input)
        tok = load_tokenizer(args.tokenizer, args.eos)
        print(f"{describe(tok)}; {len(files)} file(s); {args.processes} process(es)",
              flush=True)
        if tok.eos_id is None:
            print("note: the tokenizer has no EOS: documents are concatenated without a "
                  "boundary (name one with --eos)", flush=True)
        t0 = time.perf_counter()
        meta = prepare(args.tokenizer, files, args.out, args.text_field, args.errors,
                       args.processes, args.eos, progress=not args.no_progress)
    except (UsageError, DocumentError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; {args.out} not written", file=sys.stderr)
        return 130
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: {meta['documents']:,} documents, {meta['tokens']:,} "
          f"{meta['dtype']} tokens ({meta['bytes'] / max(meta['tokens'], 1):.2f} bytes/token) "
          f"in {dt:.1f} s ({meta['tokens'] / max(dt, 1e-9):,.0f} tok/s); sidecar "
          f"{sidecar_path(args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
