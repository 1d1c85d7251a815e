"""ZeRO-1, ZeRO-2 and ZeRO-3 with prefetch equal `single`; params, grads and optimizer
state sit where each level says; checkpoints move between levels; each level's step
holds the collectives it should, where it should (read from the traced step's ledger).

Model, data and tolerances are test_step.py's (RTOL, PARAM_ATOL justified there).
Compiles dominate the run time, so each (layout, zero) trainer's two programs are
compiled once, with LLVM at -O0 (`FAST`: half the compile time on this CPU; the
optimized HLO, i.e. the collectives, fusions and order of sums, is the same text as
with the default options), and every run starts from `single`'s initial params placed
from the host (init is layout-invariant, tested in test_step.py)."""
import dataclasses
import functools

import jax
import numpy as np
import pytest
import reference_model as ref
from jax.sharding import NamedSharding, PartitionSpec as P
from test_step import CFG, RTOL, TCFG, assert_params_close, assert_tree_close, host, tokens, trainer

from engine.config import ParallelConfig
from engine.cost.ledger import step_ledger
from engine.parallel.layout import Layout
from engine.parallel.params import init_params, param_shapes, param_specs
from engine.run import checkpoint

CASES = [(1, False), (2, False), (3, True)]  # (zero, prefetch)
LAYOUTS = ["fsdp4xtp2", "fsdp8", "dp2xfsdp2xtp2"]
BLOCK_WEIGHTS = 7  # wq wk wv wo wg wu wd; the two norm scales are never fsdp-sharded


@functools.lru_cache(maxsize=None)
def zero_trainer(layout: str, zero: int, prefetch: bool):
    return trainer(layout, CFG, ParallelConfig(zero=zero, prefetch=prefetch))


def is_spec(x):
    return isinstance(x, P)


def without_fsdp(specs):
    return jax.tree.map(lambda s: P(*(None if e == "fsdp" else e for e in s)), specs,
                        is_leaf=is_spec)


def place(t, params_host):
    """Host params and AdamW's initial state (all zeros) placed as `t` stores them."""
    opt_host = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                            jax.eval_shape(t.tx.init, param_shapes(t.cfg)))
    put = lambda x, spec: jax.device_put(x, NamedSharding(t.mesh, spec))
    return jax.tree.map(put, params_host, t.specs), jax.tree.map(put, opt_host, t.opt_specs)


FAST = {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def programs(t):
    """(loss_and_grads, train_step) of trainer `t`, compiled with `FAST`."""
    params, opt_state = place(t, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                              param_shapes(t.cfg)))
    batch = t.put_batch(tokens())
    return (t.loss_and_grads.lower(params, batch).compile(FAST),
            t.train_step.lower(params, opt_state, batch).compile(FAST))


def loss_and_grads(t, params):
    loss, grads, gnorm = programs(t)[0](params, t.put_batch(tokens()))
    return float(loss), host(grads), float(gnorm)


def steps(t, params, opt_state, first, last):
    """Train steps first..last-1 -> (params, opt_state, losses)."""
    losses = []
    for step in range(first, last):
        params, opt_state, m = programs(t)[1](params, opt_state, t.put_batch(tokens(step)))
        losses.append(float(m["loss"]))
    return params, opt_state, losses


@pytest.fixture(scope="module")
def single():
    """test_step.py's `run("single")`: init params, loss, grads, grad norm, 3 steps."""
    t = trainer("single")
    init = host(init_params(CFG, t.layout, t.mesh, TCFG.seed))
    loss, grads, gnorm = loss_and_grads(t, place(t, init)[0])
    params, _, losses = steps(t, *place(t, init), 0, TCFG.steps)
    return dict(init=init, loss=loss, grads=grads, gnorm=gnorm, losses=losses,
                params=host(params))


# every level on fsdp4xtp2 (fsdp and tp both present) by default; the other layouts with -m slow
@pytest.mark.parametrize("zero,prefetch,layout", [
    pytest.param(z, p, lay, marks=() if lay == LAYOUTS[0] else pytest.mark.slow)
    for lay in LAYOUTS for z, p in CASES])
