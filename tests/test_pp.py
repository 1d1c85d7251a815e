"""Pipeline parallelism (`pp`): the schedules' tables, and the whole step under pp
layouts and schedules equal to `single` in loss, grads and grad norm (f32, tolerances
as in test_step.py); invalid combinations refused in one line; a pp checkpoint loads
on another layout.

The model has 8 layers so that pp8 gives each stage one. As in test_tp_comm.py,
params are drawn once with numpy and placed in each layout, and programs compile with
XLA's backend optimization off."""
import dataclasses

import jax
import numpy as np
import pytest
from test_step import CFG, RTOL, TCFG, assert_tree_close, host
from test_tp_comm import compiled_loss_and_grads, random_params

from engine.config import ConfigError, ParallelConfig
from engine.parallel import pipeline, validate
from engine.parallel.layout import Layout
from engine.run import checkpoint
from engine.run.data import synthetic_tokens
from engine.run.step import Trainer

PP_CFG = dataclasses.replace(CFG, n_layers=8)


def tokens(tcfg=TCFG, step=0):
    return synthetic_tokens(tcfg.seed, step, tcfg.batch, tcfg.seq, CFG.vocab)


def trainer(layout, tcfg=TCFG, cfg=PP_CFG, **parallel):
    lay = Layout.parse(layout)
    return Trainer(cfg, tcfg, lay, lay.mesh(), ParallelConfig(**parallel))


def loss_and_grads(layout, init, tcfg=TCFG, cfg=PP_CFG, **parallel):
    """As test_tp_comm's, with params and grads in the model's layer order (a circular
    schedule stores its blocks in another, `Trainer.layer_order`)."""
    t = trainer(layout, tcfg, cfg, **parallel)
    order = t.layer_order
    if order is not None:
        init = pipeline.reorder_blocks(init, order)
    loss, grads, gnorm, ops = compiled_loss_and_grads(t, init, t.put_batch(tokens(tcfg)))
    if order is not None:
        grads = pipeline.reorder_blocks(grads, np.argsort(order))
    return loss, grads, gnorm, ops


@pytest.fixture(scope="module")
def init():
    return random_params(PP_CFG, TCFG.seed)


@pytest.fixture(scope="module")
def single(init):
    return loss_and_grads("single", init)


def assert_matches(got, want, what):
    loss, grads, gnorm, _ = got
    want_loss, want_grads, want_gnorm, _ = want
    assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"{what} loss {loss} vs {want_loss}"
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm, f"{what} grad norm"
    assert_tree_close(grads, want_grads, what=f"{what} grads ")


# -- the schedules' tables --------------------------------------------------------------
def units_in_order(p, pp, v=1):
    """{(kind, microbatch, model chunk): tick} of plan `p`, checking on the way that every
    unit runs once and after its input: a forward after the previous chunk's forward, a
    backward after the next chunk's backward, or on the model's last chunk after its own
    forward (at the same tick only under a fused schedule, whose forward slot runs
    first); and that what arrives is kept in the slot the reading unit takes."""
    C, done = pp * v, {}
    for t in range(p.ticks):
        for s in range(pp):
            for kind, table in (("f", p.forward_TP), ("b", p.backward_TP)):
                i = int(table[t, s])
                if i == pipeline.NONE:
                    continue
                mb, c = i // v, i % v * pp + s
                assert (kind, mb, c) not in done
                if kind == "f":
                    assert c == 0 or done[("f", mb, c - 1)] < t
                    if c > 0:  # sent by chunk c - 1's device, kept in this unit's slot
                        assert p.recv_x_TP[done[("f", mb, c - 1)], s] == i % p.x_slots
                elif c == C - 1:
                    assert done[("f", mb, c)] <= t
                else:
                    assert done[("b", mb, c + 1)] < t
                    assert p.recv_ct_TP[done[("b", mb, c + 1)], s] == i % p.ct_slots
                done[(kind, mb, c)] = t
    return done


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 3), (4, 4), (4, 6), (4, 8), (8, 8), (2, 8)])
def test_plan_runs_every_unit_once_in_dependency_order(name, pp, m):
    """Every unit once, after its input; the idle fraction is the textbook bubble
    (p-1)/(M+p-1) with a backward as long as a forward and with one twice as long: 1F1B's
    steady ticks run a forward and a backward on every stage, so its mixed ticks do not
    run at the backward's pace."""
    p = pipeline.plan(pipeline.SCHEDULES[name], pp, m)
    done = units_in_order(p, pp)
    assert len(done) == 2 * pp * m
    for backward in (1.0, 2.0, 3.0):
        assert p.bubble(1.0, backward) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (2, 8, 4),
                                     (4, 6, 2), (2, 3, 2)])
