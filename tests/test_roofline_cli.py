"""bench/roofline.py's command line: bad input is one line and exit 2 before anything
compiles, its --help holds only the flags it uses, MFU is a percent of the machine's
peak, and the plot's roofs are the rates the prediction priced with."""
import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline  # noqa: E402
from engine.config import TrainConfig, model_config  # noqa: E402
from engine.cost import calibration, hardware  # noqa: E402
from engine.cost.ledger import step_ledger  # noqa: E402
from engine.cost.price import model_flops, predict, predicted_mfu  # noqa: E402
from engine.parallel.layout import Layout  # noqa: E402

TINY = ["--predict-only", "--model", "tiny"]
PROFILE = {"peak_flops": {"float32": 5e10, "bfloat16": 4e10}, "vector_flops": 2e9,
           "hbm": 2.5e9, "collective_fit": {"all-gather": [1e-4, 1.9e9]}}


@pytest.fixture
def refused(one_line_error):
    """refused(argv, *words): roofline.main(argv) exits 2 in one line naming `words`."""
    return functools.partial(one_line_error, roofline.main, table="scope")


def _profile_file(tmp_path, **changes):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({**PROFILE, **changes}))
    return str(path)


def test_missing_calibration_file_is_an_error(tmp_path, refused):
    refused(TINY + ["--calibration", str(tmp_path / "none.json")],
            "none.json", "not found")


@pytest.mark.parametrize("text,word", [("{not json", "JSON"), ("[1, 2]", "object"),
                                       (json.dumps({**PROFILE, "hbm": "fast"}), "hbm"),
                                       (json.dumps({**PROFILE, "hbm_cold": 0}), "hbm_cold"),
                                       (json.dumps({**PROFILE, "transcendental_flops": -1}),
                                        "transcendental_flops"),
                                       (json.dumps({**PROFILE, "fault_cost": "slow"}),
                                        "fault_cost"),
                                       (json.dumps({**PROFILE, "relayout_bw": 0}),
                                        "relayout_bw"),
                                       (json.dumps({**PROFILE, "peak_flops": {}}),
                                        "peak_flops")])
def test_malformed_calibration_is_one_line(tmp_path, refused, text, word):
    path = tmp_path / "cpu.json"
    path.write_text(text)
    refused(TINY + ["--calibration", str(path)], word)


def test_calibration_directory_is_an_error(tmp_path, refused):
    refused(TINY + ["--calibration", str(tmp_path)], "directory")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_output_paths_checked_up_front(tmp_path, refused, flag):
    refused(TINY + [flag, str(tmp_path)], flag, "is a directory")
    refused(TINY + [flag, str(tmp_path / "no" / "out")], flag,
            "does not exist")


@pytest.mark.parametrize("flag", ["--rounds", "--trace-steps"])
def test_counts_below_one_are_refused(refused, flag):
    refused(TINY + [flag, "0"], f"{flag[2:].replace('-', '_')}=0")


def test_top_ops_needs_a_measured_run(refused):
    refused(TINY + ["--top-ops", "-1"], "top_ops=-1")
    refused(TINY + ["--top-ops", "3"], "--top-ops", "--predict-only")


