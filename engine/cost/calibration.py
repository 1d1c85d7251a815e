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

# The cpu profile used only when no calibration file exists. Each figure's command and
# host are in the bench result named beside it:
# peak_flops (the median rate of `small`'s matmul shapes as the step writes them, their
# operands' relayout copies inside), hbm (one device, out of cache; no hbm_cold) and
# collective_fit (kind -> (latency per ring hop s, bandwidth B/s)) but all-to-all:
#   `python bench/calibrate.py`, bench/results/2026-11-22-calibrate-zen5c2.md
# mfu_peak (engine/run/mfu.py's 2048^3 matmul) and all-to-all (`microbench_comm.collective_times`
#   + `fit`; as pessimistic as that run's all-gather): bench/results/2026-11-23-calibrate-cpu.md
# vector_flops, transcendental_flops: bench/calibrate.py's one-device rates,
#   bench/results/2026-11-25-calibrate-cpu.md
# beside_cost (`microbench_comm.beside_cost`), fault_cost (`microbench.fault_cost`), relayout_bw
#   (`python bench/calibrate.py`): the middle of three runs each,
#   bench/results/2026-11-27-microbench-xeon2c.md
CPU_DEFAULTS = {
    "peak_flops": {"float32": 6.5e10, "bfloat16": 4.5e10},
    "mfu_peak": {"float32": 9.71e10, "bfloat16": 5.39e10},
    "vector_flops": 3.62e10, "transcendental_flops": 2.17e9, "hbm": 2.5e9, "beside_cost": 0.88,
    "fault_cost": 6.59e-10, "relayout_bw": 6.07e9,
    "collective_fit": {"all-gather": (1.0e-4, 1.9e9), "reduce-scatter": (9.2e-5, 1.4e9),
                       "all-reduce": (4.1e-5, 1.1e9), "collective-permute": (7.1e-5, 8.1e8),
                       "all-to-all": (1.9e-5, 1.5e8)},
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
    without `hbm_cold` (and CPU_DEFAULTS) prices all traffic at `hbm`."""
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
