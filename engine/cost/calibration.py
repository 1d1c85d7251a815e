"""The `cpu` profile: this host's rates, measured by `bench/calibrate.py` (which writes
`CALIBRATION_PATH`), or the built-in `CPU_DEFAULTS` when no calibration file exists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from engine.cost.hardware import Hardware, Link

CALIBRATION_PATH = Path(os.environ.get("SHARDWISE_CPU_PROFILE",
                                       Path.home() / ".cache" / "shardwise" / "cpu_profile.json"))

# The cpu profile used only when no calibration file exists: every figure the median of
# three `python bench/calibrate.py` runs on the project's 2-core Intel Xeon host, so all
# of them mean what a calibration file's do (`hbm` the host's rate summed over its 8
# forced devices on data its caches hold, `hbm_cold` on data they do not, the matmul rate
# the step's own dots with all devices at once); the runs and their spread:
# bench/results/2026-11-29-calibrate-defaults-xeon2c.md
CPU_DEFAULTS = {
    "peak_flops": {"float32": 1.49e11, "bfloat16": 2.78e11},
    "mfu_peak": {"float32": 2.5e11, "bfloat16": 1.2e12},
    "vector_flops": 4.19e10, "transcendental_flops": 1.49e9, "hbm": 5.54e10,
    "hbm_cold": 1.18e10, "beside_cost": 0.0358, "fault_cost": 5.02e-10, "relayout_bw": 4.77e9,
    "collective_fit": {"all-gather": (3.07e-5, 1.1e9), "reduce-scatter": (3.11e-5, 1.32e9),
                       "all-reduce": (1.94e-5, 1.66e9), "collective-permute": (3.28e-5, 1.12e9),
                       "all-to-all": (1.53e-5, 3.5e8)},
}


class ProfileError(ValueError):
    """A calibration file that is missing, unreadable or not a cpu profile (one line)."""


def _non_negative(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _positive(x) -> bool:
    return _non_negative(x) and x > 0


def load_calibration(path: Path | str) -> dict:
    """A `bench/calibrate.py` file's contents, checked; raises ProfileError."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"calibration file {path}: "
                           + ("is a directory" if path.is_dir() else "not found"))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"calibration file {path}: not readable JSON ({e})") from None
    problems = []
    if not isinstance(data, dict):
        raise ProfileError(f"calibration file {path}: want a JSON object "
                           f"(bench/calibrate.py's output)")
    for key in ("hbm", "vector_flops"):
        if not _positive(data.get(key)):
            problems.append(f"{key} must be a positive number")
    for key in ("hbm_cold", "transcendental_flops", "fault_cost", "relayout_bw"):
        if key in data and not _positive(data[key]):
            problems.append(f"{key} must be a positive number")
    if "beside_cost" in data and not _non_negative(data["beside_cost"]):
        problems.append("beside_cost must be a number >= 0")
    for key in ("peak_flops", "mfu_peak"):
        rates = data.get(key, {} if key == "mfu_peak" else None)
        if not isinstance(rates, dict) or (key == "peak_flops" and "float32" not in rates) \
                or not all(_positive(v) for v in rates.values()):
            problems.append(f"{key} must map dtypes (float32 at least) to positive FLOP/s")
    fit = data.get("collective_fit")
    if not isinstance(fit, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)
            and v[1] > 0 for v in fit.values()):
        problems.append("collective_fit must map kinds to [latency, bandwidth]")
    if problems:
        raise ProfileError(f"calibration file {path}: " + "; ".join(problems)
                           + " (rerun bench/calibrate.py)")
    return data


def cpu_profile(path: Path | str | None = None) -> Hardware:
    """The CPU profile from `path` (which must exist), else from CALIBRATION_PATH when
    it exists, else CPU_DEFAULTS. Raises ProfileError for a bad file.

    Each forced device is a thread of one host, so compute adds up across devices
    (shared_host) and collectives are synchronous memory copies (no overlap). A
    collective's time is `collective_fit[kind] = (latency, bandwidth)` fitted from
    measured times vs bytes on the 8-device mesh. Memory: `hbm` is the host's rate on
    data its caches hold, `hbm_cold` on data they do not (`Hardware.cold_hbm`); a file
    without `hbm_cold` prices all traffic at `hbm`."""
    if path is None and not CALIBRATION_PATH.exists():
        return cpu_defaults()
    path = Path(path) if path else CALIBRATION_PATH
    return _cpu(load_calibration(path), f"calibrated ({path})")


def cpu_defaults() -> Hardware:
    """The CPU profile from CPU_DEFAULTS, whatever calibration file exists."""
    return _cpu(CPU_DEFAULTS, "built-in defaults (run bench/calibrate.py)")


def _cpu(data: dict, source: str) -> Hardware:
    fit = {k: tuple(v) for k, v in data["collective_fit"].items()}
    bw, lat = fit.get("all-gather", (2e-5, data["hbm"]))[::-1]
    return Hardware("cpu", dict(data["peak_flops"]), data["vector_flops"], data["hbm"],
                    Link(bw, lat), Link(bw, lat), 1 << 30, overlap=False, shared_host=True,
                    bf16_collectives_in_f32=True, collective_fit=fit,
                    cold_hbm=data.get("hbm_cold", 0.0),
                    transcendental_flops=data.get("transcendental_flops", 0.0),
                    beside_cost=data.get("beside_cost", 0.0),
                    fault_cost=data.get("fault_cost", 0.0),
                    relayout_bw=data.get("relayout_bw", data["hbm"]),
                    mfu_peak=dict(data.get("mfu_peak", {})), source=source)