def test_top_ops_of_a_measured_run(tmp_path, capsys):
    """A measured run lists its slowest compiled ops, slowest first, in the table and the
    JSON, their seconds within the measured step."""
    out_json = tmp_path / "out.json"
    assert roofline.main(["--model", "tiny", "--layout", "fsdp2", "--steps", "2",
                          "--trace-steps", "1", "--no-in-run-rates", "--calibration",
                          _profile_file(tmp_path), "--json", str(out_json),
                          "--top-ops", "3"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    ops = data["ops"]
    assert len(ops) == 3 and "HLO op" in out and all(o["op"] in out for o in ops)
    assert [o["measured_s"] for o in ops] == sorted((o["measured_s"] for o in ops), reverse=True)
    assert 0 < sum(o["measured_s"] for o in ops) <= data["measured_step_s"] * (1 + 1e-9)
    assert {o["kind"] for o in ops} <= {"matmul", "memory", "collective"}


def test_in_run_rates_are_measured_before_each_round_of_steps(tmp_path, monkeypatch):
    """With in-run rates the profile is measured once per round, each time before that
    round's share of the timed steps; the report prices with the round whose prediction
    is the median, and the JSON pairs each round's predicted and measured step."""
    from bench import timing
    from engine.cost import microbench

    events, real_step = [], timing.timed_step

    def profile(hw, rows, devices):  # the calibration's rates, memory 2x faster a round
        events.append("rates")
        return dataclasses.replace(hw, hbm=hw.hbm * 2 ** events.count("rates"))

    def step(*args):
        events.append("step")
        return real_step(*args)

    monkeypatch.setattr(microbench, "in_run_profile", profile)
    monkeypatch.setattr(timing, "timed_step", step)
    out_json = tmp_path / "out.json"
    assert roofline.main(["--model", "tiny", "--layout", "fsdp2", "--steps", "3",
                          "--rounds", "3", "--trace-steps", "1", "--calibration",
                          _profile_file(tmp_path), "--json", str(out_json)]) == 0
    # warm-up, then rates and one step a round
    assert events == ["step"] + ["rates", "step"] * 3
    data = json.loads(out_json.read_text())
    predicted = [r["predicted_s"] for r in data["rounds"]]
    assert len(predicted) == 3 and len(set(predicted)) == 3
    assert data["predicted_step_s"] == sorted(predicted)[1]
    assert all(r["measured_s"] > 0 for r in data["rounds"])


def test_accelerator_profile_needs_predict_only(refused):
    """Measuring runs on this CPU: pricing an h100 against it is refused, not compiled."""
    refused(["--model", "tiny", "--hardware", "h100"], "--predict-only")


def test_help_holds_only_model_layout_parallel_training_flags(capsys):
    with pytest.raises(SystemExit):
        roofline.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--layout", "--zero", "--tp-comm", "--batch", "--seq", "--steps",
                 "--hardware", "--calibration"):
        assert flag in out
    for flag in ("--checkpoint-dir", "--resume", "--coordinator", "--num-processes",
                 "--metrics-file", "--eval-every", "--data", "--peak-flops", "--log-every"):
        assert flag not in out, flag


def test_training_only_flags_are_refused(refused):
    refused(TINY + ["--checkpoint-dir", "ckpt"], "--checkpoint-dir")


def test_mfu_is_a_percent_of_the_machine_peak(tmp_path, capsys):
    """The MFU denominator is the profile's peak (the large matmul), not the slower rate
    of the step's own shapes that prices matmuls; printed as a percent, a fraction in
    JSON under a name that says so and under the planner's name for it."""
    calib = _profile_file(tmp_path, mfu_peak={"float32": 1e11, "bfloat16": 8e10})
    out_json = tmp_path / "out.json"
    assert roofline.main(TINY + ["--calibration", calib, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    cfg = model_config("tiny")
    tcfg = TrainConfig(steps=5)
    expect = model_flops(cfg, tcfg) / (data["predicted_step_s"] * 8e10)
    assert data["predicted_mfu_fraction"] == pytest.approx(expect)
    assert data["predicted_mfu"] == data["predicted_mfu_fraction"]  # the planner's name
    mfu_line = next(line for line in out.splitlines() if line.startswith("MFU "))
    assert mfu_line.split()[1] == f"{100 * expect:.1f}%"


def test_cpu_defaults_mfu_peak_is_not_below_the_pricing_rate():
    """A peak below the rate pricing assumes puts MFU over 100% for a step priced at it."""
    d = calibration.CPU_DEFAULTS
    for dtype in ("float32", "bfloat16"):
        assert d["mfu_peak"][dtype] >= d["peak_flops"][dtype]


def test_cpu_defaults_carry_every_rate_a_calibration_file_does():
    """The defaults price as a calibration file does, not with the fallbacks kept for an
    older file: an out-of-cache rate for the scans' stacks, the transcendental rate, the
    page faults, the dot operands' relayout copies and the MFU peak each their own."""
    hw = calibration.cpu_defaults()
    assert 0 < hw.cold_hbm < hw.hbm
    assert hw.transcendental_flops > 0 and hw.fault_cost > 0
    assert hw.relayout_bw != hw.hbm and set(hw.mfu_peak) == set(hw.peak_flops)


def _points_and_roofs(hw, layout):
    from engine.cost import report

    cfg, tcfg = model_config("tiny"), TrainConfig()
    lay = Layout.parse(layout)
    pred = predict(step_ledger(cfg, tcfg, lay), hw, lay.mesh_axes())
    srows = report.scope_table(pred, None, hw)
    return srows, report.roofs(pred, hw, lay.size), pred, cfg, tcfg, lay


@pytest.mark.parametrize("concurrent", [False, True])
def test_predicted_points_sit_on_or_under_the_roofs(tmp_path, concurrent):
    """Every scope's predicted rate (FLOP/s per device) is at most the best roof at its
    intensity: roofs are the rates the prediction used, per device (divided by the
    device count only when the profile's rates are the whole host's)."""
    hw = calibration.cpu_profile(_profile_file(tmp_path))
    if concurrent:  # as microbench.in_run_profile leaves it: per-device rates, dots timed
        cfg, tcfg, lay = model_config("tiny"), TrainConfig(), Layout.parse("fsdp8")
        rows = step_ledger(cfg, tcfg, lay)
        dots = {r.dot: r.flops / 3e10 for r in rows if r.dot is not None}
        hw = dataclasses.replace(hw, dot_seconds=dots, concurrent_rates=True, hbm=1e10)
    srows, roofs, *_ = _points_and_roofs(hw, "fsdp8")
    assert roofs
    for scope, flops, nbytes, intensity, _, t_pred, _, _ in srows:
        if flops and t_pred:
            best = max(min(f, intensity * b) for _, f, b in roofs)
            assert flops / t_pred <= best * (1 + 1e-9), (scope, flops / t_pred, best)
    mem = {b for _, _, b in roofs}
    assert mem == {hw.hbm if concurrent else hw.hbm / 8}
    matmul = sorted(f for label, f, _ in roofs if "matmul" in label)
    if concurrent:  # the rate the timed dots add up to, not the profile's peak
        assert matmul == pytest.approx([3e10] * len(matmul))
    else:
        assert matmul == pytest.approx(sorted(f / 8 for f in PROFILE["peak_flops"].values()))


def test_predicted_mfu_uses_mfu_peak(tmp_path):
    hw = calibration.cpu_profile(_profile_file(tmp_path, mfu_peak={"float32": 1e11}))
    cfg, tcfg = model_config("tiny", dtype="f32"), TrainConfig()
    lay = Layout.parse("single")
    pred = predict(step_ledger(cfg, tcfg, lay), hw, lay.mesh_axes())
    assert predicted_mfu(pred, cfg, tcfg, hw, 1) == pytest.approx(
        model_flops(cfg, tcfg) / (pred.step_s * 1e11))


def test_pp_prediction_reports_the_bubble(tmp_path, capsys):
    """--predict-only on a pp layout prices along the schedule: the JSON holds the
    predicted bubble and the schedule's idle stage-ticks (p-1)/(M+p-1), the text says
    both, and the step is the pipeline's prediction."""
    from engine.cli.args import parse_or_exit
    from engine.cost.pipeline import predict_step

    out_json = tmp_path / "out.json"
    argv = ["--predict-only", "--model", "tiny", "--hardware", "h100", "--layout", "pp2xfsdp4",
            "--microbatches", "4", "--pp-schedule", "gpipe", "--json", str(out_json)]
    assert roofline.main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["schedule_bubble"] == pytest.approx(1 / 5)
    assert data["predicted_bubble"] >= data["schedule_bubble"]
    assert "predicted bubble" in out
    cfg, tcfg, par, lay, _ = parse_or_exit(argv, roofline.build_parser())
    assert par.microbatches == 4 and par.pp_schedule == "gpipe"
    h100 = hardware.get("h100")  # its ledger has the gather the engine runs there
    rows = step_ledger(cfg, tcfg, lay, par, h100.bf16_collectives_in_f32)
    pred, pipe = predict_step(rows, h100, lay, par)
    assert data["predicted_step_s"] == pytest.approx(pred.step_s)
    assert data["predicted_bubble"] == pytest.approx(pipe.bubble)
