"""The overlap model of engine/cost/price.py on hand-made ledger rows: which collectives
hide under the blocks' compute, what a hidden one still costs where compute slows
beside it, and that the step is compute + exposed communication."""
from __future__ import annotations

import dataclasses

import pytest

from engine.cost import calibration, hardware
from engine.cost.ledger import Row
from engine.cost.price import collective_seconds, compute_seconds, predict

MESH = (("fsdp", 8),)


def matmul(scope: str, flops: float) -> Row:
    return Row(scope, "bwd", "matmul", "dot_general", "bfloat16", (1,), flops, 0.0, 1)


def gather(scope: str, phase: str, nbytes: float) -> Row:
    return Row(scope, phase, "collective", "all_gather", "bfloat16", (1,), 0.0, nbytes, 1,
               axes=("fsdp",), axis_size=8)


def profile(slowdown: float):
    return dataclasses.replace(hardware.get("h100"), overlap_slowdown=slowdown)


def seconds(rows, hw):
    comp = sum(compute_seconds(r, hw, 8)[0] for r in rows if r.kind != "collective")
    comm = [collective_seconds(r, hw, MESH) for r in rows if r.kind == "collective"]
    return comp, comm


@pytest.mark.parametrize("slowdown", [0.0, 0.189, 0.4])
def test_a_hidden_collective_costs_the_slowdown_of_the_compute_under_it(slowdown):
    hw = profile(slowdown)
    rows = [matmul("mlp", 1e14), gather("gather_params", "bwd", 1e9)]
    comp, (comm,) = seconds(rows, hw)
    assert comm < comp  # fully hidden
    pred = predict(rows, hw, MESH)
    assert pred.exposed_comm_s == pytest.approx(comm * slowdown / (1 + slowdown))
    assert pred.step_s == pytest.approx(comp + pred.exposed_comm_s)
    # the compute it hides under runs 1 + s times as long: the step is the compute alone
    # plus what the collective's span adds, comm (1 - 1 / (1 + s))
    assert pred.step_s == pytest.approx(comp - comm / (1 + slowdown) + comm)


def test_a_collective_beyond_the_blocks_compute_is_exposed_past_it():
    s = 0.189
    hw = profile(s)
    rows = [matmul("mlp", 1e12), gather("gather_params", "bwd", 4e10)]
    comp, (comm,) = seconds(rows, hw)
    hidden = comp / comm
    assert hidden < 1
    pred = predict(rows, hw, MESH)
    assert pred.exposed_comm_s == pytest.approx(comm * (1 - hidden + hidden * s / (1 + s)))


def test_collectives_between_dependent_computations_are_exposed_whole():
    hw = profile(0.189)
    # a forward weight gather without prefetch feeds the next matmul; an mlp all-gather
    # (sequence parallelism) sits between two of the layer's computations
    for row in (gather("gather_params", "fwd", 1e9), gather("mlp", "bwd", 1e9)):
        rows = [matmul("mlp", 1e14), row]
        comp, (comm,) = seconds(rows, hw)
        pred = predict(rows, hw, MESH)
        assert pred.exposed_comm_s == pytest.approx(comm)
        assert pred.step_s == pytest.approx(comp + comm)
    # with prefetch the forward gather hides too
    rows = [matmul("mlp", 1e14), gather("gather_params", "fwd", 1e9)]
    _, (comm,) = seconds(rows, hw)
    assert predict(rows, hw, MESH, prefetch=True).exposed_comm_s == pytest.approx(
        comm * 0.189 / 1.189)


def test_profiles_slowdown_and_the_cpu_exposes_everything():
    for name in ("a100", "h100", "h100-gt"):
        assert hardware.get(name).overlap_slowdown == 0.189
    for name in ("v4", "v5e", "v5p"):
        assert hardware.get(name).overlap_slowdown == 0.0
    cpu = dataclasses.replace(calibration.cpu_defaults(), beside_cost=0.0)
    rows = [matmul("mlp", 1e10), gather("gather_params", "bwd", 1e6)]
    _, (comm,) = seconds(rows, cpu)
    assert predict(rows, cpu, MESH).exposed_comm_s == pytest.approx(comm)


@pytest.mark.parametrize("beside", [0.0, 0.88, 1.5])
def test_on_a_shared_host_what_would_hide_is_exposed_and_contends_with_the_compute(beside):
    """The cpu profile hides nothing: a collective an accelerator would run under the
    blocks' compute (a backward reduce-scatter; with prefetch, the forward gathers too)
    runs beside it on the same cores and costs 1 + beside_cost times its own time; one
    between dependent computations (a forward gather without prefetch, a tp
    all-reduce) costs its own time. The compute is priced as it was."""
    cpu = dataclasses.replace(calibration.cpu_defaults(), beside_cost=beside)
    rows = [matmul("mlp", 1e10), gather("gather_params", "bwd", 1e6),
            gather("gather_params", "fwd", 1e6), gather("attention", "fwd", 1e6)]
    comp, (bwd, fwd, tp) = seconds(rows, cpu)
    plain = predict(rows, cpu, MESH)
    ahead = predict(rows, cpu, MESH, prefetch=True)
    assert plain.compute_s == ahead.compute_s == pytest.approx(comp)
    assert plain.exposed_comm_s == pytest.approx((1 + beside) * bwd + fwd + tp)
    assert ahead.exposed_comm_s == pytest.approx((1 + beside) * (bwd + fwd) + tp)
    assert ahead.step_s == pytest.approx(comp + ahead.exposed_comm_s)
    assert calibration.cpu_defaults().beside_cost == calibration.CPU_DEFAULTS["beside_cost"]
