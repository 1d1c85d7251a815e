"""Data sources: each one's tokens and splits, batches as pure functions of (seed, step),
sharded batches built from local rows, and bad data refused with one line, exit code 2."""
import json
import os

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.cli.train import main
from engine.parallel.layout import Layout
from engine.run import data as D

B, L = 8, 16


def windows_of(tokens_T: np.ndarray, rows_RL: np.ndarray) -> bool:
    """Every row is some contiguous window of tokens_T."""
    text = tokens_T.astype(np.int32).tobytes()
    return all(row.astype(np.int32).tobytes() in text for row in rows_RL)


def test_synthetic_is_the_original_task_and_validation_is_held_out():
    src = D.load_data("synthetic", vocab=256)
    got = src.rows(3, 5, np.arange(B), B, L)
    assert np.array_equal(got, D.synthetic_tokens(3, 5, B, L, 256))
    assert np.array_equal(src.rows(3, 5, np.array([2, 6]), B, L), got[[2, 6]])
    assert not np.array_equal(src.rows(3, 5, np.arange(B), B, L, "val"), got)
    assert D.data_problems(src, L, 256, need_val=True) == []


def test_txt_bytes_are_tokens_and_the_last_tenth_is_validation(tmp_path):
    text = bytes(range(32, 127)) * 20  # 1900 bytes
    (tmp_path / "a.txt").write_bytes(text)
    src = D.load_data(str(tmp_path / "a.txt"), vocab=256)
    assert len(src.val_T) == 190 and bytes(src.train_T) + bytes(src.val_T) == text
    rows = src.rows(0, 4, np.arange(B), B, L)
    assert rows.shape == (B, L + 1) and rows.dtype == np.int32
    assert windows_of(src.train_T, rows) and windows_of(src.val_T, src.rows(0, 0, np.arange(B), B, L, "val"))
    assert np.array_equal(rows, src.rows(0, 4, np.arange(B), B, L))  # pure function of (seed, step)
    assert not np.array_equal(rows, src.rows(0, 5, np.arange(B), B, L))
    assert np.array_equal(src.rows(0, 4, np.array([1, 7]), B, L), rows[[1, 7]])
    assert src.max_token() == 126


def test_jsonl_reads_the_text_fields(tmp_path):
    docs = ["hello wörld", "", "second document " * 10]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i})
                                                for i, d in enumerate(docs)) + "\n\n")
    src = D.load_data(str(tmp_path / "d.jsonl"), vocab=256)
    want = "".join(d + "\n" for d in docs).encode()
    assert bytes(src.train_T) + bytes(src.val_T) == want
    assert src.max_token() == max(want)


@pytest.mark.parametrize("dtype,top", [("uint16", 50256), ("uint32", 100_000)])
def test_bin_is_a_memory_mapped_token_array(dtype, top, tmp_path):
    tokens = np.arange(1000, dtype=dtype) * 7 % top
    tokens[500] = top
    tokens.tofile(tmp_path / "t.bin")
    src = D.load_data(str(tmp_path / "t.bin"), vocab=top + 1, bin_dtype=dtype)
    assert isinstance(src.train_T.base, np.memmap) or isinstance(src.train_T, np.memmap)
    assert np.array_equal(np.concatenate([src.train_T, src.val_T]), tokens)
    assert src.max_token() == top
    assert windows_of(src.train_T, src.rows(1, 0, np.arange(B), B, L))
    assert D.data_problems(src, L, top + 1, need_val=True) == []
    assert "holds token" in D.data_problems(src, L, top, need_val=False)[0]


def test_python_stdlib_is_sorted_byte_tokens_with_held_out_files():
    root, rel = D.stdlib_files()
    assert rel == sorted(rel) and "os.py" in rel
    assert not any("site-packages" in r for r in rel)
    val = [r for r in rel if D.is_validation_file(r)]
    assert 0.05 < len(val) / len(rel) < 0.15
    src = D.load_data("python-stdlib", vocab=256)
    sizes = {r: os.path.getsize(os.path.join(root, r)) for r in rel}
    assert len(src.val_T) == sum(sizes[r] for r in val)
    assert len(src.train_T) + len(src.val_T) == sum(sizes.values())
    first_train = next(r for r in rel if not D.is_validation_file(r))
    head = open(os.path.join(root, first_train), "rb").read(100)
    assert bytes(src.train_T[:100]) == head
    assert src.max_token() < 256 and D.data_problems(src, 256, 256, need_val=True) == []
    assert f"{len(rel)} files" in src.describe() and "validation tokens" in src.describe()


@pytest.mark.parametrize("layout,spec", [("fsdp4xtp2", P("fsdp", None)),
                                         ("dp2xfsdp2xtp2", P(("dp", "fsdp"), None)),
                                         ("tp8", P(None, None))])
def test_device_batch_is_sharded_and_built_from_local_rows(layout, spec, tmp_path):
    np.tile(np.arange(256, dtype=np.uint16), 4).tofile(tmp_path / "a.bin")
    src = D.load_data(str(tmp_path / "a.bin"), vocab=256)
    sharding = NamedSharding(Layout.parse(layout).mesh(), spec)
    assert list(D.local_rows(sharding, (B, L + 1))) == list(range(B))  # one process: all
    x = D.device_batch(src, sharding, 0, 3, B, L)
    assert x.sharding == sharding and x.shape == (B, L + 1)
    want = src.rows(0, 3, np.arange(B), B, L)
    assert np.array_equal(np.asarray(x), want)
    for shard in x.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), want[shard.index])


# -- bad data through the CLI (in-process main; data is checked before jax compiles) -----
def write(tmp_path, name, content) -> str:
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


BAD = [
    (lambda d: str(d / "missing.txt"), [], "data file {} not found"),
    (lambda d: write(d, "e.txt", b""), [], "data file {} is empty"),
    (lambda d: write(d, "s.txt", b"x" * 30), [], "too short: its training split has 27 tokens, "
                                                "one sequence needs seq+1=33"),
    (lambda d: write(d, "v.txt", b"x" * 200), ["--eval-every", "5"],
     "its validation split has 20 tokens, --eval-every needs seq+1=33"),
    (lambda d: write(d, "t.csv", "a,b"), [], "want synthetic, python-stdlib, or a .txt"),
    (lambda d: write(d, "j.jsonl", '{"text": "ok"}\n{"body": "no text"}\n'), [],
     "{} line 2: no 'text' field"),
    (lambda d: write(d, "n.jsonl", '{"text": 5}\n'), [], "line 1: 'text' is int"),
    (lambda d: write(d, "o.bin", b"\x01\x00\x02"), [], "has 3 bytes, not a whole number of uint16"),
    (lambda d: write(d, "big.bin", np.array([1, 300] * 100, np.uint16).tobytes()), [],
     "holds token 300 but the model's vocab is 256 (need --vocab >= 301)"),
    (lambda d: (d / "dir.txt").mkdir() or str(d / "dir.txt"), [],
     "--data {} is a directory"),
    (lambda d: write(d, "big32.bin", np.array([1, 70000] * 100, np.uint32).tobytes()),
     ["--data-dtype", "uint32"], "holds token 70000 but the model's vocab is 256"),
]


@pytest.mark.parametrize("make,extra,phrase", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_data_is_one_line_exit_2(make, extra, phrase, tmp_path, capsys):
    path = make(tmp_path)
    code = main(["--model", "tiny", "--seq", "32", "--steps", "1", "--data", path, *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert phrase.format(path) in err and err.startswith("error: ") and err.count("\n") == 1
