"""Raw text -> DATA.bin (a flat token array) + DATA.bin.json (its sidecar).

Documents are read in order (files in the order given, each glob's matches sorted) and
tokenized in chunks by a pool of processes (one per core, each with a one-thread
tokenizer); chunks come back in order, so the output does not depend on the number of
processes. The tokenizer's EOS follows every document. Tokens are uint16 when the vocab
fits, else uint32. Everything is written to a temporary file next to DATA.bin and
renamed at the end: an interrupted run leaves no DATA.bin (and no sidecar) behind.

The sidecar: {"format", "tokenizer", "tokenizer_hash", "vocab_size", "eos_id", "dtype",
"documents", "tokens", "bytes" (UTF-8 bytes of the documents), "sources"}.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from engine.text.documents import DocumentError, documents
from engine.text.tokenizer import load_tokenizer

FORMAT = "shardwise-tokens-1"
CHUNK_BYTES = 1 << 20  # text per task sent to a worker


def sidecar_path(path: str) -> str:
    return path + ".json"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_documents(tok, texts: list[str]) -> tuple[np.ndarray, int]:
    """(the documents' tokens, each followed by the EOS when the tokenizer has one, as
    one int64 array; their UTF-8 bytes)."""
    ids = tok.encode_batch(texts)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    flat = [i for doc in ids for i in doc + eos]
    return np.asarray(flat, np.int64), sum(len(t.encode("utf-8")) for t in texts)


_worker_tok = None


def _init_worker(spec, eos):
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process
    _worker_tok = load_tokenizer(spec, eos)


def _encode_chunk(texts):
    return (*encode_documents(_worker_tok, texts), len(texts))


def _chunks(files, text_field, errors, progress):
    """Lists of documents of about CHUNK_BYTES characters, in order."""
    chunk, size = [], 0
    for i, path in enumerate(files):
        progress.file = i + 1
        for text in documents(path, text_field, errors):
            chunk.append(text)
            size += len(text)
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


class Progress:
    """A progress line on stderr, redrawn at most twice a second."""

    def __init__(self, files: int, enabled: bool):
        self.files, self.enabled, self.file = files, enabled, 0
        self.t0 = self.shown = time.perf_counter()

    def update(self, docs: int, tokens: int, final: bool = False):
        now = time.perf_counter()
        if not self.enabled or (now - self.shown < 0.5 and not final):
            return
        self.shown = now
        rate = tokens / max(now - self.t0, 1e-9)
        print(f"\rfile {self.file}/{self.files} | {docs:,} documents | {tokens:,} tokens | "
              f"{rate:,.0f} tok/s", end="\n" if final else "", file=sys.stderr, flush=True)


def prepare(tokenizer: str | None, files: list[str], out: str, text_field: str = "text",
            errors: str = "strict", processes: int = 1, eos: str | None = None,
            progress: bool = False) -> dict:
    """Tokenize `files` into `out` and its sidecar; returns the sidecar. Raises
    DocumentError / TokenizerError for bad input (after removing the temporary file)."""
    tok = load_tokenizer(tokenizer, eos)
    dtype = token_dtype(tok.vocab_size)
    tmp = f"{out}.tmp{os.getpid()}"
    bar = Progress(len(files), progress)
    docs = tokens = nbytes = 0
    try:
        with open(tmp, "wb") as f:
            chunks = _chunks(files, text_field, errors, bar)
            first = list(itertools.islice(chunks, 2))  # one chunk: no pool to start
            chunks = itertools.chain(first, chunks)
            if processes > 1 and len(first) > 1:
                ctx = multiprocessing.get_context("spawn")  # safe beside threads (jax, rayon)
                pool = ctx.Pool(processes, _init_worker, (tokenizer, eos))
                results = pool.imap(_encode_chunk, chunks)
            else:
                pool, results = None, ((*encode_documents(tok, c), len(c)) for c in chunks)
            try:
                for ids, b, n in results:
                    ids.astype(dtype).tofile(f)
                    docs, tokens, nbytes = docs + n, tokens + len(ids), nbytes + b
                    bar.update(docs, tokens)
            finally:
                if pool is not None:
                    pool.terminate()
        bar.update(docs, tokens, final=True)
        if docs == 0:
            raise DocumentError(f"the input ({len(files)} file(s)) holds no documents")
        meta = dict(format=FORMAT, tokenizer=tok.name, tokenizer_hash=tok.hash,
                    vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=dtype, documents=docs,
                    tokens=tokens, bytes=nbytes, sources=[os.path.abspath(p) for p in files])
        with open(tmp + ".json", "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(sidecar_path(out)):  # never an old sidecar beside the new .bin
            os.remove(sidecar_path(out))
        os.replace(tmp, out)
        os.replace(tmp + ".json", sidecar_path(out))
        return meta
    finally:
        for p in (tmp, tmp + ".json"):
            if os.path.exists(p):
                os.remove(p)
