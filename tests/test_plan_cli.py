"""The planner's command lines: `python -m engine.plan` (engine/cli/plan.py: its table,
`--json`, `--axes` / `--max`, `--refine` on the host, one-line errors) and `python -m
engine.train --layout auto`, which trains with the plan's first choice."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import roofline  # noqa: E402
from engine.cli import plan as plan_cli
from engine.config import TrainConfig, model_config  # noqa: E402
from engine.planner import search as plan  # noqa: E402
from engine.planner.auto import hardware_profile  # noqa: E402

pytestmark = pytest.mark.usefixtures("own_ledger_cache")

# one matmul rate for every candidate, as `bench/roofline.py --predict-only` prices
SMALL_PLAN = ["--devices", "2", "--model", "tiny", "--seq", "32", "--batch", "4",
              "--remat", "full", "--workers", "1", "--refine", "0"]


@pytest.fixture
def refused(one_line_error):
    """refused(argv, *words): plan_cli.main(argv) exits 2 in one line naming `words`."""
    return functools.partial(one_line_error, plan_cli.main, table="layout")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert plan_cli.main(SMALL_PLAN + ["--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_holds_the_ranked_candidates(planned):
    cands = planned["candidates"]
    # 2 devices: dp2 (1), fsdp2 (zero 1, 2, 3, 3 + prefetch), tp2 (3 tp-comms),
    # cp2 (2 cp-comms), remat pinned
    assert len(cands) == 1 + 4 + 3 + 2
    for c in cands:
        assert {"layout", "flags", "predicted_step_s", "predicted_mfu",
                "predicted_peak_bytes"} <= set(c)
        assert set(c["flags"]) == {s.name for s in plan.SWITCHES}
    steps = [c["predicted_step_s"] for c in cands]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    assert planned["grad_reduce"] == "compute"  # every candidate's (not a switch)


def test_axes_and_max_restrict_the_plan_to_its_part_of_the_space(planned, tmp_path, capsys):
    """--axes and --max rank the candidates of the full plan within them, in its order,
    and the JSON and the header say what was searched."""
    path = tmp_path / "part.json"
    assert plan_cli.main(SMALL_PLAN + ["--axes", "fsdp, dp,tp", "--max", "tp = 1",
                                   "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "axes dp, fsdp, tp <= 1" in out
    part = json.loads(path.read_text())
    assert part["axes"] == ["dp", "fsdp", "tp"] and part["max"] == {"tp": 1}
    want = [c for c in planned["candidates"] if c["layout"] in ("dp2", "fsdp2")]
    assert len(want) == 1 + 4 and part["candidates"] == want


def test_first_choice_is_the_roofline_prediction(planned, tmp_path, capsys):
    first = planned["candidates"][0]
    assert first["predicted_mapped_bytes"] == 0  # no page faults, which predict-only omits
    argv = ["--predict-only", "--model", "tiny", "--seq", "32", "--batch", "4",
            "--layout", first["layout"]]
    for name, value in first["flags"].items():
        flag = "--" + name.replace("_", "-")
        argv += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    out = tmp_path / "roofline.json"
    assert roofline.main(argv + ["--json", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["predicted_step_s"] == first["predicted_step_s"]


def test_the_cli_plan_on_the_cpu_times_the_first_ones_matmuls(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = SMALL_PLAN[:-2] + ["--refine", "0.1", "--json", str(path)]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    got = json.loads(path.read_text())
    k = got["refined"]
    assert k >= 1 and f"the first {k} priced again with their matmuls timed" in out
    flags = [c["dots_timed"] for c in got["candidates"]]
    assert flags == [True] * k + [False] * (len(flags) - k)


def test_what_cannot_fit_is_one_line(refused):
    refused(SMALL_PLAN + ["--hbm-gib", "0.0001"], "fits", "peak")


def test_bad_flags_are_one_line(refused):
    refused(["--devices", "0", "--model", "tiny"], "devices=0")
    refused(SMALL_PLAN + ["--hbm-gib", "-1"], "hbm_gib")
    refused(SMALL_PLAN + ["--top", "0"], "top=0")
    refused(SMALL_PLAN + ["--refine", "-0.1"], "refine=-0.1")
    refused(["--model", "tiny"], "devices")
    refused(SMALL_PLAN + ["--axes", "fsdp,sp"], "unknown role 'sp'")
    refused(SMALL_PLAN + ["--axes", ","], "no role")
    refused(SMALL_PLAN + ["--max", "tp=0"], "--max 'tp=0'")
    refused(SMALL_PLAN + ["--max", "tp"], "--max 'tp'")
    refused(["--devices", "3", "--model", "tiny", "--seq", "32",
             "--batch", "4", "--workers", "1"], "can run")


@pytest.mark.slow
def test_layout_auto_trains_with_the_first_choice():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": str(ROOT)}
    args = ["--model", "tiny", "--seq", "32", "--batch", "4"]
    run = subprocess.run([sys.executable, "-m", "engine.train", "--layout", "auto",
                          "--steps", "1", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    # the host's timings rank the candidates near the first at the one matmul rate
    ranked = plan.plan(cfg, tcfg, 2, hardware_profile("cpu", say=lambda s: None)).ranked
    near = {p.candidate.describe(): p.candidate for p in ranked
            if p.step_s <= (1 + plan.REFINE_WITHIN) * ranked[0].step_s}
    lines = run.stdout.splitlines()
    chosen = next(line for line in lines if line.startswith("layout auto: "))
    name = chosen.removeprefix("layout auto: ").partition(", predicted")[0]
    assert name in near and ", its matmuls timed here," in chosen, chosen
    first = near[name]
    header = next(line for line in lines if line.startswith(f"layout {first.layout} on 2 cpu"))
    assert f"remat {first.cfg.remat}," in header
    assert any(line.startswith("step     1/1 | loss") for line in lines), run.stdout


def test_layout_auto_with_several_processes_is_one_line():
    run = subprocess.run([sys.executable, "-m", "engine.train", "--layout", "auto",
                          "--model", "tiny", "--num-processes", "2", "--process-id", "0",
                          "--coordinator", "localhost:1234"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "--layout auto plans for the devices of one process" in run.stderr


def test_help_shows_only_what_the_planner_reads(capsys, refused):
    """The planner reads the model, the batch and sequence and its own flags: not
    --layout (it chooses one) nor the run's length, learning rate or seed, which are
    refused rather than ignored."""
    with pytest.raises(SystemExit):
        plan_cli.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--devices", "--model", "--remat", "--batch", "--seq", "--hardware"):
        assert flag in out, flag
    for flag in ("--layout", "--steps", "--lr", "--warmup", "--seed", "--metrics-file"):
        assert flag not in out, flag
    refused([*SMALL_PLAN, "--steps", "20"], "unrecognized arguments: --steps 20")


def test_the_output_names_the_axes_considered_and_what_was_pruned(planned, capsys):
    """The roles laid out, those left out and why, and the refusals counted by reason
    (tiny's 2 layers cannot be 2 stages of 2 virtual ones; it has no experts)."""
    assert plan_cli.main(SMALL_PLAN + ["--axes", "dp,pp,ep", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "axes considered: dp, pp (schedules " in out
    assert "; ep left out: the model has no experts" in out
    assert "pruned before pricing: 1 refused by engine.parallel.validate (most: 1 " \
           "layers=N not divisible by pp x pp_virtual = N x N), 0 over memory" in out
