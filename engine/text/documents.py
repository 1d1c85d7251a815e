"""Documents from raw files, checked: a `.jsonl` file holds one document per non-blank
line (its `text_field` string); any other file (`.txt`, `.py`, `.md`, ...) is one
document of plain text. Text must be UTF-8: with
errors="strict" an invalid byte is refused naming the file, line and byte offset; with
errors="replace" it becomes U+FFFD. Parquet is not read: it needs pyarrow, a large
dependency this engine does not otherwise have (convert to JSONL first)."""
from __future__ import annotations

import glob
import json
import os

PARQUET = ("{}: parquet needs pyarrow, which is not a dependency of this engine: convert "
           "it to JSONL")
ERRORS = ("strict", "replace")


class DocumentError(ValueError):
    """Unusable input text: one line, exit code 2."""


def _decode(raw: bytes, path: str, line: int, base: int, errors: str) -> str:
    """`raw` (line `line` of `path`, at byte `base` of the file) as text."""
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        raise DocumentError(f"{path} line {line}, byte {base + e.start}: not UTF-8 "
                            f"({raw[e.start:e.start + 4]!r}); fix the file or pass "
                            f"--errors replace (invalid bytes become U+FFFD)") from None


def documents(path: str, text_field: str = "text", errors: str = "strict"):
    """Yield the documents of one .txt or .jsonl file as str; raises DocumentError."""
    ext = os.path.splitext(path)[1]
    if ext == ".parquet":
        raise DocumentError(PARQUET.format(path))
    if ext != ".jsonl":
        with open(path, "rb") as f:
            yield _decode(f.read(), path, 1, 0, errors)
        return
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            line = _decode(raw, path, n, start, errors)
            try:
                record = json.loads(line)
            except ValueError:
                raise DocumentError(f"{path} line {n}: not a JSON object") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DocumentError(f"{path} line {n}: no {text_field!r} field (see "
                                    f"--text-field)")
            text = record[text_field]
            if not isinstance(text, str):
                raise DocumentError(f"{path} line {n}: {text_field!r} is "
                                    f"{type(text).__name__}, not a string")
            yield text


def expand_inputs(patterns) -> list[str]:
    """Files named by paths or globs (`**` recursive), each pattern's matches sorted, in
    pattern order, without repeats; raises DocumentError for a pattern matching no file."""
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not found:
            raise DocumentError(f"--input {pattern!r} matches no file")
        if bad := [p for p in found if p.endswith(".parquet")]:
            raise DocumentError(PARQUET.format(bad[0]))
        files += [p for p in found if p not in seen]
        seen.update(found)
    return files
