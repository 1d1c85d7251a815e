"""`kill -9` and `--resume` as a user does them: CLI subprocesses (each compiles its step,
so there are few). The killed run's metrics are the uninterrupted run's for the steps it
finished, so the overlapping steps after a resume must match them bit for bit (JSON
floats round-trip exactly)."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from subprocess_env import cli_env

from engine.run import checkpoint, lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--model", "tiny", "--layout", "fsdp4xtp2", "--batch", "8", "--seq", "32",
        "--dtype", "f32", "--data", "python-stdlib", "--peak-flops", "1e12", "--log-every", "1"]


def command(tmp_path, *extra) -> list[str]:
    return [sys.executable, "-m", "engine.train", *ARGS, "--checkpoint-dir", str(tmp_path / "ck"),
            "--metrics-file", str(tmp_path / "m.jsonl"), *extra]


def environment(**extra) -> dict:
    return cli_env(**extra)  # the CLI forces devices


def metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]


def assert_overlap_identical(rows: list[dict]):
    """Every step logged twice (by the killed run, then the resumed one) has the same
    loss, grad norm, lr and validation loss, bit for bit."""
    first = {}
    for row in rows:
        old = first.setdefault(row["step"], row)
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert row.get(key) == old.get(key), (row["step"], key, row.get(key), old.get(key))


# the default (async) in the default suite; the blocking writer kills alike (slow)
@pytest.mark.parametrize("mode", [pytest.param("--no-async-save", marks=pytest.mark.slow),
                                  "--async-save"])
def test_sigkill_inside_a_checkpoint_write_then_resume(tmp_path, mode):
    """Synchronous, the kill comes inside step 4's save; asynchronous, inside the
    background write of step 4's state, while steps 5 and 6 may already run."""
    cmd = command(tmp_path, "--steps", "6", "--checkpoint-every", "2", "--eval-every", "3",
                  mode)
    killed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=environment(**{checkpoint.KILL_HOOK: "4"}))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ck = tmp_path / "ck"
    names = sorted(set(os.listdir(ck)) - {lock.NAME})  # the killed run's lock file stays
    assert names[0] == ".step_00000004.ckpt.tmp-" + names[0].rsplit("-", 1)[1]
    assert names[1:] == ["step_00000002.ckpt"]  # the interrupted write left no step 4
    logged = [r["step"] for r in metrics(tmp_path)]
    assert logged == [1, 2, 3, 4] if mode == "--no-async-save" else logged[:4] == [1, 2, 3, 4]

    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, env=environment())
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ck / 'step_00000002.ckpt'} (step 2" in resumed.stdout
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == logged + [3, 4, 5, 6]
    assert_overlap_identical(rows)
    assert "val_loss" in rows[2] and "val_loss" in rows[-1]
    assert sorted(set(os.listdir(ck)) - {lock.NAME}) == [f"step_0000000{s}.ckpt"
                                                         for s in (2, 4, 6)]
    assert checkpoint.latest(str(ck)).step == 6


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume(tmp_path):
    kill_after = random.Random().randint(3, 9)  # steps logged before the kill
    cmd = command(tmp_path, "--steps", "20", "--checkpoint-every", "2")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        path = tmp_path / "m.jsonl"
        if path.exists() and path.read_text().count("\n") >= kill_after:
            time.sleep(random.Random().uniform(0, 0.05))
            break
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"run ended before the kill: {proc.stderr.read()}"
    logged = len(metrics(tmp_path))
    newest = checkpoint.latest(str(tmp_path / "ck"))  # complete and readable, whatever the moment
    assert newest.step <= logged and newest.step >= logged - 3, (kill_after, logged, newest.step)

    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, env=environment())
    assert resumed.returncode == 0, resumed.stderr
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows[logged:]] == list(range(newest.step + 1, 21))
    assert_overlap_identical(rows)