def test_interleaved_plan_runs_every_chunk_in_order_with_the_circular_bubble(pp, m, v):
    """Device s runs chunks s, s + pp, ... of the model (C = pp·V chunks): every
    (microbatch, chunk) forward after the previous chunk's, every backward after the
    next chunk's, and the idle fraction is (pp-1)/(V·M+pp-1) when pp divides M, with
    fused ticks whatever the backward's length; it stashes fewer chunk inputs than the
    V·M of GPipe's order once M > 2·pp."""
    p = pipeline.plan(pipeline.SCHEDULES["interleaved"], pp, m, virtual=v)
    assert len(units_in_order(p, pp, v)) == 2 * pp * v * m
    formula = (pp - 1) / (v * m + pp - 1)
    if m % pp == 0:
        for backward in (1.0, 2.0):
            assert p.bubble(1.0, backward) == pytest.approx(formula)
    else:  # a last group of fewer than pp microbatches waits for its own round trip
        assert p.bubble() > formula
    assert p.stash_slots <= min(v * m, 2 * v * pp - 1)


def test_interleaved_storage_order_puts_chunk_s_plus_k_pp_on_device_s():
    order = pipeline.storage_order(8, 2, 2)  # chunks of 2 layers: 0 1 | 2 3 | 4 5 | 6 7
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # device 0: chunks 0, 2; 1: 1, 3
    assert pipeline.storage_order(8, 2, 1).tolist() == list(range(8))


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8)])
def test_1f1b_ticks_fuse_a_forward_and_a_backward_and_stash_at_most_2pp_minus_1(pp, m):
    """1F1B: after p - 1 warm-up ticks each of M ticks runs a forward and a backward on
    the last stage, M + 2(p - 1) ticks in all; a stage holds a microbatch for its round
    trip, 2(p - 1 - s) ticks, so the stash is min(M, 2p - 1) (GPipe's M)."""
    p = pipeline.plan(pipeline.SCHEDULES["1f1b"], pp, m)
    assert p.ticks == m + 2 * (pp - 1)
    both = (p.forward_TP != pipeline.NONE) & (p.backward_TP != pipeline.NONE)
    assert both[:, pp - 1].sum() == m
    assert p.stash_slots == min(m, 2 * pp - 1)
    assert pipeline.plan(pipeline.SCHEDULES["gpipe"], pp, m).stash_slots == m


# -- the step ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout, schedule, m", [
    ("pp2xfsdp4", "1f1b", 2),
    ("pp4xtp2", "gpipe", 2),  # fewer microbatches than stages, not a multiple of pp
    ("pp2xdp2xfsdp2", "gpipe", 2),
    pytest.param("pp2xfsdp4", "gpipe", 2, marks=pytest.mark.slow),
    pytest.param("pp4xtp2", "1f1b", 4, marks=pytest.mark.slow),
    pytest.param("pp4xtp2", "1f1b", 8, marks=pytest.mark.slow),
    pytest.param("pp2xdp2xfsdp2", "1f1b", 2, marks=pytest.mark.slow),
    pytest.param("pp8", "1f1b", 8, marks=pytest.mark.slow),
    pytest.param("pp8", "gpipe", 4, marks=pytest.mark.slow),
])
def test_pp_matches_single(layout, schedule, m, init, single):
    got = loss_and_grads(layout, init, microbatches=m, pp_schedule=schedule)
    assert_matches(got, single, f"{layout} {schedule} M={m}")
    assert "collective-permute" in got[3], got[3]


