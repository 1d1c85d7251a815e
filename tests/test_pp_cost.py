"""Pipeline parallelism's cost and memory model: the pp step priced tick by tick along its
schedule's table (engine/cost/pipeline.py), the FLOPs it executes under each remat
policy, and the memory model's stash (engine/cost/memory.py `pipelined`) against the
compiler's."""
import dataclasses

import pytest
from test_pp import PP_CFG, TCFG

from engine.config import ParallelConfig
from engine.parallel import pipeline
from engine.parallel.layout import Layout
from engine.run.step import Trainer


@pytest.mark.parametrize("layout, parallel", [
    ("pp2xfsdp4", ParallelConfig(microbatches=2)),
    ("pp4xtp2", ParallelConfig(microbatches=4, pp_schedule="gpipe")),
    ("pp2xfsdp4", ParallelConfig(microbatches=2, pp_schedule="interleaved", pp_virtual=2)),
    ("pp2xfsdp4", ParallelConfig(microbatches=2, pp_schedule="zb1")),
])
def test_the_pp_step_runs_no_forward_twice(layout, parallel):
    """The matmul FLOPs the pp step executes (each stage's forward and backward units M·V
    times, read off the traced step's rows, engine/cost/pipeline.py `unit_rows`) equal
    the same step's without pp under every remat policy: the backward applies the
    stashed residuals and recomputes only what the policy does without pp (under full,
    each layer once from its stashed input; with the stage's input stashed instead, the
    backward's `jax.vjp` would run the stage's forward again). zb1's B and W units
    together execute what one backward unit does (W recomputes nothing of B)."""
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import UNITS, _once, unit_rows
    from layers import scopes

    lay = Layout.parse(layout)
    pp = lay.degree("pp")
    others = lay.size // pp
    tp = lay.degree("tp")  # kept: remat alternate saves wo's output only where it crosses tp
    flat = Layout.parse(f"fsdp{lay.size // tp}" + (f"xtp{tp}" if tp > 1 else ""))
    matmul = lambda rows: sum(r.flops * r.count for r in rows if r.kind == "matmul")  # noqa: E731
    for remat in ("none", "dots", "alternate", "full"):
        cfg = dataclasses.replace(PP_CFG, remat=remat)
        rows = step_ledger(cfg, TCFG, lay, parallel)
        the_plan = pipeline.step_plan(lay, parallel)
        ticks = _once([r for r in rows if scopes.PP_TICK in r.pp])
        edges = {scopes.PP_FIRST, scopes.PP_LAST}  # once per microbatch, not per chunk
        units = [unit_rows(ticks, k, s, pp) for k in UNITS for s in range(pp)]
        body = sum(matmul([r for r in u if not edges & set(r.pp)]) for u in units)
        edge = sum(matmul([r for r in u if edges & set(r.pp)]) for u in units)
        outside = matmul([r for r in rows if scopes.PP_TICK not in r.pp])
        M = parallel.microbatches
        executed = (the_plan.units * body + M * edge) * others + outside * lay.size
        without = matmul(step_ledger(cfg, TCFG, flat, ParallelConfig())) * lay.size
        assert executed == pytest.approx(without, rel=1e-12), remat


def test_pullback_rows_priced_once_in_the_backward_unit():
    """Under remat none the backward applies the pullback the forward unit traced. A
    transpose row made there would carry both units' scopes (ZeRO-2's embedding and
    unembedding reduce-scatters did, when `seen` made them whole inside the unit;
    `seen`'s transpose now runs after the ticks): the forward unit prices no "bwd" row,
    and the units' rows together are the tick's unit rows once each."""
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import BACKWARD, FORWARD, UNITS, _once, unit_rows
    from layers import scopes

    cfg = dataclasses.replace(PP_CFG, remat="none")
    rows = step_ledger(cfg, TCFG, Layout.parse("pp2xfsdp4"),
                       ParallelConfig(microbatches=2, zero=2))
    ticks = _once([r for r in rows if scopes.PP_TICK in r.pp])
    both = [r for r in ticks if {UNITS[FORWARD], UNITS[BACKWARD]} <= set(r.pp)]
    assert all(r.scope not in ("embed", "loss") or r.kind != "collective" for r in both)
    for stage in range(2):
        fwd = unit_rows(ticks, FORWARD, stage, 2, uniform=True)
        bwd = unit_rows(ticks, BACKWARD, stage, 2, uniform=True)
        assert not [r for r in fwd if r.phase == "bwd"]
        assert all(any(r is b for b in bwd) for r in both)
        in_units = [r for r in ticks if set(UNITS.values()) & set(r.pp)]
        assert len(fwd) + len(bwd) == len(in_units)



