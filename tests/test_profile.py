"""engine.train --profile-steps A:B: a trace of those steps that TensorBoard and Perfetto
open, and at the end a table of where their time went, measured vs predicted."""
import functools
import glob
import gzip
import json
import os

import pytest

from engine.cli import train


@pytest.fixture
def refused(one_line_error):
    """refused(argv, *words): train.main(argv) exits 2 in one line naming `words`, before
    compiling."""
    return functools.partial(one_line_error, train.main, table="compiled")


@pytest.mark.parametrize("steps,word", [("0:2", ">= 1"), ("3:2", ">= the first"),
                                        ("2:4", "<= --steps 3"), ("2", "A:B"),
                                        ("a:b", "A:B")])
def test_profile_steps_checked_up_front(refused, tmp_path, steps, word):
    refused(["--model", "tiny", "--steps", "3", "--profile-steps", steps,
             "--profile-dir", str(tmp_path)], "--profile-steps", word)


def test_profile_dir_that_is_a_file(refused, tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    refused(["--model", "tiny", "--steps", "3", "--profile-steps", "1:2",
             "--profile-dir", str(f)], "--profile-dir", "not a directory")


def test_profile_writes_trace_and_prints_table(capsys, tmp_path):
    out_dir = tmp_path / "prof"
    assert train.main(["--model", "tiny", "--steps", "3", "--profile-steps", "2:3",
                       "--profile-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    xplanes = glob.glob(f"{out_dir}/plugins/profile/*/*.xplane.pb")
    perfetto = glob.glob(f"{out_dir}/plugins/profile/*/perfetto_trace.json.gz")
    assert xplanes and perfetto
    events = json.loads(gzip.decompress(open(perfetto[0], "rb").read()))
    assert any("train_step" in json.dumps(e.get("args", {}))
               for e in events.get("traceEvents", []))
    # the trace's own directory and file, which the profiler names by the time
    assert f"profile of steps 2-3 in {os.path.dirname(xplanes[0])}:" in out
    assert perfetto[0] in out
    assert "HLO op" in out and "computes" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for scope in ("attention", "mlp"):
        assert scope in rows, out
        pred_s, meas_s = float(rows[scope][5]), float(rows[scope][6])
        assert pred_s > 0 and meas_s > 0