@pytest.mark.parametrize("layout, m, v, batch", [
    ("pp2xfsdp4", 2, 2, 8),
    pytest.param("pp4xtp2", 4, 2, 8, marks=pytest.mark.slow),
    pytest.param("pp2xdp2xfsdp2", 2, 4, 8, marks=pytest.mark.slow),
    pytest.param("pp2xfsdp4", 3, 2, 12, marks=pytest.mark.slow),  # M not a multiple of pp
])
def test_interleaved_matches_single(layout, m, v, batch, init, single):
    """The circular schedule (V chunks per device, blocks stored in its order) equals
    `single` in loss, grads (mapped back to the model's layer order) and grad norm."""
    tcfg = dataclasses.replace(TCFG, batch=batch)
    want = single if batch == TCFG.batch else loss_and_grads("single", init, tcfg)
    got = loss_and_grads(layout, init, tcfg, microbatches=m, pp_schedule="interleaved",
                         pp_virtual=v)
    assert_matches(got, want, f"{layout} interleaved V={v} M={m}")
    assert "collective-permute" in got[3], got[3]


@pytest.mark.slow
@pytest.mark.parametrize("layout, parallel", [
    ("pp2xfsdp4", dict(zero=1)),
    ("pp2xfsdp4", dict(zero=2)),
    ("pp2xfsdp4", dict(prefetch=True)),
    ("pp2xfsdp2xtp2", dict(tp_comm="sequence")),
    ("pp2xcp2xfsdp2", dict()),
])
def test_pp_composes(layout, parallel, init, single):
    got = loss_and_grads(layout, init, microbatches=2, **parallel)
    assert_matches(got, single, f"{layout} {parallel}")


@pytest.mark.parametrize("layout, parallel", [
    ("pp2xfsdp2xtp2", dict(tp_comm="ring", pp_schedule="1f1b")),
    ("pp2xcp2xfsdp2", dict(cp_comm="ring", pp_schedule="1f1b")),
    pytest.param("pp2xfsdp2xtp2", dict(tp_comm="ring", pp_schedule="gpipe"),
                 marks=pytest.mark.slow),
    pytest.param("pp2xcp2xtp2", dict(tp_comm="ring", cp_comm="ring", pp_schedule="1f1b"),
                 marks=pytest.mark.slow),
    pytest.param("pp2xfsdp2xtp2", dict(tp_comm="ring", pp_schedule="interleaved",
                                       pp_virtual=2), marks=pytest.mark.slow),
])
def test_rings_under_pp_match_single(layout, parallel, init, single):
    """A ring's collective-permutes inside the stages' units (tp ring, cp ring): the
    plan is uniform, every device runs each tick's units and keeps its own, and the step
    equals `single`. (Run per stage, as the other comms are, the tp ring hung XLA:CPU's
    rendezvous and the cp ring's permutes met the other stage's: a wrong loss.)"""
    t = trainer(layout, microbatches=2, **parallel)
    assert t.plan.uniform
    got = loss_and_grads(layout, init, microbatches=2, **parallel)
    assert_matches(got, single, f"{layout} {parallel}")


def test_uniform_plans_only_for_ring_comms_and_their_phases_cover_the_units():
    """Only a ring comm over an axis of more than one device makes a plan uniform; a
    tick's forward (backward) slot runs where any stage's holds one (1F1B has ticks with
    both, GPipe none)."""
    for layout, parallel, want in [
            ("pp2xfsdp2xtp2", dict(tp_comm="ring"), True),
            ("pp2xcp2xfsdp2", dict(cp_comm="ring"), True),
            ("pp2xfsdp2xtp2", dict(tp_comm="sequence", cp_comm="ring"), False),
            ("pp2xcp2xfsdp2", dict(tp_comm="ring"), False)]:
        the_plan = pipeline.step_plan(Layout.parse(layout),
                                      ParallelConfig(microbatches=2, **parallel))
        assert the_plan.uniform == want, (layout, parallel)
    for name in ("gpipe", "1f1b"):
        p = pipeline.plan(pipeline.SCHEDULES[name], 4, 8, uniform=True)
        assert (p.any_forward_T == (p.forward_TP != pipeline.NONE).any(axis=1)).all()
        assert (p.any_forward_T & p.any_backward_T).any() == (name == "1f1b")