def test_matches_single_and_stores_as_the_level_says(zero, prefetch, layout, single):
    t = zero_trainer(layout, zero, prefetch)
    params, opt_state = place(t, single["init"])
    loss, grads, gnorm = loss_and_grads(t, params)
    assert abs(loss - single["loss"]) <= RTOL * abs(single["loss"])
    assert abs(gnorm - single["gnorm"]) <= RTOL * single["gnorm"]
    assert_tree_close(grads, single["grads"], what=f"zero {zero} {layout} grads ")
    params, opt_state, losses = steps(t, params, opt_state, 0, TCFG.steps)
    np.testing.assert_allclose(losses, single["losses"], rtol=RTOL)
    assert_params_close(host(params), single["params"], single["grads"],
                        what=f"zero {zero} {layout} params after 3 steps ")

    # where the step left them: params whole on every fsdp device under zero 1/2,
    # optimizer state sharded over fsdp as the param table says under every level
    table = param_specs(t.cfg, t.layout)
    stored = table if zero == 3 else without_fsdp(table)
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(stored, is_leaf=is_spec),
                       strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(t.mesh, spec), x.ndim)
    fsdp = t.layout.degree("fsdp")
    wq = params["blocks"]["wq"].addressable_shards[0].data  # [N, D, H, K], D over fsdp
    assert wq.shape[1] == (CFG.d_model if zero < 3 else CFG.d_model // fsdp)
    for x, spec in zip(jax.tree.leaves(opt_state), jax.tree.leaves(t.opt_specs, is_leaf=is_spec),
                       strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(t.mesh, spec), x.ndim)
    mu_wq = opt_state[0].mu["blocks"]["wq"]  # adamw: (ScaleByAdamState, ...)
    assert mu_wq.addressable_shards[0].data.shape[1] == CFG.d_model // fsdp


@pytest.mark.parametrize("zero,prefetch,layout", [
    (1, False, "fsdp4xtp2"), (2, False, "fsdp4xtp2"), (3, True, "fsdp4xtp2"),
    (2, False, "pp2xfsdp2xtp2")])
def test_evaluation_loss_matches_single_under_each_level(zero, prefetch, layout, single):
    """`Trainer.loss` (what --eval-every and --eval-only run) reads the params as the
    level stores them: under zero 2 the model takes `Resident` weights, made as the
    step makes them. Its value is the single-device loss of the same params."""
    par = ParallelConfig(zero=zero, prefetch=prefetch,
                         microbatches=2 if layout.startswith("pp") else 1)
    t = zero_trainer(layout, zero, prefetch) if par.microbatches == 1 else trainer(
        layout, CFG, par)
    got = float(t.loss(place(t, single["init"])[0], t.put_batch(tokens())))
    assert abs(got - single["loss"]) <= RTOL * abs(single["loss"])


def test_init_stores_zero2_params_whole_over_fsdp(single):
    t = zero_trainer("fsdp4xtp2", 2, False)
    params, opt_state = t.init(TCFG.seed)
    for got, want in zip(jax.tree.leaves(host(params)), jax.tree.leaves(single["init"])):
        np.testing.assert_array_equal(got, want)
    # the state `place` starts every other run from
    for got, want in zip(jax.tree.leaves(host(opt_state)), jax.tree.leaves(
            host(place(t, single["init"])[1])), strict=True):
        np.testing.assert_array_equal(got, want)
    for x, spec in zip(jax.tree.leaves((params, opt_state)),
                       jax.tree.leaves((t.specs, t.opt_specs), is_leaf=is_spec), strict=True):
        assert x.sharding == NamedSharding(t.mesh, spec)
    assert all("fsdp" not in s for s in jax.tree.leaves(t.specs, is_leaf=is_spec))
    assert any("fsdp" in s for s in jax.tree.leaves(t.opt_specs, is_leaf=is_spec))


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def meta(t) -> dict:
    return dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(t.cfg), layout="fsdp4xtp2",
                train=dataclasses.asdict(TCFG), data=dict(source="synthetic", dtype="uint16"))


def test_checkpoints_move_between_zero_levels(single, tmp_path):
    """Step 0 under zero 3, saved; restored under zero 1 for step 1, saved; restored
    under zero 3 for step 2: the same losses and final params as single's run."""
    z3, z1 = zero_trainer("fsdp4xtp2", 3, True), zero_trainer("fsdp4xtp2", 1, False)
    params, opt_state = place(z3, single["init"])
    losses = []
    for step, (writer, reader) in enumerate([(z3, z1), (z1, z3)]):
        params, opt_state, got = steps(writer, params, opt_state, step, step + 1)
        losses += got
        path = checkpoint.save(str(tmp_path), step + 1, params, opt_state,
                               meta(writer), 2)
        saved = checkpoint.read(path)
        params, opt_state = checkpoint.restore(saved, reader)
        for part, tree in (("params", params), ("opt_state", opt_state)):
            want = getattr(saved, part)
            assert all(np.array_equal(x, want[k]) for k, x in flat(tree).items()), part
        for x, spec in zip(jax.tree.leaves((params, opt_state)),
                           jax.tree.leaves((reader.specs, reader.opt_specs), is_leaf=is_spec)):
            assert x.sharding == NamedSharding(reader.mesh, spec)
    params, opt_state, got = steps(z3, params, opt_state, 2, 3)
    np.testing.assert_allclose(losses + got, single["losses"], rtol=RTOL)
    assert_params_close(host(params), single["params"], single["grads"], what="resumed params ")


# none, alternate and dots take the same hand-written backward scan
# (`block.prefetched_saving`): run by -m slow; the default suite runs that scan in
# tests/test_tp_comm.py (remat none, prefetch, sequence parallel, against single)
@pytest.mark.parametrize("remat", ["full", *(pytest.param(r, marks=pytest.mark.slow)
                                             for r in ("none", "alternate", "dots"))])
