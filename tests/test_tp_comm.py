"""`ModelConfig.tp_comm`: sequence parallel and its collective-matmul ring equal `single`.

Each (tp_comm, layout) compiles one `loss_and_grads` and compares loss, every grad and the
grad norm with the single-device step (tolerances as in test_step.py), then checks that
the compiled step moves its activations the way the mode says. Params are drawn once
with numpy and placed in each layout: compiling `Trainer.init` per layout would cost more
than the step itself (its layout invariance is tested in test_step.py). Every program,
the reference too, is compiled with XLA's backend (LLVM) optimization off: that halves
the compile time, which is nearly all of this file's, and leaves the HLO's collectives
as they are.
"""
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from test_step import CFG, RTOL, TCFG, assert_tree_close, host, tokens, trainer

from engine.config import ParallelConfig
from engine.parallel.params import param_shapes

LAYOUTS = ["fsdp4xtp2", "fsdp2xtp4", "tp8"]
FAST_COMPILE = {"xla_backend_optimization_level": 0}
COLLECTIVE_OP = r"(all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)(?:-start)?\("


def compiled_loss_and_grads(t, init, batch):
    """(loss, grads, grad norm, the compiled program's collective ops) of Trainer `t` on
    host params `init` placed as it stores them."""
    params = jax.device_put(init, jax.tree.map(lambda s: NamedSharding(t.mesh, s), t.specs))
    compiled = t.loss_and_grads.lower(params, batch).compile(compiler_options=FAST_COMPILE)
    loss, grads, gnorm = compiled(params, batch)
    ops = set(re.findall(COLLECTIVE_OP, compiled.as_text()))
    return float(loss), host(grads), float(gnorm), ops


def assert_matches_single(got, single, what: str):
    """`compiled_loss_and_grads`' loss and grad norm within RTOL of the single-device
    step's, and every grad close to its (`assert_tree_close`)."""
    loss, grads, gnorm, _ = got
    want_loss, want_grads, want_gnorm, _ = single
    assert abs(loss - want_loss) <= RTOL * abs(want_loss)
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm
    assert_tree_close(grads, want_grads, what=what)


def loss_and_grads(layout, init, parallel=ParallelConfig()):
    t = trainer(layout, CFG, parallel)
    return compiled_loss_and_grads(t, init, t.put_batch(tokens()))


def random_params(cfg, seed):
    """Host params [global shapes]: matrices N(0, 0.1²), norm scales 1 + N(0, 0.1²)."""
    rng = np.random.default_rng(seed)
    draw = lambda path, s: (("norm" in jax.tree_util.keystr(path))
                            + 0.1 * rng.normal(size=s.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, TCFG.seed)


@pytest.fixture(scope="module")
def single(init):
    return loss_and_grads("single", init)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tp_comm", ["sequence", "ring"])
def test_tp_comm_matches_single(tp_comm, layout, init, single):
    got = loss_and_grads(layout, init, ParallelConfig(tp_comm=tp_comm))
    assert_matches_single(got, single, f"{tp_comm} {layout} grads ")
    ops = got[3]
    if tp_comm == "ring":
        # tp8 has no fsdp: every all-gather / reduce-scatter left would be a tp one
        assert "collective-permute" in ops, ops
        assert layout != "tp8" or not {"all-gather", "reduce-scatter"} & ops, ops
    else:
        assert "collective-permute" not in ops and {"all-gather", "reduce-scatter"} <= ops, ops


@pytest.mark.parametrize("tp_comm", ["allreduce", "sequence", "ring"])
def test_remat_dots_does_not_run_the_forwards_tp_reductions_again(tp_comm, init, single):
    """Remat `dots` saves the attention's output after its tp collective
    (`layers.scopes.SAVED_BY_DOTS`), so the backward rebuilds x + attn from it: the
    recompute runs no all-reduce or reduce-scatter over tp, and of the ring's ppermutes
    only the column-parallel gathers' (half the forward's), whose gathered inputs the
    weight grads need. Loss and grads still equal the single-device step's."""
    import dataclasses

    from engine.cost.ledger import step_ledger
    from engine.parallel.layout import Layout

    cfg, par = dataclasses.replace(CFG, remat="dots"), ParallelConfig(tp_comm=tp_comm)
    t = trainer("fsdp4xtp2", cfg, par)
    assert_matches_single(compiled_loss_and_grads(t, init, t.put_batch(tokens())), single,
                          f"dots {tp_comm} grads ")

    rows = step_ledger(cfg, TCFG, Layout.parse("fsdp4xtp2"), par)
    tp_runs = lambda phase, prim: sum(  # noqa: E731  (in the blocks: attention and MLP)
        r.count for r in rows if r.phase == phase and r.primitive == prim
        and r.axes == ("tp",) and r.scope in ("attention", "mlp"))
    for prim in ("psum_invariant", "psum", "reduce_scatter"):
        assert tp_runs("recompute", prim) == 0, prim
    assert 2 * tp_runs("recompute", "ppermute") == tp_runs("fwd", "ppermute")
    if tp_comm == "ring":
        assert tp_runs("fwd", "ppermute") > 0


@pytest.mark.parametrize("prefetch", [False, True])
def test_sequence_under_remat_none_gathers_its_inputs_again_in_the_backward(
        prefetch, init, single):
    """Outside a remat policy the sequence-parallel column keeps its input sharded and
    gathers it again in the backward (`collectives.ring.SequenceComm`, Korthikanti et
    al.): per layer two more tp all-gathers (attention's q/k/v input, the MLP's
    gate/up input), none in the loss head, none in a last layer run after a
    prefetching scan (one straight program there: XLA would merge the two gathers).
    Loss and grads equal the single-device step's."""
    import dataclasses

    from engine.cost.ledger import step_ledger
    from engine.parallel.layout import Layout

    cfg = dataclasses.replace(CFG, remat="none")
    par = ParallelConfig(tp_comm="sequence", zero=3, prefetch=prefetch)
    t = trainer("fsdp4xtp2", cfg, par)
    assert_matches_single(compiled_loss_and_grads(t, init, t.put_batch(tokens())), single,
                          f"none sequence prefetch={prefetch} grads ")

    rows = step_ledger(cfg, TCFG, Layout.parse("fsdp4xtp2"), par)
    gathers = lambda phase, scopes: sum(
        r.count for r in rows if r.phase == phase and r.primitive == "all_gather"
        and r.axes == ("tp",) and r.scope in scopes)
    regathered = cfg.n_layers - 1 if prefetch else cfg.n_layers
    assert gathers("recompute", ("attention", "mlp")) == 2 * regathered
    assert gathers("recompute", ("loss",)) == 0
    assert gathers("fwd", ("attention", "mlp")) == 2 * cfg.n_layers