REMAT_CASES = [  # (layout, parallel): the default suite keeps the first three
    ("pp2xtp4", dict(pp_schedule="1f1b", microbatches=4)),
    ("pp2xfsdp4", dict(pp_schedule="gpipe", microbatches=2)),
    ("pp2xfsdp4", dict(pp_schedule="interleaved", pp_virtual=2, microbatches=2)),
    ("pp4xtp2", dict(pp_schedule="1f1b", microbatches=8)),
    ("pp2xfsdp2xtp2", dict(pp_schedule="1f1b", microbatches=2, tp_comm="sequence")),
    ("pp2xfsdp2xtp2", dict(pp_schedule="1f1b", microbatches=2, tp_comm="ring")),
    ("pp2xfsdp2xtp2", dict(pp_schedule="gpipe", microbatches=2, tp_comm="ring")),
    ("pp2xcp2xfsdp2", dict(pp_schedule="1f1b", microbatches=2)),
    ("pp2xcp2xfsdp2", dict(pp_schedule="1f1b", microbatches=2, cp_comm="ring")),
    ("pp2xcp2xfsdp2", dict(pp_schedule="interleaved", pp_virtual=2, microbatches=2,
                           cp_comm="ring")),
    ("pp2xdp2xfsdp2", dict(pp_schedule="gpipe", microbatches=2, zero=2)),
    ("pp2xfsdp4", dict(pp_schedule="1f1b", microbatches=2, prefetch=True)),
]


@pytest.mark.parametrize("remat", ["none", "dots"])
@pytest.mark.parametrize("layout, parallel", [
    case if i < 3 else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(REMAT_CASES)])
def test_pp_remat_policies_match_single(remat, layout, parallel, init, single):
    """The stash of vjp residuals (remat none, dots) equals `single` (remat full: each
    policy recomputes differently, same values) under every schedule, composed with
    fsdp, tp (every comm), cp (both comms), dp and zero 2, prefetch."""
    cfg = dataclasses.replace(PP_CFG, remat=remat)
    got = loss_and_grads(layout, init, cfg=cfg, **parallel)
    assert_matches(got, single, f"{layout} {parallel} remat {remat}")


@pytest.mark.parametrize("layout, parallel", [
    ("pp2xfsdp4", ParallelConfig(microbatches=2)),
    ("pp4xtp2", ParallelConfig(microbatches=4, pp_schedule="gpipe")),
    ("pp2xfsdp4", ParallelConfig(microbatches=2, pp_schedule="interleaved", pp_virtual=2)),
])
def test_remat_none_under_pp_runs_no_forward_twice(layout, parallel):
    """The matmul FLOPs the pp step executes (each stage's forward and backward units M·V
    times, read off the traced step's rows, engine/cost/pipeline.py `unit_rows`) equal
    the same step's without pp under remat none and dots: the backward applies the
    stashed residuals and recomputes nothing the policy saved. Under full the pp step
    recomputes the stage, head included, so it executes more."""
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import UNITS, _once, unit_rows
    from layers import scopes

    lay = Layout.parse(layout)
    pp = lay.degree("pp")
    others = lay.size // pp
    flat = Layout.parse(f"fsdp{lay.size}")
    matmul = lambda rows: sum(r.flops * r.count for r in rows if r.kind == "matmul")  # noqa: E731
    for remat in ("none", "dots", "full"):
        cfg = dataclasses.replace(PP_CFG, remat=remat)
        rows = step_ledger(cfg, TCFG, lay, parallel)
        the_plan = pipeline.step_plan(lay, parallel)
        ticks = _once([r for r in rows if scopes.PP_TICK in r.pp])
        edges = {scopes.PP_FIRST, scopes.PP_LAST}  # once per microbatch, not per chunk
        units = [unit_rows(ticks, k, s, pp) for k in UNITS for s in range(pp)]
        body = sum(matmul([r for r in u if not edges & set(r.pp)]) for u in units)
        edge = sum(matmul([r for r in u if edges & set(r.pp)]) for u in units)
        outside = matmul([r for r in rows if scopes.PP_TICK not in r.pp])
        M = parallel.microbatches
        executed = (the_plan.units * body + M * edge) * others + outside * lay.size
        without = matmul(step_ledger(cfg, TCFG, flat, ParallelConfig())) * lay.size
        if remat == "full":
            assert executed > without
        else:
            assert executed == pytest.approx(without, rel=1e-12), remat


