"""Token data. The batch of step s is a pure function of (seed, s, data), so a resumed run
needs no iterator state, and each process builds only the rows of its own batch shard.

Sources (`--data`):

    synthetic       arithmetic progressions mod vocab (`synthetic_tokens`); the default
    PATH.txt        the file's bytes, one token each (memory-mapped); one document
    PATH.jsonl      the UTF-8 bytes of each line's "text" field, each followed by b"\\n"
                    (the field is --text-field)
    PATH.bin        a flat array of uint16 (or, with --data-dtype, uint32) tokens,
                    memory-mapped: the format nanoGPT's prepare.py writes. With a
                    sidecar PATH.bin.json (python -m engine.prepare writes one) its dtype,
                    tokenizer, vocab size and EOS id come from the sidecar
    python-stdlib   the running Python's standard library sources (*.py under
                    sysconfig's stdlib path, sorted by path, site-packages excluded), bytes

Validation: files hold out their last 10% of tokens; python-stdlib holds out the files
whose relative path has crc32 % 10 == 0 (about 10% of the files, the same on every
machine with the same Python); synthetic draws validation batches from random streams
the training steps never use. A training batch draws its offsets from
`np.random.default_rng([seed, step])`, a validation batch from `[seed, i, 1]`.

With a tokenizer (`--tokenizer`, engine/text/tokenizer.py) a .txt or .jsonl file is
tokenized when loaded, the tokenizer's EOS after each document, as engine.prepare would.
Text must be UTF-8: invalid bytes are refused (file, line, byte offset) unless
errors="replace". A Corpus carries `eos_id` (the EOS token of its documents, or None) and
`bytes_per_token` (UTF-8 bytes of text per token, for bits per byte).

Loading and checking import no jax, so the CLI reports bad data before jax starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
import zlib

import numpy as np

from engine.text.documents import DocumentError, documents
from engine.text.prepare import encode_documents, sidecar_path
from engine.text.tokenizer import BYTES

BIN_DTYPES = ("uint16", "uint32")
VAL_FRACTION = 10  # files hold out their last 1/10 of tokens
_VAL_STREAM = 1  # third word of a validation batch's seed: [seed, i] == [seed, i, 0]


class DataError(ValueError):
    """Unusable data: reported as one line, exit code 2."""


def synthetic_tokens(seed: int, step: int, batch: int, seq: int, vocab: int) -> np.ndarray:
    """[batch, seq + 1] int32 arithmetic progressions mod vocab.

    Each sequence starts at a random token and steps by a random stride in 1..4, so the
    next token is one of 4 successors of the current one (a bigram model reaches ln 4 ~
    1.39 nats) and is exactly determined by the last two (attention can reach ~0)."""
    return _progressions(np.random.default_rng([seed, step]), batch, seq, vocab, np.arange(batch))


def _progressions(rng, batch: int, seq: int, vocab: int, rows_R: np.ndarray) -> np.ndarray:
    """Rows `rows_R` of a [batch, seq + 1] progression batch -> [R, seq + 1] int32."""
    start_B1 = rng.integers(0, vocab, (batch, 1))
    stride_B1 = rng.integers(1, 5, (batch, 1))
    return ((start_B1[rows_R] + stride_B1[rows_R] * np.arange(seq + 1)) % vocab).astype(np.int32)


def _seed_words(seed: int, index: int, split: str) -> list[int]:
    return [seed, index] if split == "train" else [seed, index, _VAL_STREAM]


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """The default task; validation batches come from streams training never draws."""

    vocab: int
    name: str = "synthetic"
    eos_id = None
    tokenizer = None  # (name, hash) of the tokenizer that made the tokens
    bytes_per_token = None  # not text

    def describe(self) -> str:
        return "synthetic (arithmetic progressions)"

    def max_token(self) -> int:
        return self.vocab - 1

    def rows(self, seed: int, index: int, rows_R: np.ndarray, batch: int, seq: int,
             split: str = "train") -> np.ndarray:
        """Rows `rows_R` of batch `index` of `split` -> [R, seq + 1] int32."""
        rng = np.random.default_rng(_seed_words(seed, index, split))
        return _progressions(rng, batch, seq, self.vocab, rows_R)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A flat token stream split in two: train_T [T_train], val_T [T_val] (any uint dtype,
    possibly memory-mapped). Every window of seq + 1 tokens is a training sequence."""

    name: str
    train_T: np.ndarray
    val_T: np.ndarray
    files: int = 1
    eos_id: int | None = None  # the token ending each document, if the data has one
    bytes_per_token: float | None = 1.0  # UTF-8 bytes of text per token
    tokenizer: tuple[str, str] | None = (BYTES, BYTES)  # (name, hash); None: unknown

    def describe(self) -> str:
        files = f"{self.files} files, " if self.files > 1 else ""
        return (f"{self.name} ({files}{len(self.train_T):,} train / {len(self.val_T):,} "
                f"validation tokens)")

    def max_token(self) -> int:
        """The largest token id, read in chunks (a memory-mapped file is scanned once)."""
        chunk = 1 << 26
        return max(int(t[i:i + chunk].max()) for t in (self.train_T, self.val_T)
                   for i in range(0, len(t), chunk))

    def rows(self, seed: int, index: int, rows_R: np.ndarray, batch: int, seq: int,
             split: str = "train") -> np.ndarray:
        """Rows `rows_R` of batch `index` of `split` -> [R, seq + 1] int32. The offsets of
        the whole batch are drawn (B integers) so a row does not depend on who reads it."""
        tokens_T = self.train_T if split == "train" else self.val_T
        rng = np.random.default_rng(_seed_words(seed, index, split))
        start_B = rng.integers(0, len(tokens_T) - seq, batch)
        return np.stack([tokens_T[s:s + seq + 1] for s in start_B[rows_R]]).astype(np.int32)


