"""bench/pipeline.py's trace readers on a hand-made module and trace: `unit_kinds` splits
the units' time by kind (F, B, W) and per unit, and counts the collectives inside each
kind apart (what tells a forward that carries the fsdp gather from a B that does not)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pipeline as bench  # noqa: E402
from engine.parallel import pipeline  # noqa: E402
from layers import scopes  # noqa: E402

MODULE = f"""HloModule step

ENTRY %main (p: f32[4]) -> f32[4] {{
  %ag = f32[8] all-gather(f32[4] %p), metadata={{op_name="jit/{scopes.PP_TICK}/{scopes.PP_FORWARD}/gather"}}
  %f = f32[4] fusion(f32[8] %ag), kind=kLoop, metadata={{op_name="jit/{scopes.PP_TICK}/{scopes.PP_FORWARD}/dot"}}
  %b = f32[4] fusion(f32[4] %f), kind=kLoop, metadata={{op_name="jit/{scopes.PP_TICK}/{scopes.PP_BACKWARD}/dot"}}
  %rs = f32[4] reduce-scatter(f32[8] %ag), metadata={{op_name="jit/{scopes.PP_TICK}/{scopes.PP_WEIGHT}/rs"}}
  ROOT %w = f32[4] fusion(f32[4] %rs), kind=kLoop, metadata={{op_name="jit/{scopes.PP_TICK}/{scopes.PP_WEIGHT}/dot"}}
}}
"""


def test_unit_kinds_splits_the_units_time_by_kind_per_unit_with_their_collectives():
    """zb1 on pp 2 with M = 2 runs 2 units of each kind on each stage. On each of 4
    devices (2 per stage) every F is an all-gather of 3 ms then a fusion of 5 ms, every
    B one fusion of 4 ms (overlapping a stray copy of itself, counted once), every W a
    reduce-scatter of 1 ms and a fusion of 2 ms: per unit F 8 ms (3 of them the
    gather's), B 4, W 3 (1 the reduce-scatter's)."""
    the_plan = pipeline.plan(pipeline.SCHEDULES["zb1"], 2, 2)
    ms = 1_000_000
    events, clock = [], 0
    for dev in range(4):
        for _ in range(2):
            events += [("ag", dev, clock, 3 * ms), ("f", dev, clock + 3 * ms, 5 * ms),
                       ("b", dev, clock + 10 * ms, 4 * ms),
                       ("b", dev, clock + 11 * ms, 2 * ms),  # nested in the one before
                       ("rs", dev, clock + 20 * ms, 1 * ms), ("w", dev, clock + 21 * ms, 2 * ms)]
            clock += 30 * ms
    got = bench.unit_kinds(MODULE, events, the_plan, n_devices=4, steps=1)
    want = {"F": 8e-3, "F coll.": 3e-3, "B": 4e-3, "B coll.": 0.0, "W": 3e-3, "W coll.": 1e-3}
    assert got == pytest.approx(want), got


def test_unit_kinds_counts_no_w_units_outside_a_split_plan():
    the_plan = pipeline.plan(pipeline.SCHEDULES["1f1b"], 2, 2)
    events = [("f", 0, 0, 1_000_000), ("b", 0, 2_000_000, 1_000_000)]
    got = bench.unit_kinds(MODULE, events, the_plan, n_devices=2, steps=1)
    assert got["W"] == 0.0 and got["W coll."] == 0.0
    assert got["F"] == pytest.approx(1e-3 / 4)  # 4 forwards (2 a stage), each on 1 device