@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_zb1_rows_keep_the_layers_scopes_and_phases(remat):
    """zb1's B and W units (the backward's jaxpr cut and bound again,
    engine/parallel/backward_split.py) run the equations 1f1b's backward unit runs, and
    their rows keep the scopes and phases the cost model prices them by: the FLOPs per
    (scope, phase, kind, kernel) of the units' rows equal 1f1b's, the flash kernel's
    backward ("attention" rows under blocked attention) and the per-layer recompute
    included. Exact: the same equations on the same shapes. Scalar rows are left out:
    the item's index arithmetic, which W computes again for itself; so are the rows in
    no scope (the stash's and the head slots' reads and writes, which differ: 1f1b keeps
    the head's residuals in slots of their own, zb1 in its stash)."""
    import collections

    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import _once, unit_of
    from layers import scopes

    cfg = dataclasses.replace(PP_CFG, remat=remat, attention="blocked")
    tcfg = dataclasses.replace(TCFG, seq=32)  # two key blocks of blocked attention

    def flops(schedule):
        rows = step_ledger(cfg, tcfg, Layout.parse("pp2xfsdp4"),
                           ParallelConfig(microbatches=2, pp_schedule=schedule))
        by = collections.Counter()
        for r in _once([r for r in rows if scopes.PP_TICK in r.pp]):
            if unit_of(r) is not None and r.shape and r.scope != "other":
                by[r.scope, r.phase, r.kind, r.kernel] += r.flops * r.count
        return {k: v for k, v in by.items() if v}

    want = flops("1f1b")
    assert ("attention", "bwd", "attention", "") in want  # the kernel's backward is traced
    assert flops("zb1") == want


# -- the cost model -----------------------------------------------------------------------
def _unit_row(unit, flops, ticks):
    from engine.cost.ledger import Row
    from layers import scopes

    pp = (scopes.PP_TICK,) + ((unit,) if unit else ())
    return Row("mlp", "fwd", "matmul", "dot_general", "bfloat16", (1,), flops, 0.0, ticks,
               pp=pp)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_price_is_ticks_of_the_slowest_stage(name, v, pp):
    """Rows of one forward unit, one backward unit (1 or 2x the forward's FLOPs) and a
    tick's own row, priced along the table: the step is the sum over ticks of the slowest
    stage's work (its forward and its backward slot) plus the tick's row. GPipe's ticks
    are all forwards or all backwards and 1F1B's steady ticks a forward and a backward
    on every stage, so every schedule takes (V·M + p - 1)(F + B) and idles
    (p-1)/(V·M+p-1) of a stage's time, whatever B / F. On a shared host idle slots cost
    no time, V·M (F + B), though a stage waits as long."""
    from engine.cost import calibration, hardware
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predict
    from layers import scopes

    h100, mesh = hardware.get("h100"), (("pp", pp),)
    for m in (pp, 2 * pp, 4 * pp):
        the_plan = pipeline.plan(pipeline.SCHEDULES[name], pp, m, virtual=v)
        T, formula = the_plan.ticks, (pp - 1) / (v * m + pp - 1)
        for ratio in (1, 2):
            rows = [_unit_row(scopes.PP_FORWARD, 1e12, T),
                    _unit_row(scopes.PP_BACKWARD, ratio * 1e12, T), _unit_row(None, 1e9, T)]
            one = lambda r: predict([dataclasses.replace(r, count=1)], h100, mesh).step_s
            F, B, tick = (one(r) for r in rows)
            got = predict_pipeline(rows, h100, mesh, the_plan)
            assert got.schedule_bubble == pytest.approx(formula)
            on_f, on_b = (the_plan.forward_TP != pipeline.NONE), (the_plan.backward_TP
                                                                  != pipeline.NONE)
            units = (on_f * F + on_b * B).max(axis=1).sum()
            assert got.step_s == pytest.approx(units + T * tick)
            assert units == pytest.approx((v * m + pp - 1) * (F + B))
            assert got.bubble == pytest.approx(formula)
            cpu = calibration.cpu_defaults()
            F, B, tick = (predict([dataclasses.replace(r, count=1)], cpu, mesh).step_s
                          for r in rows)
            shared = predict_pipeline(rows, cpu, mesh, the_plan)
            assert shared.step_s == pytest.approx(v * m * (F + B) + T * tick)
            assert shared.bubble == pytest.approx(formula)  # the devices still wait