def load_data(spec: str, vocab: int, bin_dtype: str = "uint16", tokenizer=None,
              text_field: str = "text", errors: str = "strict"):
    """`--data` value -> Synthetic | Corpus; raises DataError for a missing, empty or
    malformed source, or a .bin whose sidecar disagrees with `tokenizer` or `vocab`.
    `tokenizer`: None (bytes, or whatever a .bin's sidecar says) or a loaded tokenizer."""
    if spec == "synthetic":
        return Synthetic(vocab)
    if spec == "python-stdlib":
        if tokenizer is not None and tokenizer.hash != BYTES:
            raise DataError("--data python-stdlib is bytes: for another tokenizer, prepare "
                            "its files with python -m engine.prepare")
        return _python_stdlib()
    ext = os.path.splitext(spec)[1]
    if ext not in (".txt", ".jsonl", ".bin"):
        raise DataError(f"--data {spec!r}: want synthetic, python-stdlib, or a .txt, .jsonl "
                        f"or .bin file")
    if os.path.isdir(spec):
        raise DataError(f"--data {spec} is a directory: want a .txt, .jsonl or .bin file")
    if not os.path.isfile(spec):
        raise DataError(f"data file {spec} not found")
    if os.path.getsize(spec) == 0:
        raise DataError(f"data file {spec} is empty")
    extra = {}
    try:
        if ext == ".bin":
            tokens_T, extra = _bin_tokens(spec, bin_dtype, tokenizer, vocab)
        elif tokenizer is not None and tokenizer.hash != BYTES:
            tokens_T, nbytes = encode_documents(tokenizer, _documents(spec, text_field, errors))
            extra = dict(eos_id=tokenizer.eos_id, bytes_per_token=nbytes / max(len(tokens_T), 1),
                         tokenizer=(tokenizer.name, tokenizer.hash))
        elif ext == ".txt":
            tokens_T = _txt_bytes(spec, errors)
        else:
            tokens_T = _jsonl_bytes(spec, text_field, errors)
    except OSError as e:
        raise DataError(f"cannot read data file {spec}: {e.strerror or e}") from None
    n_val = len(tokens_T) // VAL_FRACTION
    return Corpus(spec, tokens_T[:len(tokens_T) - n_val], tokens_T[len(tokens_T) - n_val:],
                  **extra)


def _documents(path: str, text_field: str, errors: str) -> list[str]:
    try:
        docs = list(documents(path, text_field, errors))
    except DocumentError as e:
        raise DataError(str(e)) from None
    if not docs:
        raise DataError(f"data file {path} holds no documents")
    return docs


def _txt_bytes(path: str, errors: str) -> np.ndarray:
    """The file's bytes, memory-mapped when they are UTF-8 (else replaced, or refused)."""
    tokens_T = np.memmap(path, np.uint8, mode="r")
    try:
        tokens_T.tobytes().decode("utf-8")
        return tokens_T
    except UnicodeDecodeError:
        text, = _documents(path, "", errors)
        return np.frombuffer(text.encode("utf-8"), np.uint8)


def _jsonl_bytes(path: str, text_field: str = "text", errors: str = "strict") -> np.ndarray:
    docs = [text.encode("utf-8") + b"\n" for text in _documents(path, text_field, errors)]
    return np.frombuffer(b"".join(docs), np.uint8)


def read_sidecar(path: str) -> dict | None:
    """The sidecar of token file `path` (engine/text/prepare.py), or None without one."""
    side = sidecar_path(path)
    if not os.path.exists(side):
        return None
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
        need = ("tokenizer_hash", "vocab_size", "eos_id", "dtype", "tokens", "bytes")
        if not isinstance(meta, dict) or any(k not in meta for k in need):
            raise ValueError
    except (OSError, ValueError):
        raise DataError(f"{side} is not a token file's sidecar (python -m engine.prepare "
                        f"writes them)") from None
    return meta


