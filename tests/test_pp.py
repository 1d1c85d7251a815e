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

from engine import checkpoint, pipeline, validate
from engine.config import ConfigError, ParallelConfig, TrainConfig
from engine.data import synthetic_tokens
from engine.layout import Layout
from engine.step import Trainer
from test_step import CFG, RTOL, TCFG, assert_tree_close, host
from test_tp_comm import compiled_loss_and_grads, random_params

PP_CFG = dataclasses.replace(CFG, n_layers=8)


def tokens(tcfg=TCFG, step=0):
    return synthetic_tokens(tcfg.seed, step, tcfg.batch, tcfg.seq, CFG.vocab)


def trainer(layout, tcfg=TCFG, **parallel):
    lay = Layout.parse(layout)
    return Trainer(PP_CFG, tcfg, lay, lay.mesh(), ParallelConfig(**parallel))


def loss_and_grads(layout, init, tcfg=TCFG, **parallel):
    t = trainer(layout, tcfg, **parallel)
    return compiled_loss_and_grads(t, init, t.put_batch(tokens(tcfg)))


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
@pytest.mark.parametrize("name", list(pipeline.SCHEDULES))
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 3), (4, 4), (4, 6), (4, 8), (8, 8), (2, 8)])
def test_plan_runs_every_unit_once_in_dependency_order(name, pp, m):
    p = pipeline.plan(pipeline.SCHEDULES[name], pp, m)
    done = {}
    for t in range(p.ticks):
        for s in range(pp):
            kind, mb = int(p.kind_TP[t, s]), int(p.microbatch_TP[t, s])
            if kind == pipeline.IDLE:
                continue
            assert (kind, mb, s) not in done
            if kind == pipeline.FORWARD:
                assert s == 0 or done[(kind, mb, s - 1)] < t
            else:
                assert done[(pipeline.FORWARD, mb, s)] < t
                assert s == pp - 1 or done[(kind, mb, s + 1)] < t
            done[(kind, mb, s)] = t
    assert len(done) == 2 * pp * m
    # with a forward and a backward one tick each, the idle fraction is the textbook bubble
    assert p.bubble() == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 8)])
def test_1f1b_stashes_at_most_pp_microbatches_and_gpipe_m(pp, m):
    assert pipeline.plan(pipeline.SCHEDULES["1f1b"], pp, m).stash_slots == pp
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