@pytest.mark.slow
def test_1f1b_with_microbatches_not_a_multiple_of_pp(init):
    tcfg = dataclasses.replace(TCFG, batch=6)
    got = loss_and_grads("pp2xtp4", init, tcfg, microbatches=3)
    assert_matches(got, loss_and_grads("single", init, tcfg), "pp2xtp4 1f1b M=3")


def test_pp_evaluation_loss_matches_single(init, single):
    t = trainer("pp4xtp2", microbatches=4)
    params = jax.device_put(init, jax.tree.map(
        lambda s: jax.sharding.NamedSharding(t.mesh, s), t.specs))
    loss = float(t.loss(params, t.put_batch(tokens())))
    assert abs(loss - single[0]) <= RTOL * abs(single[0])


# -- refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout, cfg, parallel, message", [
    ("pp4xfsdp2", dataclasses.replace(CFG, n_layers=6), dict(microbatches=2,
     pp_schedule="gpipe"), "layers=6 not divisible by pp=4"),
    ("pp4xtp2", PP_CFG, dict(microbatches=2),
     "--pp-schedule 1f1b needs microbatches >= pp: --microbatches 2 < pp=4"),
    ("pp2xfsdp4", PP_CFG, dict(pp_schedule="zigzag"), "pp_schedule='zigzag' not one of"),
    ("pp4xfsdp2", PP_CFG, dict(microbatches=4, pp_schedule="interleaved", pp_virtual=3),
     "layers=8 not divisible by pp x pp_virtual = 4 x 3"),
    ("pp2xfsdp4", PP_CFG, dict(microbatches=2, pp_virtual=2),
     "--pp-virtual 2 needs --pp-schedule interleaved"),
    ("pp2xfsdp4", PP_CFG, dict(pp_schedule="interleaved", pp_virtual=0),
     "pp_virtual=0 must be >= 1"),
])
def test_invalid_pp_refused_in_one_line(layout, cfg, parallel, message):
    with pytest.raises(ConfigError) as e:
        validate.check(cfg, TCFG, ParallelConfig(**parallel), Layout.parse(layout))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_decoding_under_pp_refused_in_one_line():
    found = validate.decoder_problems(PP_CFG, Layout.parse("pp2xtp4"), 2, 32, None)
    assert len(found) == 1 and "without pp" in found[0]


# -- checkpoints ------------------------------------------------------------------------
@pytest.mark.slow
def test_pp_checkpoint_resumes_on_another_layout(init, tmp_path):
    """One train step under pp2xfsdp4, saved; loaded under fsdp4xtp2 the values are the
    same and the next step's loss equals the pp run's."""
    t = trainer("pp2xfsdp4", microbatches=2)
    shard = lambda tree, specs, mesh: jax.device_put(tree, jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, s), specs))
    params = shard(init, t.specs, t.mesh)
    opt_state = jax.jit(t.tx.init, out_shardings=jax.tree.map(
        lambda s: jax.sharding.NamedSharding(t.mesh, s), t.opt_specs))(params)
    params, opt_state, _ = t.train_step(params, opt_state, t.put_batch(tokens()))
    meta = dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(PP_CFG),
                layout="pp2xfsdp4", train=dataclasses.asdict(TCFG),
                data=dict(source="synthetic", dtype="uint16"))
    path = checkpoint.save(str(tmp_path), 1, params, opt_state, meta, 1)
    want = float(t.loss(params, t.put_batch(tokens(step=1))))
    other = trainer("fsdp4xtp2")
    ckpt = checkpoint.read(path)
    loaded, loaded_opt = checkpoint.restore(ckpt, other)
    for a, b in zip(jax.tree.leaves(host(loaded)), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)
    got = float(other.loss(loaded, other.put_batch(tokens(step=1))))
    assert abs(got - want) <= RTOL * abs(want)


