"""What a pipelined step's tick scan spends beside the units' math, read off the traced
step (per device, as shard_map traces it): an interleaved unit adds its grads into its
chunk's rows of the accumulator, not a stage-sized tensor into the whole stage; and
(compared with `single`) the interleaved step under ZeRO-2's resident weights."""
import jax.numpy as jnp
import pytest

from engine.cli.args import build_parser, parse_or_exit
from engine.cost.ledger import trace_step
from engine.parallel import pipeline
from test_cost_pp_stash import _args, _tick_scan
from test_pp import assert_matches, init, loss_and_grads, single  # noqa: F401  (fixtures)


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in eqn.params.values():
            for one in sub if isinstance(sub, (tuple, list)) else (sub,):
                inner = getattr(one, "jaxpr", one)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def f32_add_shapes(layout: str, schedule: str, zero: int, virtual: int) -> set[tuple]:
    """The shapes of the f32 adds the tick scan runs (grads accumulated, losses)."""
    cfg, tcfg, parallel, lay, _ = parse_or_exit(_args(layout, schedule, zero, virtual),
                                                build_parser())
    plan = pipeline.step_plan(lay, parallel)
    scan = _tick_scan(trace_step(cfg, tcfg, lay, parallel).jaxpr, plan.ticks)
    return {tuple(e.outvars[0].aval.shape) for e in _eqns(scan.params["jaxpr"].jaxpr)
            if e.primitive.name == "add" and e.outvars[0].aval.dtype == jnp.float32}


@pytest.mark.parametrize("layout, zero", [("pp2xtp2", 3), ("pp2xfsdp2", 2)])
def test_an_interleaved_unit_adds_its_grads_into_its_chunk_only(layout, zero):
    """8 layers, pp 2, V 2: a stage stacks 4 layers, a chunk 2. Every stacked block
    grad the units add is a chunk's [2, ...] (no [4, ...] add: the whole stage's
    zero-filled cotangent into the whole accumulator), as 1f1b's units add their
    stage's [4, ...]."""
    rows = lambda shapes: {s[0] for s in shapes if len(s) >= 3}  # noqa: E731  stacked weights
    interleaved = rows(f32_add_shapes(layout, "interleaved", zero, 2))
    assert 2 in interleaved and 4 not in interleaved, interleaved
    assert 4 in rows(f32_add_shapes(layout, "1f1b", zero, 1))


@pytest.mark.parametrize("zero", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_interleaved_under_resident_weights_matches_single(zero, init, single):
    """Under ZeRO-1/2 the stored whole weights a unit reads are its chunk's rows, sliced
    outside the unit's vjp beside the differentiated shards: loss, grads (model order)
    and grad norm equal `single`."""
    got = loss_and_grads("pp2xfsdp4", init, microbatches=2, pp_schedule="interleaved",
                         pp_virtual=2, zero=zero)
    assert_matches(got, single, f"pp2xfsdp4 interleaved V=2 zero {zero}")
