"""Measured time per compiled op (engine/cost/trace.py `op_seconds`) and the table of the
ops that took the most (engine/cost/report.py `op_table`, `bench/roofline.py --top-ops`)."""
import jax
import jax.numpy as jnp
import pytest

from engine.cost import report, trace
from engine.cost.trace import OpInfo

INFO = {"dot.1": OpInfo("matmul", "mlp", "fwd"),
        "fusion.2": OpInfo("memory", "mlp", "bwd"),
        "all-gather.3": OpInfo("collective", "gather_params", "fwd", ("all-gather", ("fsdp",))),
        "while.4": OpInfo("container", "other", "fwd")}
# (op, device, start ns, duration ns): 2 devices, 2 traced steps
EVENTS = [(op, dev, 1000 * i, dur) for i, (op, dev, dur) in enumerate(
    [(op, dev, d) for _ in range(2) for dev in (0, 1)
     for op, d in (("dot.1", 600 + 100 * dev), ("fusion.2", 200), ("fusion.2", 100),
                   ("all-gather.3", 50 + 250 * dev), ("while.4", 5000))])]


def test_op_seconds_split_the_step_as_the_categories_do():
    """Each op gets the step's share of its summed durations: the ops add up to the step,
    as `attribute`'s categories do (a collective's transfer and wait together), the
    `while` that spans its body's ops is left out, and runs count executions per step on
    one device."""
    step_s = 0.5
    ops = trace.op_seconds(EVENTS, INFO, step_s, steps=2)
    cats = trace.attribute(EVENTS, INFO, step_s, steps=2)
    assert "while.4" not in ops
    assert sum(s for s, _ in ops.values()) == pytest.approx(step_s)
    assert sum(cats.values()) == pytest.approx(step_s)
    total = 2 * (600 + 700 + 2 * 300 + 50 + 300)
    assert ops["dot.1"][0] == pytest.approx(step_s * 2 * 1300 / total)
    assert ops["fusion.2"] == (pytest.approx(step_s * 2 * 600 / total), 2.0)
    assert ops["dot.1"][1] == 1.0
    gather = [s for (kind, *_), s in cats.items() if kind in ("collective", "collective wait")]
    assert ops["all-gather.3"][0] == pytest.approx(sum(gather))


def test_op_table_names_what_a_fusion_computes_and_ranks_by_time():
    """On a compiled module of this host: the fusion that exponentiates and transposes
    lists both (the plumbing of parameters and bitcasts left out), rows come slowest
    first, the top N only, and the shares are of the ops' total."""
    x = jnp.ones((64, 128))
    text = jax.jit(lambda x: (jnp.exp(x) * 2).T + 1).lower(x).compile().as_text()
    from engine.cost import hlo

    entry = hlo.parse(text)
    fusions = [i for i in entry.computations[entry.entry] if i.callee]
    assert fusions
    op_s = {i.name: (0.1 * (k + 1), 1.0) for k, i in enumerate(fusions)}
    op_s["not-in-module"] = (0.001, 1.0)
    rows = report.op_table(op_s, {}, text, top=len(fusions))
    assert [r[0] for r in rows] == [i.name for i in reversed(fusions)]
    computes = ",".join(r[6] for r in rows).split(",")
    assert {"exponential", "transpose"} <= set(computes)
    assert not set(computes) & report.PLUMBING
    total = sum(s for s, _ in op_s.values())
    assert [r[8] for r in rows] == pytest.approx([r[7] / total for r in rows])
    assert len(report.op_table(op_s, {}, text, top=1)) == 1
    assert "HLO op" in report.format_ops(rows)


UNNAMED = """HloModule m, entry_computation_layout={(f32[4,4]{1,0})->f32[4,4]{1,0}}

%fused_computation (param_0: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  ROOT %copy.1 = f32[4,4]{1,0} copy(%param_0)
}

ENTRY %main (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %exp.1 = f32[4,4]{1,0} exponential(%p), metadata={op_name="jit(step)/jvp()/attention/exp"}
  %copy_fusion = f32[4,4]{1,0} fusion(%exp.1), kind=kLoop, calls=%fused_computation
  %dot.2 = f32[4,4]{1,0} dot(%copy_fusion, %copy_fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %neg.3 = f32[4,4]{1,0} negate(%dot.2), metadata={op_name="jit(step)/transpose(jvp())/mlp/neg"}
  %dot.4 = f32[4,4]{1,0} dot(%copy_fusion, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %constant.5 = f32[] constant(1)
  %copy.7 = f32[4,4]{1,0} copy(%exp.1)
  %tuple.8 = (f32[4,4]{1,0}) tuple(%copy.7)
  ROOT %add.6 = f32[4,4]{1,0} add(%neg.3, %dot.4), metadata={op_name="jit(step)/jvp()/loss/add"}
}
"""


def test_ops_without_a_name_stack_take_their_neighbours():
    """A matmul or an op feeding one that XLA left without metadata is scoped as the
    first named op it feeds, else the first named op it reads, through chains of
    unnamed ops; other unnamed ops stay `other`."""
    info = trace.classify(UNNAMED, {})
    assert info["exp.1"] == OpInfo("memory", "attention", "fwd")
    assert info["dot.2"] == OpInfo("matmul", "mlp", "bwd")        # feeds neg.3
    assert info["copy_fusion"] == OpInfo("memory", "mlp", "bwd")  # feeds dot.2, dot.4
    assert info["dot.4"] == OpInfo("matmul", "loss", "fwd")       # feeds add.6
    assert info["constant.5"] == OpInfo("memory", "other", "fwd")  # no neighbours
    assert info["neg.3"].scope == "mlp" and info["add.6"].scope == "loss"
    assert info["copy.7"].scope == "other"  # unnamed, feeds no matmul: not inherited
