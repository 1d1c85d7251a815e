"""`python -m engine.generate --checkpoint-dir ck --prompt "def main("`: continue prompts
with the newest checkpoint's model, on any layout that fits it.

Prompts are tokenized by --tokenizer (default: UTF-8 bytes, one token per byte; the
model's vocab must cover the tokenizer's), right-padded to the longest and run through
one prefill; then one compiled decode step per token over a static-size KV cache
(engine/run/decode.py), sampled with --temperature, --top-k and --top-p. A row stops at
--max-new-tokens, when its decoded continuation contains --stop, or with `--stop EOS` at
the tokenizer's end-of-document token. One prompt's text is printed as it is decoded;
with several, each row is printed whole when all have finished. Ctrl-C stops decoding, prints
what every row has so far and exits 130. Bad input exits 2 with one line on stderr.
"""
from __future__ import annotations

import argparse
import codecs
import dataclasses
import math
import os
import sys
import time

from engine.cli.args import (
    DefaultsFormatter,
    OneLineParser,
    UsageError,
    force_host_devices,
    keep_freed_memory,
)
from engine.config import ConfigError
from engine.parallel.layout import Layout
from engine.text.tokenizer import BYTES, TokenizerError, describe, load_tokenizer
from layers import roles
from layers.config import DTYPES, ModelConfig

