"""Tokenizers: bytes (the default, no dependency) or a Hugging Face `tokenizer.json`
(the `tokenizers` package, imported only when one is loaded).

Both give `encode(text) -> list[int]`, `encode_batch`, `decode(ids) -> str`, a streaming
decoder, `vocab_size`, `eos_id` (None when the tokenizer has no end-of-document token)
and `hash`, which names the tokenizer in a data file's sidecar: "bytes", or the sha256
of the tokenizer.json file.

The EOS of a Hugging Face tokenizer: an `eos` given by the caller, else the `eos_token` of
the `tokenizer_config.json` beside a file named tokenizer.json (an HF model directory
holds both), else the first added special token
named like an end of text (`EOS_NAMES`), else none.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os

BYTES = "bytes"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eos|>")


class TokenizerError(ValueError):
    """A tokenizer path that does not hold a usable tokenizer: one line, exit code 2."""


class ByteTokenizer:
    """A token is a byte of the UTF-8 text; 256 tokens, no EOS."""

    name = BYTES
    hash = BYTES
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return token_bytes(ids).decode("utf-8", errors="replace")

    def stream(self):
        """A decoder fed one id at a time: `step(id) -> str` (may be empty while a UTF-8
        sequence is incomplete)."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return _Stream(lambda i: utf8.decode(token_bytes([i])))


REPLACEMENT = "\ufffd".encode()  # what a token >= 256 (not a byte) prints as


def token_bytes(ids) -> bytes:
    return b"".join(bytes([t]) if 0 <= t < 256 else REPLACEMENT for t in ids)


class _Stream:
    def __init__(self, step):
        self.step = step


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a tokenizer.json."""

    def __init__(self, path: str, eos: str | None = None):
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json ({first})") from None
        self.name = path
        self.hash = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos(eos)

    def _eos(self, eos: str | None) -> int | None:
        name = eos
        if name is None and os.path.basename(self.path) == "tokenizer.json":
            name = _config_eos(os.path.dirname(self.path))
        if name is None:
            specials = {t.content for t in self.tok.get_added_tokens_decoder().values()
                        if t.special}
            name = next((n for n in EOS_NAMES if n in specials), None)
        if name is None:
            return None
        i = self.tok.token_to_id(name)
        if i is None:
            raise TokenizerError(f"tokenizer {self.path} has no token {name!r} to end documents")
        return i

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def stream(self):
        from tokenizers.decoders import DecodeStream

        decoder = DecodeStream(skip_special_tokens=False)
        return _Stream(lambda i: decoder.step(self.tok, i) or "")


def _config_eos(directory: str) -> str | None:
    """The eos_token of `directory`/tokenizer_config.json, if there is one."""
    path = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(spec: str | None, eos: str | None = None):
    """`--tokenizer` value -> ByteTokenizer (None or "bytes") | HFTokenizer (a
    tokenizer.json, or a directory holding one); raises TokenizerError."""
    if spec is None or spec == BYTES:
        return ByteTokenizer()
    path = spec
    if os.path.isdir(spec):
        path = os.path.join(spec, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"--tokenizer {spec}: the directory holds no tokenizer.json")
    elif not os.path.isfile(spec):
        raise TokenizerError(f"--tokenizer {spec}: no such file or directory")
    return HFTokenizer(path, eos)


def describe(tok) -> str:
    eos = f"EOS {tok.eos_id}" if tok.eos_id is not None else "no EOS"
    return f"tokenizer {tok.name} ({tok.vocab_size:,} tokens, {eos})"