def _shift_row(ticks, nbytes, pp):
    from engine.cost.ledger import Row
    from layers import scopes

    return Row("other", "fwd", "collective", "ppermute", "float32", (nbytes // 4,), 0.0,
               float(nbytes), ticks, ("pp",), pp, pp=(scopes.PP_TICK,))


@pytest.mark.parametrize("pp", [2, 4])
def test_zb1_price_is_its_ticks_slowest_stage_and_beats_1f1b_with_balanced_units(pp):
    """zb1 priced from rows of a forward, a B and a W unit: each tick costs its slowest
    stage's units plus the tick's row, and each of its two shifts (the activation's,
    the cotangent's: the tick's ppermutes in that order) only on the ticks where some
    stage sends one (`Plan.send_x_T`, `send_ct_T`): the last ticks' Ws move nothing.
    With F = B = W the units take (M + p - 1)(F + B + W) - (p - 1)W, below 1F1B's
    (M + p - 1)(F + B + W) at every M."""
    from engine.cost import hardware
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predict
    from layers import scopes

    h100, mesh = hardware.get("h100"), (("pp", pp),)
    for m in (pp, 2 * pp, 4 * pp):
        zb1 = pipeline.plan(pipeline.SCHEDULES["zb1"], pp, m)
        one_f_one_b = pipeline.plan(pipeline.SCHEDULES["1f1b"], pp, m)
        T = zb1.ticks
        rows = [_unit_row(scopes.PP_FORWARD, 1e12, T), _unit_row(scopes.PP_BACKWARD, 1e12, T),
                _unit_row(scopes.PP_WEIGHT, 1e12, T), _unit_row(None, 1e9, T),
                _shift_row(T, 2 ** 20, pp), _shift_row(T, 2 ** 24, pp)]
        F, B, W, tick, x, ct = (predict([dataclasses.replace(r, count=1)], h100, mesh).step_s
                                for r in rows)
        got = predict_pipeline(rows, h100, mesh, zb1)
        units = ((zb1.forward_TP != pipeline.NONE) * F + (zb1.backward_TP != pipeline.NONE) * B
                 + (zb1.weight_TP != pipeline.NONE) * W).max(axis=1).sum()
        assert zb1.send_x_T.sum() + zb1.send_ct_T.sum() < 2 * T  # ticks that send nothing
        # the x shift partly hides under the tick's B slot (accelerators' async collectives)
        assert 0 <= got.hidden_shift_s <= zb1.send_x_T.sum() * x
        assert got.step_s == pytest.approx(units + T * tick + zb1.send_x_T.sum() * x
                                           + zb1.send_ct_T.sum() * ct - got.hidden_shift_s)
        assert units == pytest.approx((3 * (m + pp - 1) - (pp - 1)) * F)
        assert units < one_f_one_b.ticks * (F + B + W)
        assert got.bubble == pytest.approx(zb1.bubble(1.0, 2.0, 1.0))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_pipeline_price_runs_every_kind_of_unit_its_tick_holds(name):
    """A uniform plan: every stage runs the tick's units (first- and last-stage parts
    included), so a tick costs F, B, or F + B when some stage's forward slot and some
    stage's backward slot are full, on an accelerator and on a shared host alike: both
    schedules take (M + p - 1)(F + B)."""
    from engine.cost import calibration, hardware
    from engine.cost.ledger import Row
    from engine.cost.pipeline import predict_pipeline
    from engine.cost.price import predict
    from layers import scopes

    pp, m = 4, 8
    the_plan = pipeline.plan(pipeline.SCHEDULES[name], pp, m, uniform=True)
    T = the_plan.ticks
    head = Row("loss", "fwd", "matmul", "dot_general", "bfloat16", (1,), 3e11, 0.0, T,
               pp=(scopes.PP_TICK, scopes.PP_BACKWARD, scopes.PP_LAST))
    rows = [_unit_row(scopes.PP_FORWARD, 1e12, T), _unit_row(scopes.PP_BACKWARD, 2e12, T),
            head, _unit_row(None, 1e9, T)]
    for hw in (hardware.get("h100"), calibration.cpu_defaults()):
        one = lambda rs: predict([dataclasses.replace(r, count=1) for r in rs], hw,  # noqa: E731
                                 (("pp", pp),)).step_s
        F, B, tick = one(rows[:1]), one(rows[1:3]), one(rows[3:])
        got = predict_pipeline(rows, hw, (("pp", pp),), the_plan)
        want = (F * the_plan.any_forward_T + B * the_plan.any_backward_T).sum()
        assert got.step_s == pytest.approx(want + T * tick)
        assert want == pytest.approx((m + pp - 1) * (F + B))


@pytest.mark.parametrize("layout", ["pp2xfsdp4", "pp4xfsdp2"])
def test_traced_pipeline_price_follows_the_bubble(layout):
    """The traced step (AbstractMesh, no compile) priced on an H100 along GPipe's table
    for M = p, 2p, 4p: the pipeline's part is the sum over ticks of the slowest active
    stage's unit, (M + p - 1) x (forward + backward) up to the stages' imbalance (the
    first embeds, the last takes the loss); the bubble falls with M, from the formula's
    (p-1)/(M+p-1) up to what the imbalance adds; the step is below the ledger's upper
    bound (every branch on every tick)."""
    from engine.cost import hardware
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.cost.price import predict

    lay, h100 = Layout.parse(layout), hardware.get("h100")
    pp = lay.degree("pp")
    tcfg, bubbles = dataclasses.replace(TCFG, batch=32), [1.0]
    for m in (pp, 2 * pp, 4 * pp):
        par = ParallelConfig(microbatches=m, pp_schedule="gpipe")
        rows = step_ledger(PP_CFG, tcfg, lay, par)
        pred, pipe = predict_step(rows, h100, lay, par)
        fwd, bwd = pipe.unit_s[0], pipe.unit_s[1]
        assert (fwd > 0).all() and (bwd > fwd).all() and bwd[-1] > bwd[0]  # the loss
        units = (pred.step_s - pipe.outside_s - pipe.shift_T.sum()
                 + pipe.hidden_shift_s)  # the forward shifts under backward slots
        the_plan = pipeline.plan(pipeline.SCHEDULES["gpipe"], pp, m)
        assert units == pytest.approx(the_plan.lockstep_T(fwd, bwd).sum())
        assert ((m + pp - 1) * (fwd.min() + bwd.min()) <= units
                <= (m + pp - 1) * (fwd.max() + bwd.max()))
        assert pipe.bubble == pytest.approx(1 - m * (fwd + bwd).sum() / (pp * units))
        # idle stage-ticks are the floor; a stage slower than the rest (the last one's
        # loss) adds its gap on every tick, at most as if every stage were the slowest
        formula = (pp - 1) / (m + pp - 1)
        balance = (fwd + bwd).mean() / (fwd.max() + bwd.max())
        assert formula <= pipe.bubble <= 1 - (1 - formula) * balance
        assert pipe.bubble < bubbles[-1]
        bubbles.append(pipe.bubble)
        assert pred.step_s < predict(rows, h100, lay.mesh_axes()).step_s


@pytest.mark.parametrize("layout", ["pp2xfsdp4", "pp4xfsdp2"])
def test_memory_gpipe_stashes_m_and_1f1b_fewer(layout):
    """The memory model: GPipe's peak exceeds 1F1B's by its more stashed slots,
    M - min(M, 2p - 1), each a unit's residuals: under remat full at least each of the
    stage's layers' input [B/M, L, D] f32 on this device; none and dots stash more than
    full, none the most."""
    from engine.cost import memory

    lay = Layout.parse(layout)
    pp, fsdp = lay.degree("pp"), lay.degree("fsdp")
    tcfg = dataclasses.replace(TCFG, batch=32)
    for m in (pp, 2 * pp, 4 * pp):
        peak = {(s, remat): memory.predict(dataclasses.replace(PP_CFG, remat=remat), tcfg,
                                           lay, "cpu", parallel=ParallelConfig(
                                               microbatches=m, pp_schedule=s)).peak
                for s in ("gpipe", "1f1b") for remat in ("full", "dots", "none")}
        slots = m - min(m, 2 * pp - 1)
        x_micro = tcfg.batch // fsdp // m * tcfg.seq * PP_CFG.d_model * 4
        layers = PP_CFG.n_layers // pp
        assert peak["gpipe", "full"] - peak["1f1b", "full"] >= slots * layers * x_micro
        for remat in ("dots", "none"):
            assert peak["gpipe", remat] - peak["1f1b", remat] >= slots * x_micro
            assert peak["1f1b", remat] > peak["1f1b", "full"]
        assert peak["1f1b", "none"] > peak["1f1b", "dots"]


@pytest.mark.slow
def test_memory_model_against_the_compiler():
    """Predicted peaks of pp4xfsdp2 under every schedule (M = 8) within 15% of
    `memory_analysis()`'s, and the compiler's gpipe - 1f1b gap is the predicted one."""
    from engine.cost import memory

    lay, tcfg = Layout.parse("pp4xfsdp2"), dataclasses.replace(TCFG, batch=32)
    got = {}
    for s in pipeline.SCHEDULES:
        par = ParallelConfig(microbatches=8, pp_schedule=s)
        t = Trainer(PP_CFG, tcfg, lay, lay.mesh(), par)
        measured = memory.measure(memory.compile_step(t, {"xla_backend_optimization_level": 0}))
        predicted = memory.predict(PP_CFG, tcfg, lay, "cpu", parallel=par)
        assert abs(predicted.peak - measured["peak"]) <= 0.15 * measured["peak"], s
        got[s] = (measured["peak"], predicted.peak)
    # the one slot more of gpipe (8 against 2p - 1 = 7), to the compiler's alignment
    gap = got["gpipe"][1] - got["1f1b"][1]
    assert got["gpipe"][0] - got["1f1b"][0] == pytest.approx(gap, rel=0.02)