# -- the cost model -----------------------------------------------------------------------
def _unit_row(unit, flops, ticks):
    from engine.cost.ledger import Row
    from layers import scopes

    pp = (scopes.PP_TICK,) + ((unit,) if unit else ())
    return Row("mlp", "fwd", "matmul", "dot_general", "bfloat16", (1,), flops, 0.0, ticks,
               pp=pp)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_price_is_ticks_of_the_slowest_stage(name, v, pp):
    """Rows of one forward unit, one backward unit (1 or 2x the forward's FLOPs) and a
    tick's own row, priced along the table: the step is the sum over ticks of the slowest
    stage's work (its forward and its backward slot) plus the tick's row. GPipe's ticks
    are all forwards or all backwards and 1F1B's steady ticks a forward and a backward
    on every stage, so every schedule takes (V·M + p - 1)(F + B) and idles
    (p-1)/(V·M+p-1) of a stage's time, whatever B / F. On a shared host idle slots cost
    no time, V·M (F + B), though a stage waits as long."""
    from engine.cost import hardware
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predict
    from layers import scopes

    h100, mesh = hardware.get("h100"), (("pp", pp),)
    for m in (pp, 2 * pp, 4 * pp):
        the_plan = pipeline.plan(pipeline.SCHEDULES[name], pp, m, virtual=v)
        T, formula = the_plan.ticks, (pp - 1) / (v * m + pp - 1)
        for ratio in (1, 2):
            rows = [_unit_row(scopes.PP_FORWARD, 1e12, T),
                    _unit_row(scopes.PP_BACKWARD, ratio * 1e12, T), _unit_row(None, 1e9, T)]
            one = lambda r: predict([dataclasses.replace(r, count=1)], h100, mesh).step_s
            F, B, tick = (one(r) for r in rows)
            got = predict_pipeline(rows, h100, mesh, the_plan)
            assert got.schedule_bubble == pytest.approx(formula)
            on_f, on_b = (the_plan.forward_TP != pipeline.NONE), (the_plan.backward_TP
                                                                  != pipeline.NONE)
            units = (on_f * F + on_b * B).max(axis=1).sum()
            assert got.step_s == pytest.approx(units + T * tick)
            assert units == pytest.approx((v * m + pp - 1) * (F + B))
            assert got.bubble == pytest.approx(formula)
            cpu = hardware.cpu_defaults()
            F, B, tick = (predict([dataclasses.replace(r, count=1)], cpu, mesh).step_s
                          for r in rows)
            shared = predict_pipeline(rows, cpu, mesh, the_plan)
            assert shared.step_s == pytest.approx(v * m * (F + B) + T * tick)
            assert shared.bubble == pytest.approx(formula)  # the devices still wait


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_pipeline_price_runs_every_kind_of_unit_its_tick_holds(name):
    """A uniform plan: every stage runs the tick's units (first- and last-stage parts
    included), so a tick costs F, B, or F + B when some stage's forward slot and some
    stage's backward slot are full, on an accelerator and on a shared host alike: both
    schedules take (M + p - 1)(F + B)."""
    from engine.cost import hardware
    from engine.cost.ledger import Row
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predict
    from layers import scopes

    pp, m = 4, 8
    the_plan = pipeline.plan(pipeline.SCHEDULES[name], pp, m, uniform=True)
    T = the_plan.ticks
    head = Row("loss", "fwd", "matmul", "dot_general", "bfloat16", (1,), 3e11, 0.0, T,
               pp=(scopes.PP_TICK, scopes.PP_BACKWARD, scopes.PP_LAST))
    rows = [_unit_row(scopes.PP_FORWARD, 1e12, T), _unit_row(scopes.PP_BACKWARD, 2e12, T),
            head, _unit_row(None, 1e9, T)]
    for hw in (hardware.get("h100"), hardware.cpu_defaults()):
        one = lambda rs: predict([dataclasses.replace(r, count=1) for r in rs], hw,  # noqa: E731
                                 (("pp", pp),)).step_s
        F, B, tick = one(rows[:1]), one(rows[1:3]), one(rows[3:])
        got = predict_pipeline(rows, hw, (("pp", pp),), the_plan)
        want = (F * the_plan.any_forward_T + B * the_plan.any_backward_T).sum()
        assert got.step_s == pytest.approx(want + T * tick)
        assert want == pytest.approx((m + pp - 1) * (F + B))


