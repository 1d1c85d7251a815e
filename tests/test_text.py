"""Real text: tokenizers, `engine.prepare` (tokens, EOS, sidecar, atomic output, processes),
data files checked against their sidecar, UTF-8 refused with file/line/byte, evaluation's
perplexity and bits per byte, and generation's tokenizer, stop and top-p. Tokenizers are
BPEs trained here by `tokenizers` on a few strings."""
import json
import math
import os

import numpy as np
import pytest

from engine.cli import prepare as prepare_cli, train as train_cli
from engine.run import data as D
from engine.text import prepare as P, tokenizer as T

DOCS = ["hello world, the quick brown fox", "jumps over the lazy dog", "héllo wörld ünïcode",
        "def main():\n    return 42\n"]


def bpe(path, eos="<|endoftext|>", vocab=300, words=DOCS):
    """A byte-level BPE trained on `words`, saved as path; its special tokens come first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(words * 20, trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    """(tokenizer path, [a.txt, b.jsonl]) holding DOCS: the .txt the first, the .jsonl the rest."""
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d, "n": 1}) + "\n\n"
                                              for d in DOCS[1:]))
    return bpe(tmp_path / "tok.json"), [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]


# -- tokenizers ------------------------------------------------------------------------
def test_tokenizer_file_and_directory_give_the_same_tokenizer_and_its_eos(tmp_path):
    from tokenizers import Tokenizer

    path = bpe(tmp_path / "tokenizer.json")
    ref = Tokenizer.from_file(path)
    tok = T.load_tokenizer(path)
    assert tok.eos_id == ref.token_to_id("<|endoftext|>") == 1
    assert tok.vocab_size == ref.get_vocab_size() and tok.hash.startswith("sha256:")
    assert tok.encode(DOCS[2]) == ref.encode(DOCS[2]).ids
    assert tok.decode(tok.encode(DOCS[2])) == DOCS[2]
    same = T.load_tokenizer(str(tmp_path))  # an HF model directory
    assert (same.hash, same.eos_id) == (tok.hash, tok.eos_id)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert T.load_tokenizer(str(tmp_path)).eos_id == 0  # the model's config names its EOS
    assert T.load_tokenizer(path, eos="<pad>").eos_id == 0
    none = T.load_tokenizer(bpe(tmp_path / "other.json", eos="<sep>"))
    assert none.eos_id is None
    assert T.load_tokenizer(None).hash == "bytes" and T.ByteTokenizer().encode("é") == [195, 169]


def test_streaming_decode_gives_the_text_piece_by_piece(tmp_path):
    for tok in (T.load_tokenizer(bpe(tmp_path / "t.json")), T.ByteTokenizer()):
        ids = tok.encode(DOCS[2] + " " + DOCS[3])
        stream = tok.stream()
        pieces = [stream.step(i) for i in ids]
        assert "".join(pieces) == DOCS[2] + " " + DOCS[3]
        assert sum(bool(p) for p in pieces) > 3  # streamed, not all at the end


# -- engine.prepare -------------------------------------------------------------------
def test_prepare_writes_each_document_then_eos_and_the_sidecar(corpus, tmp_path):
    tok_path, files = corpus
    tok = T.load_tokenizer(tok_path)
    out = str(tmp_path / "d.bin")
    meta = P.prepare(tok_path, files, out, processes=1)
    want = [i for d in DOCS for i in tok.encode(d) + [tok.eos_id]]
    got = np.fromfile(out, np.uint16)
    assert got.tolist() == want and got.tolist().count(tok.eos_id) == len(DOCS)
    with open(out + ".json") as f:
        assert json.load(f) == meta
    assert meta["documents"] == 4 and meta["tokens"] == len(want)
    assert meta["bytes"] == sum(len(d.encode()) for d in DOCS)
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (tok.vocab_size, 1, "uint16")
    assert meta["tokenizer_hash"] == tok.hash
    assert meta["sources"] == [os.path.abspath(f) for f in files]
    P.prepare(tok_path, files, str(tmp_path / "two.bin"), processes=2)
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "d.bin").read_bytes()
    assert P.token_dtype(65536) == "uint16" and P.token_dtype(65537) == "uint32"


def test_prepare_cli_globs_and_prints_what_it_wrote(corpus, tmp_path, capsys):
    tok_path, _ = corpus
    out = str(tmp_path / "g.bin")
    code = prepare_cli.main(["--tokenizer", tok_path, "--input", str(tmp_path / "*.txt"),
                             str(tmp_path / "*.jsonl"), "--out", out, "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and f"wrote {out}: 4 documents" in printed and "EOS 1" in printed
    assert np.fromfile(out, np.uint16).tolist().count(1) == 4


def test_interrupted_prepare_leaves_no_output(corpus, tmp_path, monkeypatch):
    tok_path, files = corpus
    out = tmp_path / "d.bin"
    calls = []

    def interrupt(tok, texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(tok, texts)

    real = P.encode_documents
    monkeypatch.setattr(P, "CHUNK_BYTES", 1)  # a chunk per document
    monkeypatch.setattr(P, "encode_documents", interrupt)
    with pytest.raises(KeyboardInterrupt):
        P.prepare(tok_path, files, str(out), processes=1)
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == ["a.txt", "b.jsonl", "tok.json"]


def prepare_bad(tmp_path, tok_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "nottok.json").write_text('{"hello": 1}')
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    return [
        (["--tokenizer", str(tmp_path / "nottok.json")], "a.txt",
         "nottok.json is not a Hugging Face tokenizer.json"),
        (["--tokenizer", str(tmp_path / "missing.json")], "a.txt", "no such file or directory"),
        ([], "*.md", f"--input '{tmp_path}/*.md' matches no file"),
        ([], "nofield.jsonl", f"{tmp_path}/nofield.jsonl line 2: no 'text' field"),
        ([], "latin1.jsonl", f"{tmp_path}/latin1.jsonl line 2, byte 28: not UTF-8 (b'\\xe9"),
        ([], "t.parquet", "parquet needs pyarrow"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_prepare_bad_input_is_one_line_exit_2(case, corpus, tmp_path, capsys):
    tok_path, _ = corpus
    extra, pattern, phrase = prepare_bad(tmp_path, tok_path)[case]
    argv = ["--tokenizer", tok_path, "--input", str(tmp_path / pattern), "--out",
            str(tmp_path / "x.bin"), *extra]
    code = prepare_cli.main(argv)
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert phrase in err and "Traceback" not in err
    assert not (tmp_path / "x.bin").exists()


def test_errors_replace_turns_invalid_utf8_into_replacement_characters(tmp_path, corpus):
    tok_path, _ = corpus
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 ok")
    meta = P.prepare(tok_path, [str(tmp_path / "bad.txt")], str(tmp_path / "r.bin"),
                     errors="replace")
    tok = T.load_tokenizer(tok_path)
    assert np.fromfile(tmp_path / "r.bin", np.uint16).tolist() == tok.encode("caf\ufffd ok") + [1]
    assert meta["bytes"] == len("caf\ufffd ok".encode())


# -- training data checked against the sidecar, the tokenizer and UTF-8 ---------------
def test_a_prepared_bin_brings_its_dtype_eos_and_bytes_per_token(corpus, tmp_path):
    tok_path, files = corpus
    out = str(tmp_path / "d.bin")
    meta = P.prepare(tok_path, files, out)
    tok = T.load_tokenizer(tok_path)
    data = D.load_data(out, vocab=512, bin_dtype="uint32", tokenizer=tok)  # sidecar: uint16
    got = np.concatenate([data.train_T, data.val_T])
    assert got.tolist() == np.fromfile(out, np.uint16).tolist()
    assert data.eos_id == 1 and data.bytes_per_token == meta["bytes"] / meta["tokens"]
    assert data.tokenizer == (tok_path, tok.hash)
    # the same documents from the raw files, tokenized when loaded
    raw = D.load_data(files[1], vocab=512, tokenizer=tok)
    assert np.concatenate([raw.train_T, raw.val_T]).tolist() == [
        i for d in DOCS[1:] for i in tok.encode(d) + [1]]
    assert raw.eos_id == 1 and D.load_data(files[1], vocab=512).eos_id is None


def train_bad(tmp_path, tok_path, files):
    out = str(tmp_path / "d.bin")
    P.prepare(tok_path, files, out)
    other = bpe(tmp_path / "other.json", words=["something else entirely"])
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "bad.txt").write_bytes(b"line one\ncaf\xe9\n" * 100)
    return [
        (["--data", out, "--tokenizer", other, "--vocab", "512"],
         f"{out} was made by tokenizer {tok_path}"),
        (["--data", out, "--tokenizer", "bytes"], f"{out} was made by tokenizer"),
        (["--data", out, "--vocab", "256"],
         "tokenizer has 300 tokens but the model's vocab is 256 (need --vocab >= 300)"),
        (["--data", files[1], "--tokenizer", tok_path],
         f"--tokenizer {tok_path} has 300 tokens but the model's vocab is 256"),
        (["--data", str(tmp_path / "bad.jsonl")],
         f"{tmp_path}/bad.jsonl line 2, byte 30: not UTF-8 (b'\\xe9"),
        (["--data", str(tmp_path / "bad.txt")],
         f"{tmp_path}/bad.txt line 2, byte 12: not UTF-8"),
        (["--data", str(tmp_path / "nottok.json"), "--tokenizer", str(tmp_path / "bad.txt")],
         "bad.txt is not a Hugging Face tokenizer.json"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_train_refuses_data_of_another_tokenizer_or_not_utf8(case, corpus, tmp_path, capsys):
    tok_path, files = corpus
    argv, phrase = train_bad(tmp_path, tok_path, files)[case]
    code = train_cli.main(["--model", "tiny", "--seq", "8", "--steps", "1", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert phrase in err


def test_invalid_utf8_data_is_replaced_only_when_asked(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "caf\xe9"}\n' * 40)
    data = D.load_data(str(tmp_path / "bad.jsonl"), vocab=256, errors="replace")
    assert bytes(data.train_T[:7]) == "caf\ufffd\n".encode()
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n" * 40)
    data = D.load_data(str(tmp_path / "bad.txt"), vocab=256, errors="replace")
    assert bytes(data.train_T[:7]) == "caf\ufffd\n".encode()


# -- evaluation -------------------------------------------------------------------------
def test_evaluation_reports_perplexity_and_bits_per_byte():
    import jax.numpy as jnp

    from engine.run.loop import Evaluate, Log, eval_summary, evaluate

    losses = {0: jnp.float32(2.0), 1: jnp.float32(3.0)}
    loss = lambda params, batch: losses[batch]  # a batch is its index here
    batch = lambda i, split: i if split == "val" else None
    got = evaluate(loss, None, batch, 2, bytes_per_token=4.0)
    assert got == dict(val_loss=2.5, val_ppl=math.exp(2.5), val_bpb=2.5 / math.log(2) / 4.0)
    assert "val_bpb" not in evaluate(loss, None, batch, 1, None)  # synthetic: no text
    assert eval_summary(got) == "val loss 2.5000 | ppl 12.18 | 0.902 bits/byte"
    session = type("S", (), dict(trainer=type("T", (), dict(loss=staticmethod(loss))),
                                 params=None, batch=staticmethod(batch)))
    record = dict(step=4)
    Evaluate(every=2, batches=2, steps=10, bytes_per_token=4.0)(record, session)
    assert record["val_bpb"] == got["val_bpb"]
    lines = []
    log = Log(every=100, steps=10, rates=None, say=lines.append)
    log(dict(record, step_time_s=1.0), None)
    assert lines == ["eval     4/10 | val loss 2.5000 | ppl 12.18 | 0.902 bits/byte"]


@pytest.mark.slow
def test_eval_only_on_a_checkpoint_equals_the_training_evaluation(corpus, tmp_path, capsys):
    tok_path, _ = corpus
    out, many = str(tmp_path / "d.bin"), tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"text": f"{DOCS[i % 4]} {i}"}) + "\n" for i in range(100)))
    P.prepare(tok_path, [str(many)], out)
    common = ["--model", "tiny", "--vocab", "320", "--data", out, "--seq", "8", "--batch", "4",
              "--eval-batches", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    metrics = tmp_path / "m.jsonl"
    assert train_cli.main([*common, "--steps", "2", "--eval-every", "2",
                           "--metrics-file", str(metrics), "--tokenizer", tok_path]) == 0
    trained = json.loads(metrics.read_text().splitlines()[-1])
    capsys.readouterr()
    assert train_cli.main([*common, "--eval-only", "--metrics-file",
                           str(tmp_path / "e.jsonl")]) == 0
    assert "val loss" in capsys.readouterr().out
    alone = json.loads((tmp_path / "e.jsonl").read_text())
    assert alone["step"] == 2
    for k in ("val_loss", "val_ppl", "val_bpb"):
        assert alone[k] == pytest.approx(trained[k], rel=1e-6), k  # the same batches, params


def test_eval_only_runs_the_layouts_switches(tmp_path, capsys):
    """--eval-only builds its trainer with the run's switches (--microbatches here; it
    took the defaults, and refused every pp layout: one microbatch < pp), and gives the
    loss training's evaluation gave (zero 2's evaluation: tests/test_zero.py)."""
    common = ["--model", "tiny", "--seq", "8", "--batch", "4", "--eval-batches", "1",
              "--layout", "pp2", "--microbatches", "2",
              "--checkpoint-dir", str(tmp_path / "ck")]
    assert train_cli.main([*common, "--steps", "1", "--eval-every", "1", "--metrics-file",
                           str(tmp_path / "m.jsonl")]) == 0
    trained = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert train_cli.main([*common, "--eval-only", "--metrics-file",
                           str(tmp_path / "e.jsonl")]) == 0
    alone = json.loads((tmp_path / "e.jsonl").read_text())
    assert alone["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)


# -- generation ------------------------------------------------------------------------
def test_top_p_keeps_the_smallest_set_reaching_p():
    import jax.numpy as jnp

    from engine.run.decode import Sampling, sample

    logits_BV = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]] * 512))
    rows_B = jnp.arange(512)

    def seen(**k):
        return set(np.asarray(sample(logits_BV, 0, 1, rows_B, Sampling(1.0, **k))).tolist())

    assert seen(top_p=0.7) == {1, 3}  # 0.5 + 0.3 reach 0.7
    assert seen(top_p=0.85) == {1, 3, 2}
    assert seen(top_p=0.5) == {1}  # the first token alone reaches p
    assert seen() == {0, 1, 2, 3}
    assert seen(top_k=3, top_p=0.7) == {1, 3}


def test_stop_and_stream_with_a_tokenizer(tmp_path):
    from engine.cli.generate import Stop, Stream, UsageError, parse_stop

    tok = T.load_tokenizer(bpe(tmp_path / "t.json"))
    ids = tok.encode("héllo wörld, the quick") + [tok.eos_id] + tok.encode(" more")
    for stop, want in [(Stop(tok, eos=True), "héllo wörld, the quick"),
                       (Stop(tok, "ld, t"), "héllo wör")]:
        written, out = [], []
        stream = Stream(stop, written.append)
        for i in ids:
            out.append(i)
            reason = "stop" if stop(out) else ""
            stream(0, i, reason)
            if reason:
                break
        assert "".join(written) == want == stop.shown(out, "stop")
    assert parse_stop("EOS", tok) == ("", True) and parse_stop(r"a\nb", tok) == ("a\nb", False)
    with pytest.raises(UsageError, match="has no EOS token"):
        parse_stop("EOS", T.ByteTokenizer())


@pytest.fixture
def text_checkpoint(tmp_path):
    """A tiny model's checkpoint (vocab 320, built on the host) trained, its meta says,
    with a BPE tokenizer; (directory, tokenizer path)."""
    import dataclasses

    import jax
    from test_checkpoint import host_state, meta, trainer

    from engine.config import model_config
    from engine.parallel.params import param_shapes
    from engine.run import checkpoint

    cfg = model_config("tiny", vocab=320)
    state = host_state(trainer("single", cfg), 0)
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    params = treedef.unflatten([state.params[jax.tree_util.keystr(p)] for p, _ in paths])
    tok_path = bpe(tmp_path / "tok.json")
    m = meta(cfg)
    m["data"].update(tokenizer=tok_path, tokenizer_hash=T.load_tokenizer(tok_path).hash)
    (tmp_path / "ck").mkdir()
    checkpoint.save(str(tmp_path / "ck"), 1, params, state.opt_state, m, 1)
    assert dataclasses.asdict(cfg)["vocab"] == 320
    return str(tmp_path / "ck"), tok_path


def test_generate_refuses_a_tokenizer_the_checkpoint_was_not_trained_with(text_checkpoint,
                                                                         tmp_path, capsys):
    from engine.cli.generate import main

    ck, tok_path = text_checkpoint
    for extra, phrase in [(["--tokenizer", bpe(tmp_path / "x.json", words=["other words"])],
                           f"was trained with tokenizer {tok_path}, not"),
                          (["--tokenizer", "bytes"], f"pass --tokenizer {tok_path}")]:
        assert main(["--checkpoint-dir", ck, "--prompt", "hello", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and phrase in err, err


def test_generate_streams_tokenizer_text_and_stops_at_eos(text_checkpoint, capsys, monkeypatch):
    """Greedy decoding from random weights, EOS forced as the 4th new token: the
    streamed text is the decoded continuation without the EOS."""
    import jax.numpy as jnp

    from engine.cli.generate import main
    from engine.run import decode

    ck, tok_path = text_checkpoint
    tok = T.load_tokenizer(tok_path)
    real = decode.sample

    def eos_at_3(logits_BV, seed, t, rows_B, sampling):
        return jnp.where(t == 3, tok.eos_id, real(logits_BV, seed, t, rows_B, sampling))

    monkeypatch.setattr(decode, "sample", eos_at_3)
    code = main(["--checkpoint-dir", ck, "--prompt", "hello world", "--temperature", "0",
                 "--stop", "EOS", "--max-new-tokens", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"=== 1: {len(tok.encode('hello world'))} prompt tokens ===" in out
    assert "=== 1: 4 new (stop) ===" in out
    body = out.split("prompt tokens ===\n")[1].split("\n=== 1:")[0]
    assert body.startswith("hello world") and "<|endoftext|>" not in body
