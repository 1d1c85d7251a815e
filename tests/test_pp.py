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


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 2), (2, 3), (2, 8), (4, 3), (4, 4), (4, 8),
                                   (4, 16), (8, 8)])
def test_zb1_plan_splits_every_backward_in_1f1b_ticks_and_idles_less(pp, m):
    """zb1 (ZB-H1 in lock-step ticks): every F and B once, after its input; each W once,
    at or after its own B's tick; the forwards and Bs where 1F1B runs its forwards and
    backwards, so the same ticks and stash; at most s + 1 Bs without their W on stage s.
    With F, B and W of equal length its idle fraction is 2(pp-1)/(3M+2(pp-1)), below
    1F1B's (pp-1)/(M+pp-1) with a backward of B + W."""
    p = pipeline.plan(pipeline.SCHEDULES["zb1"], pp, m)
    ref = pipeline.plan(pipeline.SCHEDULES["1f1b"], pp, m)
    done = units_in_order(p, pp)
    assert len(done) == 2 * pp * m and p.split
    np.testing.assert_array_equal(p.forward_TP, ref.forward_TP)
    np.testing.assert_array_equal(p.backward_TP, ref.backward_TP)
    assert p.stash_slots == ref.stash_slots
    w_done = {}
    for t in range(p.ticks):
        for s in range(pp):
            i = int(p.weight_TP[t, s])
            if i != pipeline.NONE:
                assert ("w", i, s) not in w_done and done[("b", i, s)] <= t
                w_done[("w", i, s)] = t
            deferred = sum(1 for mb in range(m) if done[("b", mb, s)] <= t
                           and w_done.get(("w", mb, s), t + 1) > t)
            assert deferred <= s
    assert len(w_done) == pp * m
    zb1 = p.bubble(1.0, 2.0, 1.0)
    assert zb1 == pytest.approx(2 * (pp - 1) / (3 * m + 2 * (pp - 1)))
    assert zb1 < ref.bubble(1.0, 2.0)


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (2, 8, 4),
                                     (4, 6, 2), (2, 3, 2)])
def test_interleaved_plan_runs_every_chunk_in_order_with_the_circular_bubble(pp, m, v):
    """Device s runs chunks s, s + pp, ... of the model (C = pp·V chunks): every
    (microbatch, chunk) forward after the previous chunk's, every backward after the
    next chunk's, and the idle fraction is (pp-1)/(V·M+pp-1) when pp divides M, with
    fused ticks whatever the backward's length. Its stash is the most units stage 0
    holds at once: Megatron's interleaved warm-up 2(pp-1) + (V-1)·pp plus the one the
    tick's forward slot writes before its backward slot frees one, (V+1)·pp - 1, when
    pp divides M (at most that otherwise), and never more than all V·M."""
    p = pipeline.plan(pipeline.SCHEDULES["interleaved"], pp, m, virtual=v)
    assert len(units_in_order(p, pp, v)) == 2 * pp * v * m
    formula = (pp - 1) / (v * m + pp - 1)
    if m % pp == 0:
        for backward in (1.0, 2.0):
            assert p.bubble(1.0, backward) == pytest.approx(formula)
    else:  # a last group of fewer than pp microbatches waits for its own round trip
        assert p.bubble() > formula
    held = min(v * m, (v + 1) * pp - 1)
    assert p.stash_slots == held if m % pp == 0 else p.stash_slots <= held


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


@pytest.mark.parametrize("remat", ["full", *(pytest.param(r, marks=pytest.mark.slow)
                                           for r in ("none", "dots"))])
@pytest.mark.parametrize("layout, parallel", [
    ("pp2xfsdp4", dict(microbatches=2)),
    pytest.param("pp4xtp2", dict(microbatches=4), marks=pytest.mark.slow),
    pytest.param("pp2xfsdp2xtp2", dict(microbatches=4, tp_comm="sequence"),
                 marks=pytest.mark.slow),
    pytest.param("pp2xdp2xfsdp2", dict(microbatches=2, zero=2), marks=pytest.mark.slow),
    pytest.param("pp2xfsdp2xtp2", dict(microbatches=2, tp_comm="ring"),
                 marks=pytest.mark.slow),
    pytest.param("pp2xcp2xfsdp2", dict(microbatches=2), marks=pytest.mark.slow),
    # W reads values made invariant over pp back through the pp-varying W slots (the
    # prefetched gather's layer index): the split marks their operands varying alike
    pytest.param("pp2xcp2xfsdp2", dict(microbatches=2, zero=3, prefetch=True),
                 marks=pytest.mark.slow),
])
def test_zb1_matches_single(remat, layout, parallel, init, single):
    """The split backward (B at the backward's tick, W later from what B left) equals
    `single` under every remat policy, on pp alone and with fsdp, tp (every comm), dp,
    zero 2, cp, and zero 3 with prefetch."""
    cfg = dataclasses.replace(PP_CFG, remat=remat)
    got = loss_and_grads(layout, init, cfg=cfg, pp_schedule="zb1", **parallel)
    assert_matches(got, single, f"{layout} zb1 {parallel} remat {remat}")


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


REMAT_CASES = [  # (layout, parallel): the default suite keeps the first two
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
    case if i < 2 else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(REMAT_CASES)])
def test_pp_remat_policies_match_single(remat, layout, parallel, init, single):
    """The stash of vjp residuals under remat none and dots (full: the other tests)
    equals `single` (remat full: each policy recomputes differently, same values) under
    every schedule, composed with
    fsdp, tp (every comm), cp (both comms), dp and zero 2, prefetch."""
    cfg = dataclasses.replace(PP_CFG, remat=remat)
    got = loss_and_grads(layout, init, cfg=cfg, **parallel)
    assert_matches(got, single, f"{layout} {parallel} remat {remat}")


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


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_cp_pp_blocked_kernel_stashing_residuals_matches_single(schedule, init):
    """cp x pp under the blocked kernel with remat none: the stash holds the kernel's
    int32 key positions, which the tick makes from the item read at this stage's row
    of the table (varying over pp, as every stash slot does), and the step equals
    `single` under the same kernel."""
    cfg = dataclasses.replace(PP_CFG, remat="none", attention="blocked")
    got = loss_and_grads("cp2xpp2", init, cfg=cfg, microbatches=2, pp_schedule=schedule)
    assert_matches(got, loss_and_grads("single", init, cfg=cfg), f"cp2xpp2 blocked {schedule}")
