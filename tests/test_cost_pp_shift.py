"""The pipelined step's stage shifts in the price (engine/cost/pipeline.py): the forward
shift runs under the tick's backward slot where collectives are async, the cotangent's
shift is exposed, and on a host without overlap both are."""
import dataclasses

import numpy as np
import pytest

from engine.cli.args import build_parser, parse_or_exit
from engine.cost import hardware
from engine.cost import pipeline as cp
from engine.cost.ledger import step_ledger
from engine.cost.price import collective_seconds
from engine.parallel import pipeline
from layers import scopes

ARGS = ["--model", "tiny", "--layers", "4", "--d-model", "256", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--mlp-dim", "512", "--vocab", "512",
        "--seq", "256", "--batch", "32", "--layout", "pp2xtp2", "--microbatches", "4",
        "--pp-schedule", "1f1b", "--activations", "bf16"]


@pytest.fixture(scope="module")
def traced():
    cfg, tcfg, parallel, layout, _ = parse_or_exit(ARGS, build_parser())
    return step_ledger(cfg, tcfg, layout, parallel), layout, pipeline.step_plan(layout, parallel)


def test_the_forward_shift_hides_under_the_backward_slot_where_collectives_are_async(traced):
    """Each tick = its slowest units + its own rows (the buffer writes, and two shifts
    of [B/M, L, D], each a ppermute of half of it over pp and an all-gather over tp,
    priced on the ticks where some stage sends it) - the forward shift's time hidden
    under the tick's slowest backward, hand-counted here from the shift rows' ring
    prices (collective-permute: bytes / bw + latency; all-gather over tp's links) and
    the hidden share of the H100 profile; the warm-up ticks, which hold no backward,
    hide nothing."""
    rows, layout, plan = traced
    hw = hardware.get("h100")
    mesh = layout.mesh_axes()
    pipe = cp.predict_pipeline(rows, hw, mesh, plan)
    once = cp._once([r for r in rows if scopes.PP_TICK in r.pp])
    shifts = [r for r in once if r.primitive in ("ppermute", "all_gather_invariant")
              and not set(cp.UNITS.values()) & set(r.pp)]
    # x forward, the cotangent back: each replicated over tp (allreduce), so half of it
    # goes over pp and the stage gathers the halves over tp (engine/parallel/shifts.py)
    assert [(r.primitive, r.axes) for r in shifts] == [
        ("ppermute", ("pp",)), ("all_gather_invariant", ("tp",))] * 2
    assert 2 * shifts[0].bytes == shifts[1].bytes
    x, ct = (sum(collective_seconds(r, hw, mesh) * r.count for r in rs)
             for rs in (shifts[:2], shifts[2:]))
    sends_T = plan.send_x_T * x + plan.send_ct_T * ct
    assert len(set(sends_T)) > 1  # ticks that send differ: the writes are what they share
    np.testing.assert_allclose(pipe.shift_T - sends_T, pipe.shift_T[0] - sends_T[0],
                               rtol=1e-9)
    f, b = pipe.unit_s[cp.FORWARD], pipe.unit_s[cp.BACKWARD]
    backward_T = ((plan.backward_TP != pipeline.NONE) * b[None, :]).max(axis=1)
    hidden_T = (np.minimum(x, backward_T) * plan.send_x_T  # where the x shift runs
                * (1 - hw.overlap_slowdown / (1 + hw.overlap_slowdown)))
    expected_T = plan.lockstep_T(f, b) + pipe.shift_T - hidden_T
    np.testing.assert_allclose(pipe.tick_s, expected_T, rtol=1e-9)
    assert 0 < hidden_T.max() and hidden_T[~plan.any_backward_T].max() == 0
    # without async collectives nothing hides: ticks are units + their own rows
    serial = dataclasses.replace(hw, overlap=False)
    np.testing.assert_allclose(cp.predict_pipeline(rows, serial, mesh, plan).tick_s,
                               plan.lockstep_T(f, b) + pipe.shift_T, rtol=1e-9)
