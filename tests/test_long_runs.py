"""Long runs: asynchronous saves, SIGTERM, a failing writer. One compiled step serves
every run here: `setup` compiles it once, and each run restores its start state into the
same session (restoring needs no compile), so an uninterrupted run, a preempted one and
its resume can be compared bit for bit (the same program on the same bytes)."""
import dataclasses
import errno
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from engine.cli.args import parse
from engine.cli.train import setup
from engine.run import checkpoint
from engine.run.data import load_data
from engine.run.loop import Checkpoints, Rates, loop
from engine.run.preempt import Preemption
from engine.run.writer import Writer

STEPS = 6
FLAGS = ["--model", "tiny", "--layout", "fsdp2xtp2", "--batch", "4", "--seq", "16",
         "--dtype", "f32", "--steps", str(STEPS), "--peak-flops", "1e12"]


class Rows:
    """Keeps every record the loop makes."""

    def __init__(self):
        self.rows = []

    def __call__(self, record, session):
        self.rows.append(dict(record))


class SigtermAt:
    """Sends this process SIGTERM after step `step` (as a scheduler would, mid-run)."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, record, session):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The compiled session, its start state saved as step 0, and the uninterrupted
    run's rows and final host params."""
    cfg, tcfg, parallel, layout, args = parse(FLAGS)
    session = setup(cfg, tcfg, parallel, layout, args, load_data("synthetic", cfg.vocab),
                    lambda *a, **k: None)
    d0 = str(tmp_path_factory.mktemp("start"))
    meta = {"model": dataclasses.asdict(cfg)}
    start = checkpoint.save(d0, 0, session.params, session.opt_state, meta, 1)
    rows = Rows()
    assert loop(session, [Rates(cfg, tcfg, session.peak), rows], print) == 0
    return dict(session=session, start=start, rows=rows.rows, cfg=cfg, tcfg=tcfg, meta=meta,
                final=host(session.params))


def host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def restart(run, path: str, start: int):
    """The session with the state of checkpoint `path` (step `start`)."""
    s = run["session"]
    s.params, s.opt_state = checkpoint.restore(checkpoint.open_checkpoint(path), s.trainer)
    s.start = start
    return s


def same_rows(got: list[dict], want: list[dict]):
    want = {r["step"]: r for r in want}
    for row in got:
        for key in ("loss", "grad_norm", "lr"):
            assert row[key] == want[row["step"]][key], (row["step"], key)


def test_sigterm_saves_the_step_exits_0_and_the_resume_is_bitwise(run, tmp_path):
    said = []
    session = restart(run, run["start"], 0)
    rows = Rows()
    hooks = [Rates(run["cfg"], run["tcfg"], session.peak), rows, SigtermAt(3),
             Checkpoints(str(tmp_path), 2, 10, STEPS, run["meta"], said.append, asynchronous=True,
                         preemption=Preemption())]
    assert loop(session, hooks, said.append) == 0
    path = checkpoint.checkpoint_path(str(tmp_path), 3)
    assert [r["step"] for r in rows.rows] == [1, 2, 3]
    assert said[-1] == f"preempted (SIGTERM): saved step 3 to {path}; exiting"
    assert f"saved {checkpoint.checkpoint_path(str(tmp_path), 2)}" in said  # the async one
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handed back
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [2, 3]

    session = restart(run, path, 3)
    rows = Rows()
    assert loop(session, [Rates(run["cfg"], run["tcfg"], session.peak), rows], print) == 0
    assert [r["step"] for r in rows.rows] == [4, 5, 6]
    same_rows(rows.rows, run["rows"])
    for a, b in zip(host(session.params), run["final"], strict=True):
        assert np.array_equal(a, b)


def test_a_failed_background_write_stops_the_run_and_keeps_the_last_good_one(
        run, tmp_path, monkeypatch):
    real_fsync = os.fsync

    def full(fd):  # the step-4 checkpoint's temporary file finds the disk full
        if ".step_00000004.ckpt.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    session = restart(run, run["start"], 0)
    rows = Rows()
    hooks = [Rates(run["cfg"], run["tcfg"], session.peak), rows,
             Checkpoints(str(tmp_path), 2, 10, STEPS, run["meta"], lambda *a: None, asynchronous=True)]
    with pytest.raises(checkpoint.CheckpointError) as e:
        loop(session, hooks, print)
    assert "step_00000004.ckpt" in str(e.value) and "no space left" in str(e.value)
    assert "\n" not in str(e.value)
    assert 4 < rows.rows[-1]["step"] <= STEPS  # reported at a later step, not lost
    assert sorted(os.listdir(tmp_path)) == ["step_00000002.ckpt"]
    assert checkpoint.latest(str(tmp_path)).step == 2