@pytest.mark.parametrize("layout", ["pp2xfsdp4", "pp4xfsdp2"])
def test_traced_pipeline_price_follows_the_bubble(layout):
    """The traced step (AbstractMesh, no compile) priced on an H100 along GPipe's table
    for M = p, 2p, 4p: the pipeline's part is the sum over ticks of the slowest active
    stage's unit, (M + p - 1) x (forward + backward) up to the stages' imbalance (the
    first embeds, the last takes the loss); the bubble falls with M, from the formula's
    (p-1)/(M+p-1) up to what the imbalance adds; the step is below the ledger's upper
    bound (every branch on every tick)."""
    from engine.cost import hardware
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.cost.price import predict

    lay, h100 = Layout.parse(layout), hardware.get("h100")
    pp = lay.degree("pp")
    tcfg, bubbles = dataclasses.replace(TCFG, batch=32), [1.0]
    for m in (pp, 2 * pp, 4 * pp):
        par = ParallelConfig(microbatches=m, pp_schedule="gpipe")
        rows = step_ledger(PP_CFG, tcfg, lay, par)
        pred, pipe = predict_step(rows, h100, lay, par)
        fwd, bwd = pipe.unit_s[0], pipe.unit_s[1]
        assert (fwd > 0).all() and (bwd > fwd).all() and bwd[-1] > bwd[0]  # the loss
        units = pred.step_s - pipe.outside_s - len(pipe.tick_s) * pipe.shift_s
        the_plan = pipeline.plan(pipeline.SCHEDULES["gpipe"], pp, m)
        assert units == pytest.approx(the_plan.lockstep_T(fwd, bwd).sum())
        assert ((m + pp - 1) * (fwd.min() + bwd.min()) <= units
                <= (m + pp - 1) * (fwd.max() + bwd.max()))
        assert pipe.bubble == pytest.approx(1 - m * (fwd + bwd).sum() / (pp * units))
        # idle stage-ticks are the floor; a stage slower than the rest (the last one's
        # loss) adds its gap on every tick, at most as if every stage were the slowest
        formula = (pp - 1) / (m + pp - 1)
        balance = (fwd + bwd).mean() / (fwd.max() + bwd.max())
        assert formula <= pipe.bubble <= 1 - (1 - formula) * balance
        assert pipe.bubble < bubbles[-1]
        bubbles.append(pipe.bubble)
        assert pred.step_s < predict(rows, h100, lay.mesh_axes()).step_s