EOS = "EOS"  # --stop EOS: stop at the tokenizer's end-of-document token


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m engine.generate", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsFormatter)
    p.add_argument("--checkpoint-dir", required=True,
                   help="the newest checkpoint here is used; or a checkpoint file "
                        "(ck/step_00000100.ckpt)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="UTF-8 text, one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens whose probabilities sum to p "
                        "(nucleus sampling; after --top-k)")
    p.add_argument("--tokenizer", default=None,
                   help="bytes, a Hugging Face tokenizer.json or a directory holding one "
                        "(default: bytes); must be the one the checkpoint was trained with")
    p.add_argument("--seed", type=int, default=0, help="sampling is a function of the seed")
    p.add_argument("--stop", default=None,
                   help=r"stop a row when its continuation contains this text (backslash "
                        r"escapes: '\n\n'), or EOS: at the tokenizer's end-of-document token")
    p.add_argument("--layout", default="single", help="mesh axes, as engine.train takes them")
    p.add_argument("--cache-len", type=int, default=None,
                   help="KV cache slots per row (default: longest prompt + max new tokens)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="matmul compute dtype (default: the checkpoint's)")
    return p


@dataclasses.dataclass(frozen=True)
class Request:
    """Everything the command line asks for, checked; no jax needed to build it."""

    texts: tuple[str, ...]
    max_new: int
    layout: Layout
    args: argparse.Namespace
    # set by `bind` once the tokenizer is known (--tokenizer, else the checkpoint's)
    tok: object = None  # engine.text.tokenizer's ByteTokenizer | HFTokenizer
    prompts: tuple[tuple[int, ...], ...] = ()  # token ids
    stop: Stop = None
    cache_len: int = 0

    @property
    def unit(self) -> str:
        return "bytes" if self.tok.hash == BYTES else "tokens"


def read_prompts(args) -> list[str]:
    """--prompt values then --prompts-file lines (blank lines skipped)."""
    prompts = []
    for i, text in enumerate(args.prompt, 1):
        try:
            prompts.append(text.encode("utf-8").decode("utf-8"))
        except UnicodeEncodeError:
            raise UsageError(f"--prompt number {i} is not valid UTF-8 text") from None
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise UsageError(f"cannot read prompts file {args.prompts_file}: "
                             f"{e.strerror or e}") from None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"prompts file {args.prompts_file} is not UTF-8 text "
                             f"(byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
        prompts += [line.decode("utf-8") for line in raw.splitlines() if line]
    for i, prompt in enumerate(prompts, 1):
        if not prompt:
            raise UsageError(f"prompt {i} is empty (the model needs at least one token)")
    if not prompts:
        raise UsageError("no prompt: pass --prompt TEXT or --prompts-file PATH")
    return prompts


def parse(argv) -> Request:
    """argv -> Request; raises UsageError / LayoutError naming every problem."""
    args = build_parser().parse_args(argv)
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"max_new_tokens={args.max_new_tokens} must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        problems.append(f"temperature={args.temperature} must be >= 0 (0 is greedy)")
    if args.top_k is not None and args.top_k < 1:
        problems.append(f"top_k={args.top_k} must be >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"top_p={args.top_p} must be in (0, 1]")
    if not 0 <= args.seed < 2**32:
        problems.append(f"seed={args.seed} must be in [0, 2**32)")
    if args.cache_len is not None and args.cache_len < 1:
        problems.append(f"cache_len={args.cache_len} must be >= 1")
    if problems:
        raise UsageError("; ".join(problems))
    request = Request(tuple(read_prompts(args)), args.max_new_tokens,
                      Layout.parse(args.layout), args)
    return request if args.tokenizer is None else bind(request, open_tokenizer(args.tokenizer))


def open_tokenizer(spec: str):
    try:
        return load_tokenizer(spec)
    except TokenizerError as e:
        raise UsageError(str(e)) from None


def bind(request: Request, tok) -> Request:
    """`request` with its prompts tokenized by `tok`, its stop and its cache length."""
    args = request.args
    stop = Stop(tok, *parse_stop(args.stop, tok))
    prompts = [tuple(tok.encode(t)) for t in request.texts]
    unit = "bytes" if tok.hash == BYTES else "tokens"
    longest = max(len(p) for p in prompts)
    cache_len = args.cache_len or longest + args.max_new_tokens
    if longest + args.max_new_tokens > cache_len:
        which = 1 + max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise UsageError(f"prompt {which} is {longest} {unit}; with max_new_tokens="
                         f"{args.max_new_tokens} it needs {longest + args.max_new_tokens} "
                         f"cache slots, more than cache_len={cache_len}")
    return dataclasses.replace(request, tok=tok, prompts=tuple(prompts), stop=stop,
                               cache_len=cache_len)


def parse_stop(value: str | None, tok) -> tuple[str, bool]:
    """--stop -> (the text to stop at, whether to stop at EOS)."""
    if value is None or value == "":
        return "", False
    if value == EOS:
        if tok.eos_id is None:
            raise UsageError(f"--stop EOS: {describe(tok)} has no EOS token")
        return "", True
    try:
        return codecs.escape_decode(value.encode("utf-8"))[0].decode("utf-8"), False
    except (ValueError, UnicodeError) as e:
        raise UsageError(f"--stop {value!r}: {e}") from None


class Stop:
    """When a row stops: its decoded continuation contains `text`, or (with `eos`) its
    last token is the tokenizer's EOS. `cut(text)` is the continuation shown."""

    def __init__(self, tok, text: str = "", eos: bool = False):
        self.tok, self.text, self.eos = tok, text, eos

    def __bool__(self) -> bool:
        return bool(self.text) or self.eos

    def __call__(self, tokens) -> bool:
        if self.eos and tokens and tokens[-1] == self.tok.eos_id:
            return True
        return bool(self.text) and self.text in self.tok.decode(tokens)

    def shown(self, tokens, reason: str) -> str:
        """The text of a row's continuation, without its stop (the EOS, or the stop text
        and what followed it in the same token)."""
        if reason == "stop" and self.eos and tokens[-1] == self.tok.eos_id:
            tokens = tokens[:-1]
        text = self.tok.decode(tokens)
        if reason == "stop" and self.text and self.text in text:
            return text[:text.index(self.text)]
        return text


@dataclasses.dataclass(frozen=True)
class Generation:
    """Per prompt its continuation (tokens) and why it ended; timings for all rows."""

    tokens: tuple[tuple[int, ...], ...]
    reasons: tuple[str, ...]
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    interrupted: bool = False  # Ctrl-C: the rows hold what was decoded until then


def generate(decoder, params, prompts, max_new: int, seed: int, stop=None,
             on_token=None) -> Generation:
    """Continue each prompt (a sequence of token ids) by up to `max_new` tokens.

    Rows are right-padded to the longest prompt and the batch to `decoder.batch` with
    one-token dummy rows; row b's k-th new token is written to cache slot len_b + k.
    `on_token(b, token, reason)` sees each row's tokens as they are decoded (reason:
    "" while the row goes on). Ctrl-C (KeyboardInterrupt) ends the loop: unfinished rows
    get the reason "interrupted" and the result says so. `stop(tokens) -> bool` (a
    `Stop`) ends a row with the reason "stop"."""
    import jax
    import numpy as np

    n, B = len(prompts), decoder.batch
    lengths_B = np.ones(B, np.int32)
    lengths_B[:n] = [len(p) for p in prompts]
    tokens_BL = np.zeros((B, int(lengths_B.max())), np.int32)
    for b, prompt in enumerate(prompts):
        tokens_BL[b, :len(prompt)] = prompt
    out = [[] for _ in range(n)]
    reasons = [""] * n

    def take(next_B):
        for b, tok in enumerate(np.asarray(jax.device_get(next_B))[:n].tolist()):
            if reasons[b]:
                continue
            out[b].append(tok)
            if stop and stop(out[b]):
                reasons[b] = "stop"
            elif len(out[b]) == max_new:
                reasons[b] = "max tokens"
            if on_token is not None:
                on_token(b, tok, reasons[b])

    t0 = time.perf_counter()
    prefill_s, steps, interrupted = 0.0, 0, False
    try:
        cache, next_B, _ = decoder.prefill(params, tokens_BL, lengths_B, seed)
        take(next_B)
        prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
        for t in range(1, max_new):
            if all(reasons):
                break
            cache, next_B, _ = decoder.step(params, cache, next_B, lengths_B + t - 1, t, seed)
            take(next_B)
            steps += 1
    except KeyboardInterrupt:
        interrupted = True
        reasons = [r or "interrupted" for r in reasons]
    decode_s = time.perf_counter() - t0
    return Generation(tuple(tuple(o) for o in out), tuple(reasons),
                      int(lengths_B[:n].sum()), prefill_s, steps * n, decode_s, interrupted)


class Stream:
    """Writes one row's new text as it is decoded (`on_token` of `generate`). Holds back
    the last len(stop text) - 1 characters, which may turn out to begin the stop (never
    printed); the tokenizer's streaming decoder holds back incomplete characters."""

    def __init__(self, stop: Stop, write):
        self.stop, self.write, self.pending = stop, write, ""
        self.decoder = stop.tok.stream()

    def __call__(self, row: int, token: int, reason: str) -> None:
        at_eos = reason == "stop" and self.stop.eos and token == self.stop.tok.eos_id
        if not at_eos:
            self.pending += self.decoder.step(token)
        if reason == "stop" and self.stop.text and self.stop.text in self.pending:
            self.pending = self.pending[:self.pending.index(self.stop.text)]
        keep = 0 if reason else min(len(self.pending), max(len(self.stop.text) - 1, 0))
        ready, self.pending = (self.pending[:len(self.pending) - keep],
                               self.pending[len(self.pending) - keep:])
        if ready:
            self.write(ready)

    def close(self) -> None:
        """Write what is held back (the run ended without a reason: interrupted)."""
        if self.pending:
            self.write(self.pending)
        self.pending = ""


def rate(tokens: int, seconds: float) -> str:
    """"N tokens in S s (R tok/s)" for the timing line."""
    from engine.run.loop import per_second

    if seconds <= 0:
        return f"{tokens} tokens"
    return f"{tokens} tokens in {seconds:.3f} s ({per_second(tokens / seconds)} tok/s)"


def load_model(request: Request):
    """(checkpoint, ModelConfig, the request bound to its tokenizer) of the newest
    checkpoint; raises UsageError."""
    from engine.run import checkpoint

    directory = request.args.checkpoint_dir
    # the optimizer state is not used
    ckpt = (checkpoint.read(directory, parts=("params",)) if os.path.isfile(directory)
            else checkpoint.latest(directory, parts=("params",)))
    if ckpt is None:
        raise UsageError(f"no checkpoint in {directory}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = {k: v for k, v in ckpt.meta.get("model", {}).items() if k in fields}
    cfg = ModelConfig(**saved)
    if request.args.dtype:
        cfg = dataclasses.replace(cfg, dtype=request.args.dtype)
    trained = ckpt.meta.get("data", {}).get("tokenizer_hash")
    name = ckpt.meta.get("data", {}).get("tokenizer") or BYTES
    if request.tok is None:  # the checkpoint's tokenizer
        if trained not in (None, BYTES) and not os.path.exists(name):
            raise UsageError(f"checkpoint {ckpt.path} was trained with tokenizer {name}, "
                             f"which is gone: pass --tokenizer")
        request = bind(request, open_tokenizer(BYTES if trained is None else name))
    tok = request.tok
    if cfg.vocab < tok.vocab_size:
        raise UsageError(f"checkpoint {ckpt.path} has vocab={cfg.vocab}; {describe(tok)} "
                         f"needs vocab >= {tok.vocab_size}")
    if trained is not None and trained != tok.hash:
        raise UsageError(f"checkpoint {ckpt.path} was trained with tokenizer {name}, not "
                         f"{tok.name}: pass --tokenizer {name}")
    return ckpt, cfg, request


def load_params(ckpt, cfg: ModelConfig, layout: Layout, mesh, batch: int):
    """The checkpoint's params placed as `layout` stores them."""
    from engine.config import TrainConfig
    from engine.run import checkpoint
    from engine.run.step import Trainer

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    tcfg = TrainConfig(**{k: v for k, v in ckpt.meta.get("train", {}).items() if k in fields})
    trainer = Trainer(cfg, dataclasses.replace(tcfg, batch=batch), layout, mesh)
    return checkpoint.restore_params(ckpt, trainer)


def run(request: Request) -> int:
    from engine.run.checkpoint import CheckpointError

    try:
        ckpt, cfg, request = load_model(request)
        layout = request.layout
        rows = math.prod(layout.degree(r) for r in roles.roles_sharding("batch"))
        batch = -(-len(request.prompts) // rows) * rows
        from engine.run.decode import check_decoder

        check_decoder(cfg, layout, batch, request.cache_len)
        return _generate(request, ckpt, cfg, batch)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(request: Request, ckpt, cfg: ModelConfig, batch: int) -> int:
    from engine.run.decode import Decoder, Sampling

    args, layout = request.args, request.layout
    mesh = layout.mesh()
    params = load_params(ckpt, cfg, layout, mesh, batch)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    decoder = Decoder(cfg, layout, mesh, batch, request.cache_len, sampling)
    how = ("greedy" if sampling.temperature == 0 else
           f"temperature {sampling.temperature}"
           + (f" top-k {sampling.top_k}" if sampling.top_k else "")
           + (f" top-p {sampling.top_p}" if sampling.top_p else "") + f" seed {args.seed}")
    devices = list(mesh.devices.flat)
    print(f"checkpoint {ckpt.path} (step {ckpt.step}, trained under "
          f"{ckpt.meta.get('layout')}); model D={cfg.d_model} N={cfg.n_layers} "
          f"H={cfg.n_heads} G={cfg.n_kv_heads} K={cfg.head_dim} V={cfg.vocab}, {cfg.dtype}; "
          f"layout {layout} on {len(devices)} {devices[0].platform} device(s); "
          f"{len(request.prompts)} prompt(s) in a batch of {batch}; cache {request.cache_len} "
          f"slots; {how}; {describe(request.tok)}", flush=True)
    seconds = decoder.compile(params, max(len(p) for p in request.prompts))
    print(f"compiled prefill and decode step in {seconds:.1f} s", flush=True)
    prompts, unit = [list(p) for p in request.prompts], request.unit
    if len(prompts) == 1:  # streamed: an interrupted run keeps what it printed
        print(f"=== 1: {len(prompts[0])} prompt {unit} ===")
        print(request.texts[0], end="", flush=True)
        stream = Stream(request.stop, lambda text: print(text, end="", flush=True))
        gen = generate(decoder, params, prompts, request.max_new, args.seed, request.stop,
                       on_token=stream)
        stream.close()
        print(f"\n=== 1: {len(gen.tokens[0])} new ({gen.reasons[0]}) ===", flush=True)
    else:  # rows finish at different times: each printed whole at the end
        gen = generate(decoder, params, prompts, request.max_new, args.seed, request.stop)
        for i, (prompt, tokens, reason) in enumerate(zip(request.prompts, gen.tokens,
                                                         gen.reasons)):
            print(f"=== {i + 1}: {len(prompt)} prompt {unit} + {len(tokens)} new ({reason}) ===")
            print(request.texts[i] + request.stop.shown(tokens, reason), flush=True)
    print(f"prefill: {rate(gen.prefill_tokens, gen.prefill_s)} | decode: "
          f"{rate(gen.decode_tokens, gen.decode_s)}", flush=True)
    if gen.interrupted:
        print(f"interrupted after {max(map(len, gen.tokens))} new token(s)", file=sys.stderr)
        return 130
    return 0


def main(argv=None) -> int:
    try:
        request = parse(sys.argv[1:] if argv is None else argv)
        force_host_devices(request.layout.size)
        keep_freed_memory()
        return run(request)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # loading or compiling (generation reports its own)
        print("interrupted before generating", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
