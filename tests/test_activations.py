"""bf16 activations (`ModelConfig.activations`): sharded layouts equal `single` in the
same numerics, `single` stays close to f32 (and so to the plain model, which f32
`single` equals to 1e-5: tests/test_step.py), and the activations really are bf16.

Tolerances. bf16 keeps 8 significant bits: one rounding moves a value by up to
2^-9 ~ 2e-3 of itself. Sharded layouts split each matmul's sum into partial sums that
are rounded to bf16 before the collective adds them (one or two more roundings than
`single`), so a grad element moves by a few such steps of the largest element:
measured 0.6-0.8% of max|grad| per tensor on fsdp4xtp2, dp2xfsdp2xtp2 (sequence) and
tp8; bound GRAD_RTOL = 2e-2 (~5 bf16 steps). The loss is a mean over 128 tokens, so
the per-element roundings average out: measured <= 7e-6 relative between layouts,
3e-5 against f32; bounds 1e-4 and 1e-3. A wrong collective or a missed shard moves
these by O(1)."""
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest
from test_step import CFG, assert_tree_close, host, tokens, trainer

from engine.config import ParallelConfig, model_config
from engine.cost.ledger import scan_counts

BF16 = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="bf16",
                    activations="bf16")
GRAD_RTOL = 2e-2
LOSS_RTOL = 1e-4


def loss_and_grads(layout, cfg=BF16, parallel=ParallelConfig()):
    t = trainer(layout, cfg, parallel)
    params, _ = t.init(0)
    loss, grads, gnorm = t.loss_and_grads(params, t.put_batch(tokens()))
    return float(loss), host(grads), float(gnorm)


@pytest.fixture(scope="module")
def single_bf16():
    return loss_and_grads("single")


def test_single_bf16_activations_stay_close_to_f32(single_bf16):
    loss, grads, gnorm = loss_and_grads("single", CFG)
    assert abs(single_bf16[0] - loss) <= 1e-3 * loss
    assert_tree_close(single_bf16[1], grads, rtol=GRAD_RTOL, what="bf16 activations vs f32 ")
    assert abs(single_bf16[2] - gnorm) <= 1e-2 * gnorm


@pytest.mark.parametrize("layout,tp_comm", [("fsdp4xtp2", "allreduce"),
                                            ("dp2xfsdp2xtp2", "sequence")])
def test_layout_matches_single_in_bf16_activations(layout, tp_comm, single_bf16):
    loss, grads, gnorm = loss_and_grads(layout, parallel=ParallelConfig(tp_comm=tp_comm))
    assert abs(loss - single_bf16[0]) <= LOSS_RTOL * single_bf16[0]
    assert_tree_close(grads, single_bf16[1], rtol=GRAD_RTOL, what=f"{layout} grads ")
    assert abs(gnorm - single_bf16[2]) <= 1e-3 * single_bf16[2]


@pytest.mark.parametrize("zero", [3, 2])
def test_grads_reduced_in_f32_match_single(zero, single_bf16):
    """`grad_reduce="f32"`: the weights still gathered in bf16, the fsdp reduce-scatters
    of their grads (every one: blocks, unembed) run in f32 instead of bf16, so the grads
    lose the rounding of the reduced sum: within the bf16 bound of `single` (measured
    0.38% of max|grad| per tensor on fsdp8 against 0.56% with bf16 reduces)."""
    from test_step import TCFG

    from engine.cost.ledger import step_ledger
    from engine.parallel.layout import Layout

    parallel = ParallelConfig(zero=zero, grad_reduce="f32")
    loss, grads, gnorm = loss_and_grads("fsdp8", parallel=parallel)
    assert abs(loss - single_bf16[0]) <= LOSS_RTOL * single_bf16[0]
    assert_tree_close(grads, single_bf16[1], rtol=GRAD_RTOL, what=f"zero {zero} f32 reduce ")
    assert abs(gnorm - single_bf16[2]) <= 1e-3 * single_bf16[2]

    def reduce_dtypes(par):
        return {(r.scope, r.dtype) for r in step_ledger(BF16, TCFG, Layout.parse("fsdp8"), par)
                if r.primitive == "reduce_scatter" and r.axes == ("fsdp",)}

    # the embedding is gathered in f32 (its rows are looked up, not multiplied) either way
    assert {d for _, d in reduce_dtypes(parallel)} == {"float32"}
    assert ("gather_params", "bfloat16") in reduce_dtypes(ParallelConfig(zero=zero))


@pytest.mark.slow
@pytest.mark.parametrize("layout,parallel", [
    ("pp2xfsdp4", ParallelConfig(microbatches=2, pp_schedule="1f1b")),
    ("cp2xfsdp2xtp2", ParallelConfig(cp_comm="ring", tp_comm="ring")),
])
def test_pp_and_rings_match_single_in_bf16_activations(layout, parallel, single_bf16):
    loss, grads, gnorm = loss_and_grads(layout, parallel=parallel)
    assert abs(loss - single_bf16[0]) <= LOSS_RTOL * single_bf16[0]
    assert_tree_close(grads, single_bf16[1], rtol=GRAD_RTOL, what=f"{layout} grads ")


def _scan_carries(jaxpr):
    """The avals of every scan's carry, in `jaxpr` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield [v.aval for v in eqn.outvars[:scan_counts(eqn)[1]]]
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _scan_carries(sub)


@pytest.mark.parametrize("acts,want", [("bf16", jnp.bfloat16), ("f32", jnp.float32)])
def test_residual_stream_is_in_the_activation_dtype(acts, want):
    """The scan over layers carries the residual stream [B, L, D] in the activation dtype
    (what remat `full` saves per layer)."""
    cfg = model_config("tiny", dtype="bf16", activations=acts)
    t = trainer("fsdp8", cfg)
    params, _ = t.init(0)
    closed = jax.make_jaxpr(t.loss_and_grads)(params, t.put_batch(tokens()))
    B, L, D = tokens().shape[0] // 8, tokens().shape[1] - 1, cfg.d_model
    streams = [a for carry in _scan_carries(closed.jaxpr) for a in carry
               if a.shape == (B, L, D)]
    assert streams and all(a.dtype == want for a in streams), streams