def test_a_second_write_waits_for_the_first_and_errors_are_raised_once():
    writer, order, gate = Writer(), [], threading.Event()

    def slow(name):
        gate.wait(5)
        order.append(name)
        return name

    writer.submit(slow, "a")
    assert writer.busy() and writer.finished() == []
    threading.Timer(0.05, gate.set).start()
    writer.submit(slow, "b")  # returns only once "a" is written
    assert order[0] == "a"
    assert writer.wait() == ["a", "b"]

    def fail():
        raise checkpoint.CheckpointError("cannot write checkpoint x: disk full")

    writer.submit(fail)
    while writer.busy():
        time.sleep(0.01)
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        writer.finished()
    assert writer.wait() == []


def tensorboard_scalars(directory) -> dict:
    """{(tag, step): value} of the event files in `directory`, read with tensorboardX's
    own Event protobuf; each record framed as TFRecord (length, masked crc32c, data,
    masked crc32c), the checksums verified with tensorboardX's crc32c."""
    import struct

    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    out = {}
    for name in os.listdir(directory):
        blob = open(os.path.join(directory, name), "rb").read()
        at = 0
        while at < len(blob):
            head = blob[at:at + 8]
            (n,), (head_crc,) = struct.unpack("<Q", head), struct.unpack("<I", blob[at + 8:at + 12])
            data = blob[at + 12:at + 12 + n]
            (data_crc,) = struct.unpack("<I", blob[at + 12 + n:at + 16 + n])
            assert head_crc == masked(head) and data_crc == masked(data)
            event = Event.FromString(data)
            for value in event.summary.value:
                out[value.tag, event.step] = value.simple_value
            at += 16 + n
    return out


def test_tensorboard_event_file_holds_every_scalar_of_every_step(run, tmp_path):
    pytest.importorskip("tensorboardX")
    from engine.run.tensorboard import TensorBoard

    session = restart(run, run["start"], 0)
    rows = Rows()
    hooks = [Rates(run["cfg"], run["tcfg"], session.peak), rows, TensorBoard(str(tmp_path))]
    assert loop(session, hooks, print) == 0
    got = tensorboard_scalars(tmp_path)
    want = {(f"train/{k}", r["step"]): np.float32(v) for r in rows.rows for k, v in r.items()
            if k != "step"}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/mfu"} <= {tag for tag, _ in want}
    assert got == want


def test_predicted_step_time_beside_the_measured_one(run, tmp_path):
    """With the cost model on, every record (so TensorBoard and W&B) holds the step the
    cost model predicts for this layout, priced as --profile-steps prices it (the traced
    step's ledger, the compiled step's mapped temporaries), and measured / predicted."""
    pytest.importorskip("tensorboardX")
    from engine.cost import hardware, memory
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.cost.predicted import StepPrediction
    from engine.run.host import mapped_each_step
    from engine.run.tensorboard import TensorBoard

    cfg, tcfg, parallel, layout, _ = parse(FLAGS)
    session = restart(run, run["start"], 0)
    hw = hardware.get("cpu")
    rows = Rows()
    hooks = [Rates(cfg, tcfg, session.peak), StepPrediction(cfg, layout, parallel, hw, print),
             rows, TensorBoard(str(tmp_path))]
    assert loop(session, hooks, print) == 0
    mapped = mapped_each_step(memory.measure(session.step_fn)["temp"])
    want = predict_step(step_ledger(cfg, tcfg, layout, parallel), hw, layout, parallel,
                        mapped)[0].step_s
    assert len(rows.rows) == STEPS and want > 0
    for r in rows.rows:
        assert r["predicted_step_s"] == want
        assert r["step_time_ratio"] == r["step_time_s"] / want
    got = tensorboard_scalars(tmp_path)
    assert {got["train/predicted_step_s", r["step"]] for r in rows.rows} == {np.float32(want)}


@pytest.mark.parametrize("flags, on", [([], False), (["--profile-steps", "2:3"], True),
                                       (["--layout", "auto"], True)])
def test_the_cost_model_prices_the_step_only_when_on(run, flags, on):
    from engine.cli.train import _hooks
    from engine.cost.predicted import StepPrediction

    cfg, tcfg, parallel, layout, args = parse([*FLAGS, *flags], auto=True)
    layout = layout or parse(FLAGS)[3]  # auto: what the planner would choose
    hooks = _hooks(cfg, tcfg, parallel, layout, args, load_data("synthetic", cfg.vocab),
                   run["session"], None, print)
    assert any(isinstance(h, StepPrediction) for h in hooks) == on


