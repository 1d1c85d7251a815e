"""`python -m engine.train` as a user runs it: in a fresh process with no XLA_FLAGS."""
import json
import os
import subprocess
import sys

import pytest
from subprocess_env import cli_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(*args, timeout=600):
    env = cli_env()  # the CLI must force devices
    return subprocess.run([sys.executable, "-m", "engine.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_tiny_run_writes_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    r = train("--model", "tiny", "--steps", "5", "--layout", "fsdp4xtp2", "--batch", "8",
              "--seq", "32", "--log-every", "2", "--metrics-file", str(path))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"):
        assert all(isinstance(row[key], float) for row in rows), key
    assert "on 8 cpu device(s)" in r.stdout
    assert "step     5/5" in r.stdout and "tok/s" in r.stdout and "MFU" in r.stdout


@pytest.mark.parametrize("args,phrase", [
    (["--layout", "qq2xtp4"], "unknown axis 'qq'"),
    (["--layout", "pp4xtp2", "--model", "tiny"], "layers=2 not divisible by pp=4"),
    (["--layout", "pp2xtp4", "--model", "tiny", "--microbatches", "1"],
     "--pp-schedule 1f1b needs microbatches >= pp"),
    (["--layout", "fsdp3", "--model", "tiny"], "batch=16 not divisible by dp*fsdp*ep=3"),
    (["--layout", "tp8", "--model", "tiny"], "heads=4 not divisible by tp=8"),
    (["--model", "tiny", "--mlp-dim", "190", "--layout", "tp4"], "mlp_dim=190 not divisible by tp=4"),
    (["--model", "tiny", "--layout", "fsdp4xtp2", "--tp-comm", "sequence", "--seq", "15"],
     "--tp-comm sequence shards the sequence over tp: seq=15 not divisible by tp=2"),
    (["--zero", "2", "--prefetch"], "--prefetch needs --zero 3"),
    (["--steps", "0"], "steps=0 must be >= 1"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--lr", "abc"], "invalid float value: 'abc'"),
    (["--checkpoint-every", "0", "--keep", "0"], "checkpoint_every=0 must be >= 1; keep=0 must be >= 1"),
    (["--eval-every", "-1", "--seed", "-1", "--resume"],
     "eval_every=-1 must be >= 1; seed=-1 must be in [0, 2**32); --resume needs --checkpoint-dir"),
    (["--steps", "1000000000000", "--seq", "100000000", "--batch", "-2"],
     "batch=-2 must be >= 1; steps=1000000000000 is absurd (limit 1,000,000,000); "
     "seq=100000000 is absurd (limit 1,048,576)"),
    (["--data", "/nonexistent/corpus.txt"], "data file /nonexistent/corpus.txt not found"),
    (["--model", "llama3-70b"], "model needs 1051.3 GiB for params, grads and Adam state"),
])
def test_bad_input_is_one_line_exit_2(args, phrase):
    r = train(*args, timeout=60)
    assert r.returncode == 2
    assert phrase in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_help_lists_the_flags():
    r = train("--help", timeout=60)
    assert r.returncode == 0
    for flag in ("--layout", "--model", "--d-model", "--kv-heads", "--remat", "--metrics-file"):
        assert flag in r.stdout
