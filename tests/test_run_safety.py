"""What a run must not lose or ignore: an output that is an input of the run is refused
before anything is opened for writing; one run at a time per checkpoint directory (a
killed run's lock taken over); an existing metrics file appended to on --resume and
refused otherwise; a model past the host's memory refused before anything is built;
a flag that cannot take effect refused (or, with --layout auto, pinned in the search);
the learning-rate schedule's horizon kept on resume. In-process `main` where nothing
compiles; a subprocess where two runs must overlap or a process must die."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from subprocess_env import cli_env

from engine.cli import train
from engine.cli.args import UsageError, parse
from engine.config import TrainConfig
from engine.run import checkpoint
from engine.run.lock import DirectoryLock, LockError
from engine.run.optim import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = ["--model", "tiny", "--layout", "single", "--batch", "2", "--seq", "16",
       "--peak-flops", "1e12", "--log-every", "1"]


def refused(capsys, argv, *words):
    """main(argv) exits 2 with one stderr line naming every word; returns that line."""
    code = train.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


# -- outputs apart from inputs ----------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--metrics-file", "{data}"], ["--metrics-file", "is --data"]),
    (["--checkpoint-dir", "{dir}"], ["--checkpoint-dir", "holds --data"]),
    (["--profile-steps", "1:1", "--profile-dir", "{dir}"], ["--profile-dir", "holds --data"]),
    (["--metrics-file", "{dir}/ck", "--checkpoint-dir", "{dir}/ck"],
     ["--metrics-file and --checkpoint-dir are both"]),
])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(flags, words, tmp_path,
                                                                   capsys):
    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(range(32, 127)) * 40)
    before = data.read_bytes()
    argv = [f.format(data=data, dir=tmp_path) for f in flags]
    refused(capsys, [*CLI, "--steps", "2", "--data", str(data), *argv], *words)
    assert data.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]  # nothing was created either


def test_a_symlink_to_the_data_is_the_data(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"0123456789" * 100)
    (tmp_path / "link.jsonl").symlink_to(data)
    refused(capsys, [*CLI, "--data", str(data), "--metrics-file", str(tmp_path / "link.jsonl")],
            "is --data")
    assert data.read_bytes() == b"0123456789" * 100


def test_plan_json_is_not_its_calibration(tmp_path, capsys):
    from engine.cli import plan

    cal = tmp_path / "cal.json"
    cal.write_text("{}")
    assert plan.main(["--devices", "2", "--model", "tiny", "--calibration", str(cal),
                      "--json", str(cal)]) == 2
    assert "--json" in capsys.readouterr().err and cal.read_text() == "{}"


# -- one run per checkpoint directory ----------------------------------------------------------
def held_by(directory) -> str:
    try:
        with open(os.path.join(directory, ".lock")) as f:
            return f.read()
    except OSError:
        return ""


def test_a_run_on_a_held_directory_is_refused_naming_the_holder(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step_00000020.ckpt").write_bytes(b"the first run's")
    with DirectoryLock(str(ck)):
        refused(capsys, [*CLI, "--steps", "60", "--checkpoint-dir", str(ck), "--resume"],
                f"{ck} is in use by another run (pid {os.getpid()} on {socket.gethostname()})")
    assert sorted(os.listdir(ck)) == [".lock", "step_00000020.ckpt"]
    assert (ck / "step_00000020.ckpt").read_bytes() == b"the first run's"


@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_refused_and_the_first_loses_nothing(tmp_path,
                                                                                    capsys):
    """Two training runs at once on one directory: the second exits 2 naming the first,
    which writes every checkpoint and metrics line."""
    ck = tmp_path / "ck"
    first = subprocess.Popen(
        [sys.executable, "-m", "engine.train", *CLI, "--steps", "60", "--checkpoint-every", "20",
         "--keep", "5", "--checkpoint-dir", str(ck), "--metrics-file", str(tmp_path / "a.jsonl")],
        cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not held_by(ck).startswith("pid") and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()
        refused(capsys, [*CLI, "--steps", "60", "--checkpoint-dir", str(ck), "--metrics-file",
                         str(tmp_path / "b.jsonl")],
                f"{ck} is in use by another run (pid {first.pid} on {socket.gethostname()})")
        out, err = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, err.decode()
    assert [s for s, _ in checkpoint.list_checkpoints(str(ck))] == [20, 40, 60]
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 60
    assert not (tmp_path / "b.jsonl").exists()
    assert held_by(ck) == ""  # released on exit


def test_a_killed_runs_lock_is_taken_over_and_a_live_one_is_not(tmp_path):
    d = str(tmp_path / "ck")
    code = ("import os, signal, sys; from engine.run.lock import DirectoryLock; "
            "DirectoryLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.Popen([sys.executable, "-c", code, d], cwd=ROOT, env=cli_env())
    assert dead.wait(timeout=120) == -signal.SIGKILL
    assert held_by(d) == f"pid {dead.pid} on {socket.gethostname()}"  # left behind
    with DirectoryLock(d) as lock:
        assert lock.previous == f"pid {dead.pid} on {socket.gethostname()}"
        assert held_by(d) == f"pid {os.getpid()} on {socket.gethostname()}"
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            DirectoryLock(d).acquire()  # another open file: flock refuses it
    with DirectoryLock(d) as lock:  # released cleanly: nothing to take over
        assert lock.previous is None


# -- the metrics file --------------------------------------------------------------------------
def test_an_existing_metrics_file_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    m = tmp_path / "m.jsonl"
    m.write_text('{"step": 1, "loss": 5.0}\n')
    refused(capsys, [*CLI, "--steps", "1", "--metrics-file", str(m)], "--overwrite-metrics",
            "--resume")
    assert m.read_text() == '{"step": 1, "loss": 5.0}\n'


def test_a_metrics_file_another_run_writes_is_refused(tmp_path, capsys):
    from engine.run.loop import MetricsFile

    m = tmp_path / "m.jsonl"
    with MetricsFile(str(m), append=False):
        refused(capsys, [*CLI, "--steps", "1", "--metrics-file", str(m), "--overwrite-metrics"],
                f"{m} is being written by another run")


@pytest.mark.slow
def test_overwrite_metrics_replaces_the_file(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"step": 1, "loss": 5.0}\n')
    assert train.main([*CLI, "--steps", "1", "--metrics-file", str(m),
                       "--overwrite-metrics"]) == 0
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] != 5.0


# -- host memory -------------------------------------------------------------------------------
def test_roofline_refuses_a_model_past_the_host_memory_before_building(monkeypatch, capsys):
    """The host's memory made 1 MiB: roofline (not predict-only) and the step bench exit 2
    in one line naming the need, having built nothing (they measure nothing)."""
    from bench import roofline, step
    from engine.parallel import validate

    monkeypatch.setattr(validate, "available_host_memory", lambda: 2**20)
    for tool in (roofline, step):
        with pytest.raises(SystemExit) as e:
            tool.main(["--layout", "fsdp2", "--model", "tiny", "--steps", "1"])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == ""
        assert err.count("\n") == 1 and "model needs" in err and "GiB available" in err


def test_roofline_refuses_llama3_70b_on_this_host():
    r = subprocess.run([sys.executable, "bench/roofline.py", "--layout", "fsdp8", "--model",
                        "llama3-70b"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "model needs 1051.3 GiB" in r.stderr


# -- flags that cannot take effect -------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--layout", "tp4", "--zero", "1"], ["--zero 1 takes no effect on layout tp4", "fsdp"]),
    (["--layout", "fsdp8", "--pp-schedule", "gpipe"], ["--pp-schedule gpipe", "a pp axis"]),
    (["--layout", "fsdp8", "--cp-comm", "ring"], ["--cp-comm ring", "cp"]),
    (["--layout", "fsdp8", "--tp-comm", "sequence"], ["--tp-comm sequence", "tp"]),
    (["--layout", "tp2", "--prefetch"], ["--prefetch takes no effect", "--zero 3"]),
    (["--layout", "pp2", "--pp-virtual", "2", "--microbatches", "2"],
     ["--pp-virtual 2", "interleaved"]),
    (["--layout", "fsdp2xtp2", "--zero", "1", "--grad-reduce", "f32"],
     ["--grad-reduce f32", "--zero 2 or 3"]),
])
def test_a_flag_that_cannot_take_effect_is_refused(flags, words):
    with pytest.raises(UsageError) as e:
        parse(["--model", "tiny", *flags])
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("flags", [
    ["--layout", "tp4", "--zero", "3"],  # the default: what runs anyway
    ["--layout", "fsdp2xtp2", "--zero", "2", "--grad-reduce", "f32", "--tp-comm", "sequence"],
    ["--layout", "pp2xfsdp2", "--pp-schedule", "gpipe", "--microbatches", "2"],
    ["--layout", "single", "--microbatches", "2", "--remat", "none"],
])
def test_a_flag_that_takes_effect_is_accepted(flags):
    parse(["--model", "tiny", "--batch", "8", *flags])


def test_layout_auto_searches_only_where_the_given_switches_take_effect():
    """`--layout auto --zero 1`: every candidate the planner ranks shards the params with
    zero 1 (before, layouts without fsdp ran zero 3 and won); without the flag the search
    includes layouts without fsdp."""
    from engine.cli.given import auto_pins
    from engine.planner.space import candidates, degree

    cfg, tcfg, parallel, layout, args = parse(["--layout", "auto", "--model", "tiny",
                                               "--zero", "1", "--batch", "8", "--seq", "32"],
                                              auto=True)
    assert layout is None and args.given == {"layout", "model", "zero", "batch", "seq"}
    pinned, base = auto_pins(cfg, parallel, args.given)
    assert pinned == {"zero": 1}
    ok, _ = candidates(cfg, tcfg, 8, pinned, base=base)
    assert ok and all(c.parallel.zero == 1 and degree(c.layout, "params") > 1 for c in ok)
    free, _ = candidates(cfg, tcfg, 8, {}, base=base)
    assert any(degree(c.layout, "params") == 1 for c in free)


# -- the learning-rate schedule on resume ------------------------------------------------------
def lrs(path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, path.read_text().splitlines())}


class Saved:
    """A checkpoint as `_schedule_horizon` reads it: its metadata."""

    def __init__(self, **train):
        self.meta = {"train": train}


def test_the_schedule_horizon_comes_from_the_checkpoint_unless_given():
    from engine.cli.train import _schedule_horizon

    said = []
    asked = TrainConfig(steps=100)
    assert _schedule_horizon(Saved(steps=60), asked, said.append).horizon == 60
    assert "horizon, step 60" in said[0] and "--lr-schedule-steps" in said[0]
    # a checkpoint of a resumed run carries the horizon it kept
    assert _schedule_horizon(Saved(steps=80, schedule_steps=60), asked, print).horizon == 60
    given = TrainConfig(steps=100, schedule_steps=100)
    assert _schedule_horizon(Saved(steps=60), given, print) is given
    assert _schedule_horizon(None, asked, print) is asked
    assert _schedule_horizon(Saved(steps=100), asked, said.append) is asked and len(said) == 1


@pytest.mark.slow
def test_resume_with_more_steps_keeps_the_schedule_horizon(tmp_path, capsys):
    """Trained to step 6 of 6, resumed to 10: steps 7-10 stay at the schedule's floor
    (lr x min_lr_ratio) instead of the schedule bending back up; --lr-schedule-steps 10
    sets the horizon of a 10-step schedule instead."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    base = [*CLI, "--lr", "1e-3", "--warmup", "2", "--checkpoint-dir", str(ck),
            "--metrics-file", str(m)]
    assert train.main([*base, "--steps", "6"]) == 0
    for extra, horizon in (([], 6), (["--lr-schedule-steps", "10"], 10)):
        for name in os.listdir(ck):
            if name != "step_00000006.ckpt" and not name.startswith("."):
                os.remove(ck / name)
        capsys.readouterr()
        assert train.main([*base, "--steps", "10", "--resume", *extra]) == 0
        out = capsys.readouterr().out
        assert ("keeps the checkpoint's horizon, step 6" in out) == (not extra)
        want = schedule(TrainConfig(lr=1e-3, warmup=2, steps=horizon))
        got = lrs(m)  # the newest rows of each step: this resume's
        for step in range(7, 11):  # f32 schedule values, logged as floats
            np.testing.assert_allclose(got[step], float(want(step - 1)), rtol=1e-6)
        if not extra:
            np.testing.assert_allclose([got[s] for s in range(6, 11)], 1e-4, rtol=1e-6)
    assert got[7] > 1e-4  # the 10-step horizon: above the floor until step 10


