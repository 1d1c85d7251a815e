"""Remat `alternate`, torchtitan's per-op selective activation checkpointing
(layers/block.py `REMAT_POLICIES`): the step equals `single`'s and remat none's in loss
and grads, and its backward recomputes exactly the matmuls torchtitan's policy does.

Values: f32, compared as test_step.py compares layouts (RTOL 1e-5 of each tensor's
largest magnitude: sharded sums and the recompute reorder the last bits). A policy
changes what is recomputed, never what is computed, so the values alone cannot tell
`alternate` from `dots`: the ledger tests do, by the recomputed matmuls' FLOPs and
collectives, read off the traced step (engine/cost/ledger.py, no compile).
"""
import dataclasses

import pytest
from test_step import CFG, RTOL, TCFG, assert_tree_close
from test_tp_comm import compiled_loss_and_grads, random_params

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost.ledger import step_ledger
from engine.parallel.layout import Layout
from engine.run.data import synthetic_tokens
from engine.run.step import Trainer

ALTERNATE = dataclasses.replace(CFG, remat="alternate")


def loss_and_grads(layout, init, cfg, **parallel):
    lay = Layout.parse(layout)
    t = Trainer(cfg, TCFG, lay, lay.mesh(), ParallelConfig(**parallel))
    batch = synthetic_tokens(TCFG.seed, 0, TCFG.batch, TCFG.seq, cfg.vocab)
    return compiled_loss_and_grads(t, init, t.put_batch(batch))


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, TCFG.seed)


@pytest.fixture(scope="module")
def references(init):
    """`single` under remat full (CFG's) and under remat none."""
    return {remat: loss_and_grads("single", init, dataclasses.replace(CFG, remat=remat))
            for remat in ("full", "none")}


@pytest.mark.parametrize("layout, parallel", [  # fsdp also in the other two: fsdp8 slow
    pytest.param("fsdp8", {}, marks=pytest.mark.slow),
    ("fsdp2xtp4", dict(tp_comm="sequence")),
    ("pp2xfsdp4", dict(pp_schedule="1f1b", microbatches=2)),
])
def test_alternate_matches_single_and_remat_none(layout, parallel, init, references):
    loss, grads, gnorm, _ = loss_and_grads(layout, init, ALTERNATE, **parallel)
    for remat, (want_loss, want_grads, want_gnorm, _) in references.items():
        what = f"{layout} {parallel} alternate vs single remat {remat}"
        assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"{what} loss"
        assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm, f"{what} grad norm"
        assert_tree_close(grads, want_grads, what=f"{what} grads ")


# The reference kernel: dense scores under autodiff, so the policy's name on the kernel's
# output decides whether o = p v runs again (the flash kernels' custom_vjp recompute their
# own forward for its residuals under every policy but none).
LEDGER_CFG = model_config("tiny", dtype="f32", attention="reference")
LEDGER_TCFG = TrainConfig(batch=8, seq=16, steps=1)


def recomputed(layout, remat, parallel=ParallelConfig()):
    """The blocks' recomputed matmul FLOPs per device, and the runs of their tp
    reductions (all-reduce, reduce-scatter)."""
    cfg = dataclasses.replace(LEDGER_CFG, remat=remat)
    rows = step_ledger(cfg, LEDGER_TCFG, Layout.parse(layout), parallel)
    again = [r for r in rows if r.phase == "recompute" and r.scope in ("attention", "mlp")]
    flops = sum(r.flops * r.count for r in again if r.kind == "matmul")
    tp_sums = sum(r.count for r in again if r.axes == ("tp",)
                  and r.primitive in ("psum", "psum_invariant", "reduce_scatter"))
    return flops, tp_sums


@pytest.mark.parametrize("layout, parallel, tp", [
    ("fsdp4", ParallelConfig(), 1),
    ("fsdp2xtp2", ParallelConfig(tp_comm="sequence"), 2),
])
def test_alternate_recomputes_wk_wo_and_up(layout, parallel, tp):
    """torchtitan's policy recomputes every second matmul of a block (wk, wo, w3) and
    saves the attention's output: against `dots`, the backward runs wk, wo and wu again
    and o = p v no more (both recompute the scores q k^T). Under tp the out projection's
    reduced sum is saved, so neither wo nor its tp reduction runs again."""
    c = LEDGER_CFG
    B = LEDGER_TCFG.batch // (Layout.parse(layout).size // tp)
    T = B * LEDGER_TCFG.seq  # tokens per device
    Htp, Gtp, F = c.n_heads // tp, c.n_kv_heads // tp, c.mlp_dim // tp
    wk = 2 * T * c.d_model * Gtp * c.head_dim
    wo = 2 * T * Htp * c.head_dim * c.d_model
    wu = 2 * T * c.d_model * F
    pv = 2 * B * Htp * LEDGER_TCFG.seq ** 2 * c.head_dim  # dense: every query, every key
    full, _ = recomputed(layout, "full", parallel)
    dots, dots_sums = recomputed(layout, "dots", parallel)
    alternate, alternate_sums = recomputed(layout, "alternate", parallel)
    assert dots < alternate < full
    again = wk + wu + (wo if tp == 1 else 0) - pv
    assert alternate - dots == c.n_layers * again
    assert alternate_sums == dots_sums == 0


@pytest.mark.parametrize("layout", ["fsdp8", "fsdp4xtp2"])
def test_memory_model_puts_alternate_between_dots_and_full(layout):
    """alternate saves less than dots (no k, u; wo's output only where it crosses tp)
    and more than full (q, v, o, gate besides the carry): its predicted residuals and
    peak sit between theirs (tests/test_memory.py holds its peak to the compiler's)."""
    from engine.cost import memory

    tcfg = TrainConfig(batch=16, seq=64)
    peak, saved = {}, {}
    for remat in ("dots", "alternate", "full"):
        cfg = model_config("tiny", dtype="bf16", remat=remat, attention="reference")
        pred = memory.predict(cfg, tcfg, Layout.parse(layout), "cpu")
        peak[remat] = pred.peak
        saved[remat] = sum(v for k, v in pred.items.items() if k.startswith("residual"))
    assert peak["dots"] > peak["alternate"] > peak["full"]
    assert saved["dots"] > saved["alternate"] > saved["full"]