def test_prefetch_over_three_layers_matches_the_plain_model(remat):
    """Three layers, so the scan body runs twice and hands a gathered layer through the
    carry (with two it runs once): loss and grads equal the plain model's, under each
    remat's hand-written backward (full: the layer recomputed; none / dots: the saved
    residuals with the weights gathered again)."""
    cfg = dataclasses.replace(CFG, n_layers=3, remat=remat)
    rng = np.random.default_rng(0)
    init = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(np.float32),
                        param_shapes(cfg))
    want_loss, want_grads = jax.jit(jax.value_and_grad(ref.loss), static_argnums=2)(
        init, tokens(), cfg.n_layers)
    t = trainer("fsdp4xtp2", cfg, ParallelConfig(prefetch=True))
    loss, grads, _ = loss_and_grads(t, place(t, init)[0])
    assert abs(loss - float(want_loss)) <= RTOL * abs(float(want_loss))
    assert_tree_close(grads, host(want_grads), what=f"prefetch, remat {remat}, 3 layers ")


N = 3  # layers in the traced steps below: prefetch's scan then runs N - 1 = 2 times


def collective_counts(zero, prefetch, layout="fsdp4xtp2", remat="full"):
    """{(primitive, phase, scope): [executions per step of each op]} over fsdp alone."""
    cfg = dataclasses.replace(CFG, n_layers=N, remat=remat)
    parallel = ParallelConfig(zero=zero, prefetch=prefetch)
    out = {}
    for row in step_ledger(cfg, TCFG, Layout.parse(layout), parallel):
        if row.kind == "collective" and row.axes == ("fsdp",) and row.primitive != "pvary":
            out.setdefault((row.primitive, row.phase, row.scope), []).append(row.count)
    return out


def test_each_level_places_the_collectives_it_should():
    z3, pre = collective_counts(3, False), collective_counts(3, True)
    z2, z1 = collective_counts(2, False), collective_counts(1, False)
    per_layer = [N] * BLOCK_WEIGHTS  # one op per block weight in the scan body, N trips
    # zero 3: a layer's weights gathered together (collectives.gather_many: one
    # all-gather in the scan body, N trips) in the forward and again in remat's
    # recompute; its transpose, one reduce-scatter per layer, in the backward
    assert z3[("all_gather", "fwd", "gather_params")] == [N]
    assert z3[("all_gather", "recompute", "gather_params")] == [N]
    assert z3[("reduce_scatter", "bwd", "gather_params")] == [N]
    # prefetch (remat full): layer 0 before the scan, 1..N-1 inside it: N gathers of
    # each layer in the forward; the backward scan gathers again one layer ahead (layer
    # N-1 before it, N-2..0 inside it), with no remat recompute phase of its own
    fwd = pre[("all_gather", "fwd", "gather_params")]
    assert sorted(fwd) == [1, N - 1]
    assert sorted(pre[("all_gather", "bwd", "gather_params")]) == [1, N - 1]
    assert not any(k[0] == "all_gather" and k[1] == "recompute" for k in pre)
    assert sum(pre[("reduce_scatter", "bwd", "gather_params")]) == N
    # zero 2: no gather before the update; grads reduce-scattered per layer inside the
    # backward scan; every updated shard (7 block weights, embed, unembed) gathered once
    assert not any(k[0].startswith("all_gather") and k[1] != "update" for k in z2)
    assert z2[("reduce_scatter", "bwd", "gather_params")] == per_layer
    assert z2[("all_gather_invariant", "update", "optimizer")] == [1] * (BLOCK_WEIGHTS + 2)
    # zero 1: no gather before the update, no reduce-scatter: every grad all-reduced
    assert not any(k[0].startswith("all_gather") and k[1] != "update" for k in z1)
    assert not any(k[0] == "reduce_scatter" for k in z1)
    assert len(z1[("psum_invariant", "update", "reduce_grads")]) == len(
        jax.tree.leaves(param_shapes(CFG)))
    assert z1[("all_gather_invariant", "update", "optimizer")] == [1] * (BLOCK_WEIGHTS + 2)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_prefetch_regathers_weights_in_the_backward_under_saving_remats(remat):
    """Prefetch under remat none / dots keeps the layers' residuals but not their
    weights: the backward gathers each layer again (N gathers, one layer ahead) and
    reduce-scatters its grads once, with no recompute phase of the gathers."""
    pre = collective_counts(3, True, remat=remat)
    assert sorted(pre[("all_gather", "fwd", "gather_params")]) == [1, N - 1]
    assert sum(pre[("all_gather", "bwd", "gather_params")]) == N
    assert not any(k[0] == "all_gather" and k[1] == "recompute" for k in pre)
    assert sum(pre[("reduce_scatter", "bwd", "gather_params")]) == N