def test_the_header_names_the_pipeline_schedule_and_microbatches():
    from engine.cli.train import schedule_summary
    from engine.config import ParallelConfig
    from engine.parallel.layout import Layout

    par = ParallelConfig(pp_schedule="interleaved", pp_virtual=2, microbatches=8)
    assert schedule_summary(par, Layout.parse("pp2xfsdp4")) == \
        ", pp schedule interleaved (2 chunks per device) over 8 microbatches"
    assert schedule_summary(ParallelConfig(microbatches=4), Layout.parse("fsdp8")) == \
        ", 4 microbatches accumulated"
    assert schedule_summary(ParallelConfig(), Layout.parse("fsdp8")) == ""


def test_given_flags_leave_out_what_a_tool_does_not_take():
    """engine.plan leaves out the parallel flags: their defaults are set, not given."""
    from engine.cli import plan
    from engine.cli.given import given_flags

    parser = plan.build_parser()
    assert parser.get_default("zero") == 3  # set for `parse`, not a flag of the planner
    assert given_flags(parser, ["--devices", "2", "--model", "tiny"]) == {"devices", "model"}


def test_calibrate_prints_a_summary_not_the_profile():
    """bench/calibrate.py prints one line per headline figure; the measured points of
    every collective stay in the file it writes."""
    from bench import calibrate

    profile = {"peak_flops": {"float32": 3.2e11, "bfloat16": 9.1e11}, "fault_cost": 5.3e-10,
               "collective_points": {"all_gather": [[1024, 1e-5]] * 50}, "load_avg": [1, 2, 3]}
    lines = calibrate.summary(profile)
    assert lines == ["peak_flops            float32 3.2e+11, bfloat16 9.1e+11 FLOP/s",
                     "fault_cost            5.3e-10 s/B"]