@pytest.mark.parametrize("layout", ["pp2xfsdp4", "pp4xfsdp2"])
def test_memory_gpipe_stashes_m_and_1f1b_fewer(layout):
    """The memory model: under remat full GPipe's peak exceeds 1F1B's by its more
    stashed stage inputs, M - min(M, 2p - 1) (each [B/M, L, D] f32 on this device); under none and dots the stash holds a unit's residuals per slot, so the
    gap is as many slots of those, and both policies stash more than full."""
    from engine.cost import memory

    lay = Layout.parse(layout)
    pp, fsdp = lay.degree("pp"), lay.degree("fsdp")
    tcfg = dataclasses.replace(TCFG, batch=32)
    for m in (pp, 2 * pp, 4 * pp):
        peak = {(s, remat): memory.predict(dataclasses.replace(PP_CFG, remat=remat), tcfg,
                                           lay, "cpu", parallel=ParallelConfig(
                                               microbatches=m, pp_schedule=s)).peak
                for s in ("gpipe", "1f1b") for remat in ("full", "dots", "none")}
        slots = m - min(m, 2 * pp - 1)
        x_micro = tcfg.batch // fsdp // m * tcfg.seq * PP_CFG.d_model * 4
        assert peak["gpipe", "full"] - peak["1f1b", "full"] == slots * x_micro
        for remat in ("dots", "none"):
            assert peak["gpipe", remat] - peak["1f1b", remat] >= slots * x_micro
            assert peak["1f1b", remat] > peak["1f1b", "full"]
        assert peak["1f1b", "none"] > peak["1f1b", "dots"]


@pytest.mark.slow
def test_memory_model_against_the_compiler():
    """Predicted peaks of pp4xfsdp2 under every schedule (M = 8) within 15% of
    `memory_analysis()`'s, and the compiler's gpipe - 1f1b gap is the predicted one."""
    from engine.cost import memory

    lay, tcfg = Layout.parse("pp4xfsdp2"), dataclasses.replace(TCFG, batch=32)
    got = {}
    for s in pipeline.SCHEDULES:
        par = ParallelConfig(microbatches=8, pp_schedule=s)
        t = Trainer(PP_CFG, tcfg, lay, lay.mesh(), par)
        measured = memory.measure(memory.compile_step(t, {"xla_backend_optimization_level": 0}))
        predicted = memory.predict(PP_CFG, tcfg, lay, "cpu", parallel=par)
        assert abs(predicted.peak - measured["peak"]) <= 0.15 * measured["peak"], s
        got[s] = (measured["peak"], predicted.peak)
    # the one slot more of gpipe (8 against 2p - 1 = 7), to the compiler's alignment
    gap = got["gpipe"][1] - got["1f1b"][1]
    assert got["gpipe"][0] - got["1f1b"][0] == pytest.approx(gap, rel=0.02)


@pytest.mark.slow
def test_interleaved_storage_keeps_checkpoints_in_the_model_order(tmp_path):
    """A circular schedule stores device s's chunks s, s + pp, ...: its `init` equals the
    plain layout's once unstored; a checkpoint of a plain layout restores into it (and
    back out of it, as the training loop saves) with the same values, and its loss on
    those params equals the plain layout's."""
    plain, inter = trainer("fsdp8"), trainer("pp2xfsdp4", microbatches=2,
                                             pp_schedule="interleaved", pp_virtual=2)
    params, opt_state = plain.init(TCFG.seed)
    got, _ = inter.init(TCFG.seed)
    assert not np.array_equal(host(got)["blocks"]["wq"], host(params)["blocks"]["wq"])
    for a, b in zip(jax.tree.leaves(host(inter.unstore(got))), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)
    meta = dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(PP_CFG), layout="fsdp8",
                train=dataclasses.asdict(TCFG), data=dict(source="synthetic", dtype="uint16"))
    ckpt = checkpoint.read(checkpoint.save(str(tmp_path), 1, params, opt_state, meta, 1))
    loaded, loaded_opt = checkpoint.restore(ckpt, inter)
    for a, b in zip(jax.tree.leaves(host((inter.unstore(loaded), inter.unstore(loaded_opt)))),
                    jax.tree.leaves(host((params, opt_state)))):
        np.testing.assert_array_equal(a, b)
    want = float(plain.loss(params, plain.put_batch(tokens())))
    got_loss = float(inter.loss(loaded, inter.put_batch(tokens())))
    assert abs(got_loss - want) <= RTOL * abs(want)