def wandb_records(directory) -> list:
    """The protobuf records (wandb's own `Record`) of the offline runs under `directory`.
    wandb has no offline reader of its own, so the file's framing is read here: a 7-byte
    header (":W&B", 0xBEE1, version), then LevelDB's log format, 32 KiB blocks of chunks
    (crc32c, u16 length, type: 1 full, 2 first, 3 middle, 4 last), a block's tail of
    under 7 bytes left as padding."""
    import glob
    import struct

    from wandb.proto.wandb_internal_pb2 import Record

    block, head = 32768, 7
    out = []
    for path in glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb")):
        with open(path, "rb") as f:
            data = f.read()
        assert struct.unpack("<4sHB", data[:head])[:2] == (b":W&B", 0xBEE1)
        at, parts = head, b""
        while at + head <= len(data):
            if (left := block - at % block) < head:
                at += left
                continue
            _, n, kind = struct.unpack("<IHB", data[at:at + head])
            if kind == 0:  # zeros: the rest of the block is padding
                at += left
                continue
            parts += data[at + head:at + head + n]
            at += head + n
            if kind in (1, 4):
                out.append(Record.FromString(parts))
                parts = b""
    return out


def test_wandb_offline_run_holds_the_scalars_tensorboard_gets(run, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import json

    from engine.run.loop import scalars
    from engine.run.wandb_log import WandB

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    session = restart(run, run["start"], 0)
    rows = Rows()
    hooks = [Rates(run["cfg"], run["tcfg"], session.peak), rows,
             WandB("shardwise-test", {"layout": "fsdp2xtp2", "steps": STEPS})]
    assert loop(session, hooks, print) == 0
    records = wandb_records(tmp_path)
    items = [(item.key or "/".join(item.nested_key), r.history.step.num, item.value_json)
             for r in records if r.WhichOneof("record_type") == "history"
             for item in r.history.item]
    got = {(key, step): json.loads(value) for key, step, value in items
           if not key.startswith("_")}  # wandb's own: _step, _runtime, _timestamp
    want = {(tag, r["step"]): v for r in rows.rows for tag, v in scalars(r).items()}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/mfu"} <= {tag for tag, _ in want}
    assert got == want
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    assert {i.key: json.loads(i.value_json) for i in config.update
            if not i.key.startswith("_")} == {"layout": "fsdp2xtp2", "steps": STEPS}


def test_a_wandb_run_that_cannot_start_is_one_line(monkeypatch, one_line_error):
    """Online without a login, wandb.init raises: the run stops before its first step."""
    wandb = pytest.importorskip("wandb")
    from engine.cli.train import main

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call "
                                      "wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", no_login)
    one_line_error(main, [*FLAGS, "--layout", "single", "--wandb", "proj"],
                   "--wandb proj: api_key not configured", table="| loss")


def test_wandb_missing_is_one_line(monkeypatch, one_line_error):
    from engine.cli.train import main
    from engine.run import wandb_log

    monkeypatch.setattr(wandb_log, "available", lambda: False)
    one_line_error(main, [*FLAGS, "--wandb", "proj"], "--wandb needs wandb",
                   "shardwise[wandb]", table="step")


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_one_step_on_every_process(tmp_path):
    """2 processes (engine.launch forwards SIGTERM to both): jax's preemption sync point
    makes them stop and save at the same step; the launcher exits 0."""
    import subprocess
    import sys

    from subprocess_env import cli_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "engine.launch", "--processes", "2", "--", "--model", "tiny",
         "--layout", "fsdp4xtp2", "--batch", "8", "--seq", "32", "--steps", "100000",
         "--peak-flops", "1e12", "--metrics-file", str(metrics), "--checkpoint-dir", str(ck),
         "--checkpoint-every", "100000"],
        cwd=root, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err[-2000:]
    (step, path), = checkpoint.list_checkpoints(str(ck))
    assert f"preempted (SIGTERM): saved step {step} to {path}; exiting" in out
    assert os.path.exists(checkpoint.shard_path(path, 1, 2))
    assert checkpoint.read(path).step == step


def test_the_cli_reports_a_failed_background_write_in_one_line(tmp_path, monkeypatch,
                                                                one_line_error):
    from engine.cli.train import main

    real_fsync = os.fsync

    def full(fd):
        if ".step_00000002.ckpt.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    ck = tmp_path / "ck"
    one_line_error(main, [*FLAGS, "--layout", "single", "--steps", "40",
                          "--checkpoint-every", "2", "--checkpoint-dir", str(ck)],
                   "cannot write checkpoint", "step_00000002.ckpt", "no space left",
                   table="step    40/40")
    # nothing half-written stays (the lock file is the run's own)
    assert set(os.listdir(ck)) - {".lock"} == set()
