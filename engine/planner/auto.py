"""`--layout auto` (the first choice of a plan for the devices jax finds) and the plan's
helpers around it: the hardware profile to plan with, why no candidate is left, sizes
in GiB. engine/planner/search.py re-exports them."""
from __future__ import annotations

import os

from engine.config import ConfigError, ParallelConfig, TrainConfig
from layers.config import ModelConfig


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.3g} GiB" if x >= 2**30 else f"{x / 2**20:.3g} MiB"


def hardware_profile(name: str, calibration=None, say=print):
    """The profile to plan with; for the cpu without a calibration file, one line saying
    that the built-in defaults are used (engine/cost/calibration.py CPU_DEFAULTS)."""
    from engine.cost import hardware
    from engine.cost.calibration import CALIBRATION_PATH

    if name == "cpu" and calibration is None and not CALIBRATION_PATH.exists():
        say(f"no cpu calibration at {CALIBRATION_PATH} (bench/calibrate.py writes "
            f"it): planning with the built-in defaults (engine/cost/calibration.py CPU_DEFAULTS)")
    return hardware.get(name, calibration)


def no_plan_message(result, n: int) -> str:
    """Why no candidate is left, in one line."""
    if result.over:
        least = min(peak for _, peak in result.over)
        return (f"no layout of {n} devices fits {gib(result.capacity)} per device: "
                f"{len(result.over)} candidates predicted over it (the smallest peak is "
                f"{gib(least)}); {len(result.refused)} refused by engine.parallel.validate")
    reason = result.refused[0][1] if result.refused else "no candidates" + "".join(
        f"; {r} left out: {w}" for r, w in result.left_out.items())
    return (f"no layout of {n} devices can run this model ({len(result.refused)} "
            f"refused; first: {reason})")


# `--layout auto` on a host without accelerators plans for this many forced host-CPU
# devices unless XLA_FLAGS already forces a count (the 8 the tests and benches use)
AUTO_HOST_DEVICES = 8
# substrings of a jax device_kind -> hardware profile
DEVICE_KINDS = {"h100": "h100", "a100": "a100", "v5 lite": "v5e", "v5e": "v5e", "v5p": "v5p",
                "v4": "v4"}


def device_profile(devices, say=print):
    """The cost model's profile of `devices`: the cpu profile on the host (`hardware_profile`),
    else the profile of the accelerator's kind; None when that kind has none."""
    kind = devices[0].device_kind.lower()
    name = "cpu" if devices[0].platform == "cpu" else next(
        (p for k, p in DEVICE_KINDS.items() if k in kind), None)
    return None if name is None else hardware_profile(name, None, say)


def auto(cfg: ModelConfig, tcfg: TrainConfig, say=print,
         base: ParallelConfig = ParallelConfig(), pinned: dict | None = None):
    """`--layout auto`: plan for every device jax finds (the cpu profile on the host,
    else the profile of the accelerator's kind) and return the first choice as (model
    config with its remat, ParallelConfig, Layout); raises ConfigError (one line) when
    nothing fits or the accelerator has no profile. base, pinned: as `plan`'s (the
    switches the user gave)."""
    import jax

    from engine.planner.search import plan, progress_line

    devices = jax.devices()
    hw = device_profile(devices, say)
    if hw is None:
        raise ConfigError(f"--layout auto: no hardware profile for {devices[0].device_kind!r} "
                          f"(known: cpu, {', '.join(sorted(set(DEVICE_KINDS.values())))}); "
                          f"name a layout")
    result = plan(cfg, tcfg, len(devices), hw, pinned=pinned, workers=os.cpu_count() or 1,
                  progress=progress_line(say), devices=devices, say=say, base=base)
    if not result.ranked:
        raise ConfigError(no_plan_message(result, len(devices)))
    best = result.ranked[0]
    timed = ", its matmuls timed here" if best.dots_timed else ""
    say(f"layout auto: {best.candidate.describe()}, predicted {best.step_s:.4g} s/step"
        f"{timed}, MFU {100 * best.mfu:.1f}%, peak {gib(best.peak_bytes)} per device on {hw.name}; "
        f"first of {len(result.ranked)} candidates for {len(devices)} devices "
        f"({result.seconds:.1f} s; python -m engine.plan ranks them)")
    c = best.candidate
    return c.cfg, c.parallel, c.layout

