"""The pipeline's stage shifts (engine/parallel/shifts.py): a value replicated over tp
travels between stages as 1/tp slices gathered over tp on arrival. The shift against
numpy; the traced step's ppermutes over pp move 1/tp of x under `--tp-comm allreduce`
(and the stage's tp all-gather the whole), as they did under sequence parallel; the
compiled step holds those all-gathers (the audit); every schedule on pp2xtp2 equals
`single` (tests/test_pp.py's comparison)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P
from test_pp import PP_CFG, TCFG, assert_matches, loss_and_grads

import collectives
from engine.config import ParallelConfig, model_config
from engine.cost import pipeline as cp
from engine.cost.ledger import COLLECTIVES, step_ledger
from engine.parallel.layout import Layout
from engine.parallel.shifts import split_dim, stage_shift
from layers import scopes


@pytest.mark.parametrize("direction", [1, -1])
@pytest.mark.parametrize("shape, dim", [((2, 6, 4), 1), ((2, 3, 4), 2), ((4, 3, 5), 0),
                                        ((3, 3, 3), None)])
def test_stage_shift_sends_the_value_of_the_neighbouring_stage(direction, shape, dim):
    """On a (pp 4, tp 2) mesh each stage receives its neighbour's value whole, cut along
    L, else D, else B, or sent whole when tp divides none of them; the result is typed
    invariant over tp, as the value sent was."""
    assert split_dim(shape, 2) == dim
    mesh = jax.make_mesh((4, 2), ("pp", "tp"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4 * shape[0], *shape[1:])),
                    jnp.float32)

    def f(x_BLD):
        y_BLD = stage_shift(x_BLD, "pp", direction, "tp")
        assert "tp" not in collectives.varying_axes(y_BLD)
        return y_BLD

    y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("pp"), out_specs=P("pp")))(x)
    want = np.roll(np.asarray(x).reshape(4, *shape), direction, axis=0).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(y), want)  # moved, not computed: exact


TINY = model_config("tiny", n_layers=4, dtype="f32")
SHIFT_TCFG = dataclasses.replace(TCFG, batch=8, seq=32)


def tick_collectives(layout, **parallel):
    """The x shape [B/M, L, D] of `layout` and the step's collectives that its ticks
    run outside their units (the stage shifts), one tick's: [(primitive, axes, bytes)]."""
    lay, par = Layout.parse(layout), ParallelConfig(microbatches=2, **parallel)
    rows = step_ledger(TINY, SHIFT_TCFG, lay, par)
    once = cp._once([r for r in rows if scopes.PP_TICK in r.pp])
    own = [r for r in once if not set(cp.UNITS.values()) & set(r.pp)]
    return [(r.primitive, r.axes, r.bytes) for r in own
            if r.kind == "collective" and COLLECTIVES.get(r.primitive)]  # no pvary


X_BYTES = SHIFT_TCFG.batch // 2 * SHIFT_TCFG.seq * TINY.d_model * 4  # [B/M, L, D] f32


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_allreduce_shifts_send_one_tp_th_of_x_over_pp_and_gather_it_over_tp(schedule):
    """pp2xtp2 --tp-comm allreduce: each shift's ppermute over pp moves x / tp (it moved
    x whole from every tp rank before), followed by an all-gather over tp of the whole
    x; under sequence parallel x is already cut over tp and the shifts were so already."""
    got = tick_collectives("pp2xtp2", pp_schedule=schedule)
    assert got == [("ppermute", ("pp",), X_BYTES / 2),
                   ("all_gather_invariant", ("tp",), X_BYTES)] * 2
    seq = tick_collectives("pp2xtp2", pp_schedule=schedule, tp_comm="sequence")
    assert seq == [("ppermute", ("pp",), X_BYTES / 2)] * 2
    assert tick_collectives("pp2xfsdp2", pp_schedule=schedule) == [
        ("ppermute", ("pp",), X_BYTES / 2)] * 2  # fsdp halves the batch: no tp, sent whole


def test_audit_finds_the_shifts_tp_all_gathers_in_the_compiled_step():
    """The compiled pp2xtp2 allreduce step holds exactly the ledger's collectives, among
    them two all-gathers over tp of x a tick (the received x and cotangent made whole)
    and two collective-permutes over pp of half of it."""
    from test_audit import TCFG as AUDIT_TCFG, _audit_step

    from engine.run.step import Trainer

    layout, par = "pp2xtp2", ParallelConfig(microbatches=2, pp_schedule="1f1b")
    cfg = dataclasses.replace(model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8,
                                           dtype="f32"), n_layers=2)
    result = _audit_step(cfg, layout, par)
    assert result.clean, (result.missing, result.extra)
    lay = Layout.parse(layout)
    ticks = Trainer(cfg, AUDIT_TCFG, lay, lay.abstract_mesh(), par).plan.ticks
    x_bytes = AUDIT_TCFG.batch // 2 * AUDIT_TCFG.seq * cfg.d_model * 4
    assert result.matched[("all-gather", ("tp",), "f32", x_bytes)] == 2 * ticks
    assert result.matched[("collective-permute", ("pp",), "f32", x_bytes // 2)] == 2 * ticks


@pytest.mark.slow
@pytest.mark.parametrize("schedule, parallel", [
    ("gpipe", {}), ("1f1b", {}), ("zb1", {}), ("interleaved", dict(pp_virtual=2))])
def test_every_schedule_on_pp2xtp2_allreduce_matches_single(schedule, parallel):
    """The shifts' slices and gathers carry x and its cotangent unchanged: loss, grads
    and grad norm equal `single`'s (f32, test_step.py's RTOL) under every schedule."""
    from test_tp_comm import random_params

    init = random_params(PP_CFG, TCFG.seed)
    want = loss_and_grads("single", init)
    got = loss_and_grads("pp2xtp2", init, microbatches=2, pp_schedule=schedule,
                         tp_comm="allreduce", **parallel)
    assert_matches(got, want, f"pp2xtp2 {schedule} {parallel}")
