"""Several processes on one machine, as `python -m engine.launch` runs them: 2 processes x
4 forced CPU devices (gloo collectives) against 1 process x 8 devices, checkpoints
across process counts, and the launcher's fail-fast. Every run is a subprocess with
XLA_FLAGS dropped, so the CLI forces layout size / processes devices itself. A 2-process
run of the tiny model takes ~50 s here (two compiles sharing 2 cores, gloo set-up)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from subprocess_env import cli_env

from engine.cli.args import UsageError, parse
from engine.run import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--model", "tiny", "--layout", "fsdp4xtp2", "--batch", "8", "--seq", "32",
        "--dtype", "f32", "--peak-flops", "1e12", "--log-every", "1"]
STEPS = ["--steps", "4", "--checkpoint-every", "2"]
# Same layout, same math; the cross-process psums (gloo) may order f32 sums differently
# from the in-process ones: 1e-5 relative is ~100 ulps, as in test_step.py.
RTOL = 1e-5
TIMEOUT = 600


def environment() -> dict:
    return cli_env()  # the CLI forces devices


def train(tmp_path, name, *args, processes=1):
    """Run engine.train (processes == 1) or engine.launch; -> (CompletedProcess, rows)."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd = ([sys.executable, "-m", "engine.train"] if processes == 1 else
           [sys.executable, "-m", "engine.launch", "--processes", str(processes), "--"])
    r = subprocess.run([*cmd, *ARGS, *args, "--metrics-file", str(metrics)], cwd=ROOT,
                       env=environment(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, [json.loads(line) for line in metrics.read_text().splitlines()]


def assert_close(rows, reference):
    """Same steps; loss and grad norm within RTOL of the reference run's."""
    want = {row["step"]: row for row in reference}
    assert [row["step"] for row in rows] and all(row["step"] in want for row in rows)
    for row in rows:
        for key in ("loss", "grad_norm"):
            ref = want[row["step"]][key]
            assert abs(row[key] - ref) <= RTOL * abs(ref), (row["step"], key, row[key], ref)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps (checkpoints at 2 and 4) in 1 process x 8 devices and in
    2 processes x 4 devices."""
    tmp = tmp_path_factory.mktemp("multihost")
    out = {}
    for processes in (1, 2):
        ck = tmp / f"ck{processes}"
        r, rows = train(tmp, f"m{processes}", *STEPS, "--checkpoint-dir", str(ck),
                        processes=processes)
        out[processes] = dict(result=r, rows=rows, ck=ck)
    return out


def test_two_processes_match_one(runs):
    one, two = runs[1], runs[2]
    assert [r["step"] for r in two["rows"]] == [1, 2, 3, 4]
    assert_close(two["rows"], one["rows"])
    out = two["result"].stdout
    assert "on 8 cpu device(s) in 2 processes" in out
    assert out.count("step     4/4") == 1 and out.count("saved ") == 2  # process 0 only
    assert sorted(set(os.listdir(two["ck"])) - {".lock"}) == [
        "step_00000002.ckpt", "step_00000002.ckpt.shard-00001-of-00002",
        "step_00000004.ckpt", "step_00000004.ckpt.shard-00001-of-00002"]
    assert sorted(set(os.listdir(one["ck"])) - {".lock"}) == ["step_00000002.ckpt",
                                                              "step_00000004.ckpt"]


def resume_from_step_2(runs, tmp_path, writer: int, reader: int):
    ck = tmp_path / "ck"
    ck.mkdir()
    for name in os.listdir(runs[writer]["ck"]):
        if name.startswith("step_00000002.ckpt"):
            shutil.copy(runs[writer]["ck"] / name, ck / name)
    r, rows = train(tmp_path, "resumed", *STEPS, "--checkpoint-dir", str(ck), "--resume",
                    processes=reader)
    assert "resumed from" in r.stdout and "(step 2, written under layout fsdp4xtp2" in r.stdout
    assert [row["step"] for row in rows] == [3, 4]
    assert_close(rows, runs[writer]["rows"])
    assert_close(rows, runs[reader]["rows"])


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one(runs, tmp_path):
    resume_from_step_2(runs, tmp_path, writer=2, reader=1)


@pytest.mark.slow
def test_checkpoint_of_one_process_resumes_in_two(runs, tmp_path):
    resume_from_step_2(runs, tmp_path, writer=1, reader=2)


def wait_for(condition, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("when", ["starting", pytest.param("training", marks=pytest.mark.slow)])
def test_killing_one_process_stops_the_other(when, tmp_path):
    """SIGKILL process 1 while process 0 waits for it (in jax.distributed's start-up, or
    inside a training step's collectives): the launcher stops process 0 and says why."""
    metrics, err = tmp_path / "m.jsonl", tmp_path / "err.txt"
    with open(err, "w") as err_f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "engine.launch", "--processes", "2", "--", *ARGS,
             "--steps", "100000", "--metrics-file", str(metrics)],
            cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=err_f)
    try:
        pids = wait_for(lambda: re.search(r"\(pids (\d+), (\d+)\)", err.read_text()),
                        "the launcher's pid line", 60)
        pid0, pid1 = int(pids.group(1)), int(pids.group(2))
        if when == "starting":
            time.sleep(2)
        else:
            wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2,
                     "two training steps")
        os.kill(pid1, signal.SIGKILL)
        code = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert code == 128 + signal.SIGKILL
    assert "Traceback" not in err.read_text()  # the stopped survivor's output is dropped
    last = err.read_text().strip().splitlines()[-1]
    assert last == (f"engine.launch: process 1 (pid {pid1}) was killed by SIGKILL; "
                    f"stopped the other 1 running process(es)")
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


# -- flags and environment (no subprocess) ------------------------------------------------
@pytest.mark.parametrize("args,phrase", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"],
     "--coordinator, --num-processes needs --process-id too"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 'localhost': want HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "process_id=2 must be in [0, 2)"),
    (["--coordinator", "h:1", "--num-processes", "3", "--process-id", "0"],
     "layout of 8 devices does not split over 3 processes"),
])
def test_bad_process_flags_are_refused(args, phrase):
    with pytest.raises(UsageError, match=re.escape(phrase)):
        parse(["--model", "tiny", "--layout", "fsdp4xtp2", *args])


def test_cluster_environments_give_the_process_count():
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="2",
                 SLURM_PROCID="1", SLURM_LOCALID="0")
    assert distributed.cluster_process_count(slurm) == 2
    assert distributed.cluster_process_count(
        dict(OMPI_MCA_orte_hnp_uri="x", OMPI_COMM_WORLD_SIZE="4")) == 4
    assert distributed.cluster_process_count(dict(TPU_WORKER_HOSTNAMES="a,b")) == 2
    assert distributed.cluster_process_count({"HOME": "/root"}) is None
    *_, args = parse(["--layout", "fsdp4xtp2"])
    assert distributed.process_count(args, slurm) == 2
    assert distributed.process_count(args, {}) == 1