def _bin_tokens(path: str, bin_dtype: str, tokenizer=None, vocab: int | None = None):
    """(the memory-mapped tokens, Corpus fields from the sidecar)."""
    meta = read_sidecar(path)
    if meta is not None:
        bin_dtype = meta["dtype"]
        if tokenizer is not None and tokenizer.hash != meta["tokenizer_hash"]:
            raise DataError(f"{path} was made by tokenizer {meta.get('tokenizer')} "
                            f"({meta['tokenizer_hash'][:19]}), not --tokenizer {tokenizer.name} "
                            f"({tokenizer.hash[:19]})")
        if vocab is not None and vocab < meta["vocab_size"]:
            raise DataError(f"{path}'s tokenizer has {meta['vocab_size']:,} tokens but the "
                            f"model's vocab is {vocab:,} (need --vocab >= {meta['vocab_size']})")
    itemsize = np.dtype(bin_dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise DataError(f"data file {path} has {size} bytes, not a whole number of "
                        f"{bin_dtype} tokens (see --data-dtype)")
    if meta is None:
        return np.memmap(path, np.dtype(bin_dtype), mode="r"), dict(bytes_per_token=None,
                                                                     tokenizer=None)
    if size != meta["tokens"] * itemsize:
        raise DataError(f"data file {path} has {size} bytes but its sidecar says "
                        f"{meta['tokens']} {bin_dtype} tokens")
    return np.memmap(path, np.dtype(bin_dtype), mode="r"), dict(
        eos_id=meta["eos_id"], bytes_per_token=meta["bytes"] / max(meta["tokens"], 1),
        tokenizer=(meta.get("tokenizer", "?"), meta["tokenizer_hash"]))


def stdlib_files() -> tuple[str, list[str]]:
    """(stdlib root, sorted relative paths of its *.py files, site-packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    rel = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        rel += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return root, sorted(rel)


def is_validation_file(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % VAL_FRACTION == 0


def _python_stdlib() -> Corpus:
    root, rel = stdlib_files()
    if not rel:
        raise DataError(f"no *.py files under the stdlib path {root}")
    parts = {"train": [], "val": []}
    for r in rel:
        with open(os.path.join(root, r), "rb") as f:
            parts["val" if is_validation_file(r) else "train"].append(f.read())
    train_T, val_T = (np.frombuffer(b"".join(parts[k]), np.uint8) for k in ("train", "val"))
    return Corpus("python-stdlib", train_T, val_T, files=len(rel))


def data_problems(data, seq: int, vocab: int, need_val: bool,
                  vocab_limit: int | None = None) -> list[str]:
    """What makes `data` unusable for sequences of `seq` tokens and a model of `vocab`
    (`vocab_limit`: the largest vocab the caller accepts; a token past it means the file
    was read with the wrong token dtype, not that the model is too small)."""
    if isinstance(data, Synthetic):
        return []
    problems = []
    if len(data.train_T) < seq + 1:
        problems.append(f"{data.name} is too short: its training split has "
                        f"{len(data.train_T)} tokens, one sequence needs seq+1={seq + 1}")
    if need_val and len(data.val_T) < seq + 1:
        problems.append(f"{data.name}: its validation split has {len(data.val_T)} tokens, "
                        f"--eval-every needs seq+1={seq + 1}")
    top = data.max_token()
    if vocab_limit is not None and top >= vocab_limit:
        problems.append(f"{data.name} holds token {top:,}, beyond any vocab the engine accepts "
                        f"(limit {vocab_limit:,}): read as {data.train_T.dtype.name}, is "
                        f"--data-dtype the file's token type?")
    elif top >= vocab:
        problems.append(f"{data.name} holds token {top} but the model's vocab is {vocab} "
                        f"(need --vocab >= {top + 1})")
    return problems


def local_rows(sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """[R] the batch rows held by this process's devices under `sharding`, sorted. In one
    process that is every row."""
    batch = global_shape[0]
    rows = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows.update(range(*index[0].indices(batch)))
    return np.asarray(sorted(rows))


def device_batch(data, sharding, seed: int, index: int, batch: int, seq: int,
                 split: str = "train"):
    """Batch `index` of `split` as a global [batch, seq + 1] int32 jax.Array sharded by
    `sharding`; this process computes only its own rows."""
    import jax

    shape = (batch, seq + 1)
    local_RL = data.rows(seed, index, local_rows(sharding, shape), batch, seq, split)
    return jax.make_array_from_process_local_data(sharding, local_RL, shape)
