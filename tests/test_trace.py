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
