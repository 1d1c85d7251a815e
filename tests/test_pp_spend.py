"""What a pipelined step's tick scan spends beside the units' math, read off the traced
step (per device, as shard_map traces it): an interleaved unit adds its grads into its
chunk's rows of the accumulator, not a stage-sized tensor into the whole stage; and
(compared with `single`) the interleaved step under ZeRO-2's resident weights."""
import jax.numpy as jnp
import pytest

from engine.cli.args import build_parser, parse_or_exit
from engine.cost import memory
from engine.cost.ledger import trace_step
from engine.parallel import pipeline
from engine.parallel.backward_split import scan_counts
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


def _step(layout: str, schedule: str, zero: int, virtual: int):
    """(the traced step's jaxpr, its tick scan's equation)."""
    cfg, tcfg, parallel, lay, _ = parse_or_exit(_args(layout, schedule, zero, virtual),
                                                build_parser())
    jaxpr = trace_step(cfg, tcfg, lay, parallel).jaxpr
    return jaxpr, _tick_scan(jaxpr, pipeline.step_plan(lay, parallel).ticks)


def f32_add_shapes(layout: str, schedule: str, zero: int, virtual: int) -> set[tuple]:
    """The shapes of the f32 adds the tick scan runs (grads accumulated, losses)."""
    _, scan = _step(layout, schedule, zero, virtual)
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


def reduce_scatter_shapes(eqns) -> list[tuple]:
    return sorted(tuple(e.invars[0].aval.shape) for e in eqns
                  if e.primitive.name == "reduce_scatter")


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved", 2),
                                               pytest.param("zb1", 1, marks=pytest.mark.slow)])
def test_zero2_reduce_scatters_the_embedding_grads_once_a_step(schedule, virtual):
    """pp2xfsdp2 under ZeRO-2, 8 microbatches (V 4096, D 64): no unit reduce-scatters
    the embedding's [4096, 64] or the unembedding's [64, 4096] grad (before: every
    backward unit, on every stage); the step reduce-scatters each once, after the ticks.
    The layers' weights still reduce-scatter in the units (per layer, as the
    un-pipelined step does)."""
    jaxpr, scan = _step("pp2xfsdp2", schedule, 2, virtual)
    inside = reduce_scatter_shapes(_eqns(scan.params["jaxpr"].jaxpr))
    everywhere = reduce_scatter_shapes(_eqns(jaxpr))
    heads = [(64, 4096), (4096, 64)]
    assert inside and not set(heads) & set(inside), inside
    assert [s for s in everywhere if s in heads] == heads, everywhere


def test_zero2_accumulates_the_embedding_grads_whole_as_the_memory_model_holds_them():
    """The tick scan carries the embedding's and unembedding's grads whole over fsdp
    (f32 [4096, 64] and [64, 4096]; before: their fsdp halves), which the memory model
    adds to the stage's sharded grads as `whole_head_grads`: the other half of each."""
    cfg, tcfg, parallel, lay, _ = parse_or_exit(_args("pp2xfsdp2", "1f1b", 2), build_parser())
    _, scan = _step("pp2xfsdp2", "1f1b", 2, 1)
    first, n_carry = scan_counts(scan)
    carries = scan.invars[first:first + n_carry]
    whole = [v.aval.size * 4 for v in carries if v.aval.dtype == jnp.float32
             and tuple(v.aval.shape) in ((64, 4096), (4096, 64))]
    assert len(whole) == 2, [v.aval for v in carries]
    stage = memory.stage_problem(cfg, tcfg, lay, parallel)
    assert memory.whole_head_grads(*stage) == sum(whole) // 2


@pytest.mark.slow  # ~10 s; the default suite traces this path (test_cost_pp_stash)
@pytest.mark.parametrize("zero", [2, 1])
def test_interleaved_under_resident_weights_matches_single(zero, init, single):
    """Under ZeRO-1/2 the stored whole weights a unit reads are its chunk's rows, sliced
    outside the unit's vjp beside the differentiated shards: loss, grads (model order)
    and grad norm equal `single`."""
    got = loss_and_grads("pp2xfsdp4", init, microbatches=2, pp_schedule="interleaved",
                         pp_virtual=2, zero=zero)
    assert_matches(got, single, f"pp2xfsdp4 interleaved V=2 zero {zero}")


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb1", 1)])
def test_a_unit_is_traced_once_for_its_stash_and_its_ticks(schedule, virtual, monkeypatch):
    """The stash's shapes, which residuals the backward rebuilds, the rebuild itself and
    every tick's forward come from one trace of the unit's forward vjp
    (`Units.trace_stash`): one trace of a unit a step (two before the ticks' forwards
    ran from it, four before the rebuild did)."""
    from engine.parallel import pipeline_units

    calls, unit = [], pipeline_units.Units.unit
    monkeypatch.setattr(pipeline_units.Units, "unit",
                        lambda self, *a, **k: calls.append(1) or unit(self, *a, **k))
    args = [*_args("pp2xfsdp2", schedule, 1, virtual)]
    args[args.index("--remat") + 1] = "none"  # the units stash their vjp residuals
    cfg, tcfg, parallel, lay, _ = parse_or_exit(args, build_parser())
    assert pipeline.stash_residuals(lay, parallel)
    trace_step(cfg, tcfg, lay, parallel)
    assert len(calls) == 1
