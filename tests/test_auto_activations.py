"""`--activations auto` (the default): bf16 activations on GPU and TPU profiles and
platforms, f32 on the CPU, resolved in one place (engine/config.py
`resolve_activations`); `--predict-only` prints every assumption in one line."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline  # noqa: E402
from engine.cli.args import parse  # noqa: E402
from engine.config import platform_of, resolve_activations  # noqa: E402

TINY = ["--model", "tiny", "--batch", "4", "--seq", "32", "--layout", "fsdp2"]


@pytest.mark.parametrize("hardware,want", [("cpu", "f32"), ("h100", "bf16"),
                                           ("a100", "bf16"), ("v5p", "bf16"), ("v5e", "bf16")])
def test_predict_only_defaults_to_the_profiles_activations(hardware, want):
    cfg, *_ = parse(["--predict-only", "--hardware", hardware, *TINY], roofline.build_parser())
    assert cfg.activations == want


def test_an_explicit_activation_dtype_wins_over_auto():
    cfg, *_ = parse(["--predict-only", "--hardware", "h100", "--activations", "f32", *TINY],
                    roofline.build_parser())
    assert cfg.activations == "f32"
    cfg, *_ = parse(["--activations", "bf16", *TINY])
    assert cfg.activations == "bf16"


def test_training_resolves_auto_from_the_platform_it_will_run_on(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert parse(TINY)[0].activations == "f32"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert platform_of() == "gpu" and parse(TINY)[0].activations == "bf16"
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert resolve_activations("auto") == "bf16"


def test_predict_only_prints_its_assumptions_in_one_line(capsys):
    assert roofline.main(["--predict-only", "--hardware", "h100", *TINY]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("assumed:")]
    assert len(lines) == 1
    for fact in ("activations bf16 (auto", "compute bf16", "remat full", "zero 3",
                 "prefetch off", "microbatches 1", "NCCL"):
        assert fact in lines[0]
