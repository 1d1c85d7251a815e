"""The compiled-HLO audit: the step the compiler built holds exactly the collectives the
ledger traced, on every layout family and switch (and names what it added when not)."""
from __future__ import annotations

import dataclasses

import pytest
from test_cost import CFG, TCFG, _cfg, _compiled, compiled_text

from engine.config import ParallelConfig, model_config
from engine.cost.audit import audit
from engine.cost.ledger import step_ledger
from engine.parallel.layout import Layout


@pytest.mark.parametrize("layout", ["fsdp8", "tp8", "fsdp4xtp2", "dp2xfsdp2xtp2", "cp4xfsdp2"])
def test_audit_clean(layout):
    """The compiled step holds exactly the ledger's collectives (kinds, groups, dtypes,
    bytes, executions counting while-loop trips), modulo the named rules."""
    cfg, lay = _cfg(), Layout.parse(layout)
    rows = step_ledger(cfg, TCFG, lay)
    result = audit(rows, _compiled(layout, "f32"), lay.mesh_axes(), "cpu")
    assert result.clean, (result.missing, result.extra)
    assert sum(result.matched.values()) > 0
    assert set(result.rules) <= {"all_reduce_combiner"}



def _audit_step(cfg, layout: str, par: ParallelConfig):
    """The audit of the step's compiled HLO on `layout` (8 host devices) against its ledger."""
    from engine.run.step import Trainer

    lay = Layout.parse(layout)
    text = compiled_text(Trainer(cfg, TCFG, lay, lay.mesh(), par),
                         compiler_options={"xla_backend_optimization_level": 0})
    return audit(step_ledger(cfg, TCFG, lay, par), text, lay.mesh_axes(), "cpu")



SWITCHES = [dict(tp_comm="sequence"), dict(tp_comm="ring"), dict(zero=2), dict(prefetch=True),
            pytest.param(dict(zero=1), marks=pytest.mark.slow),
            pytest.param(dict(tp_comm="ring", zero=2), marks=pytest.mark.slow)]



@pytest.mark.parametrize("switches", SWITCHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_audit_clean_under_each_switch(switches):
    """Each --tp-comm / --zero / --prefetch setting on fsdp4xtp2: the compiled step still
    holds exactly the collectives the ledger placed (the ring's collective-permutes, the
    sequence-parallel gathers and reduce-scatters, ZeRO-1/2's param gathers after the
    update, prefetch's N gathers per weight)."""
    cfg, par = _cfg(), ParallelConfig(**switches)
    if par.prefetch:  # with 2 layers XLA merges the backward's gathers (layers.block)
        cfg = dataclasses.replace(cfg, n_layers=3)
    result = _audit_step(cfg, "fsdp4xtp2", par)
    assert result.clean, (result.missing, result.extra)
    kinds = {k[0] for k in result.matched}
    assert ("collective-permute" in kinds) == (par.tp_comm == "ring")



def test_audit_clean_sequence_regather():
    """--tp-comm sequence under remat none on fsdp4xtp2: the compiled step holds the
    backward's second gather of each column's input (`collectives.ring.SequenceComm`)
    as the ledger places it: per layer 2 all-gathers over tp forward, 2 as the
    reduce-scatters' transposes and 2 gathered again; the loss head 1 and 1."""
    cfg, par = _cfg(remat="none"), ParallelConfig(tp_comm="sequence")
    result = _audit_step(cfg, "fsdp4xtp2", par)
    assert result.clean, (result.missing, result.extra)
    gathers = sum(n for k, n in result.matched.items() if k[:2] == ("all-gather", ("tp",)))
    assert gathers == 6 * cfg.n_layers + 2


@pytest.mark.parametrize("remat", ["none", "full"])
def test_audit_clean_cp_ring(remat):
    """--cp-comm ring on cp4xfsdp2: the compiled step holds exactly the ledger's
    collective-permutes (per layer: 2(cp-1) K/V shifts forward, 2(cp-1) K/V and 2cp
    dK/dV shifts backward). Under remat the recomputed forward's K/V shifts and the
    backward's are the same shifts of the same blocks in one loop body: XLA sends them
    once, and the ledger counts them once (`ledger.MERGED_COLLECTIVES`)."""
    cfg, par = _cfg(remat=remat), ParallelConfig(cp_comm="ring")
    result = _audit_step(cfg, "cp4xfsdp2", par)
    assert result.clean, (result.missing, result.extra)
    permutes = sum(n for k, n in result.matched.items() if k[0] == "collective-permute")
    cp = Layout.parse("cp4xfsdp2").degree("cp")
    assert permutes == cfg.n_layers * (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp)



def test_audit_clean_cp_ring_bf16():
    """--cp-comm ring in bf16 on cp4xfsdp2: XLA:CPU computes the ring's tiles in f32
    and moves the K/V blocks' upcast ahead of their permutes, which then send f32
    (`cpu_permute_sent_in_f32`: each of the 4(cp-1) K/V shifts a layer; the dK/dV
    accumulators are f32 in the ledger too)."""
    cfg, par = _cfg("bf16", remat="none"), ParallelConfig(cp_comm="ring")
    result = _audit_step(cfg, "cp4xfsdp2", par)
    assert result.clean, (result.missing, result.extra)
    cp = Layout.parse("cp4xfsdp2").degree("cp")
    assert result.rules["cpu_permute_sent_in_f32"] == cfg.n_layers * 4 * (cp - 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp4xtp2", "tp8"])
def test_audit_clean_bf16(layout):
    """bf16 compute: the CPU runs bf16 gathers / reduce-scatters in f32 (named rule)."""
    cfg, lay = _cfg("bf16"), Layout.parse(layout)
    rows = step_ledger(cfg, TCFG, lay)
    result = audit(rows, _compiled(layout, "bf16"), lay.mesh_axes(), "cpu")
    assert result.clean, (result.missing, result.extra)
    assert result.rules["cpu_bf16_collectives_in_f32"] > 0



def test_audit_names_what_the_compiler_added():
    """A collective the ledger does not hold is reported as extra, by key."""
    cfg, lay = _cfg(), Layout.parse("fsdp8")
    rows = step_ledger(cfg, TCFG, lay)
    text = _compiled("fsdp8", "f32")
    dropped = [r for r in rows if r.primitive != "all_gather"]
    result = audit(dropped, text, lay.mesh_axes(), "cpu")
    assert not result.clean and not result.missing
    assert {k[0] for k in result.extra} == {"all-gather"}



@pytest.mark.parametrize("layout", [pytest.param("ep8", marks=pytest.mark.slow), "ep4xfsdp2",
                                    pytest.param("ep2xfsdp2xtp2", marks=pytest.mark.slow)])
def test_audit_clean_moe(layout):
    """A mixture of experts on the ep layouts: the compiled step holds exactly the
    ledger's all-to-alls (per layer: tokens and their expert ids there, outputs back,
    the recompute's and the backward's) beside every other collective."""
    cfg = model_config("moe-tiny", dtype="f32", shared_experts=1, **CFG)
    result = _audit_step(cfg, layout, ParallelConfig())
    assert result.clean, (result.missing, result.extra)
    ep = Layout.parse(layout).degree("ep")
    all_to_alls = sum(n for k, n in result.matched.items() if k[0] == "all-to-all")
    # fwd: x, ids, outputs back; remat recompute: the same; bwd: the two float ones
    assert all_to_alls == cfg.n_layers * (3 + 3 + 2) * ep



def test_replica_groups_read_alike_in_both_hlo_spellings():
    """jax 0.10's XLA lists device ids, jax 0.12's names mesh axes; both give the same
    groups (a (2, 2, 2) mesh, a collective over its first and last axes)."""
    from engine.cost.hlo import replica_groups

    listed = "replica_groups={{0,1,4,5},{2,3,6,7}}, dimensions={0}"
    named = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, dimensions={0}"
    assert replica_groups(named) == replica_groups(listed) == frozenset(
        {frozenset({0, 1, 4, 5}), frozenset({2, 3, 6, 7})})
    assert replica_groups("replica_groups=mesh['a'=4,'b'=2] {'b'}") == frozenset(
        frozenset({2 * i, 2 * i + 1}) for i in range(4))



@pytest.mark.parametrize("layout, microbatches, schedule", [
    ("pp2xfsdp4", 2, "1f1b"), pytest.param("pp4xtp2", 2, "gpipe", marks=pytest.mark.slow)])
def test_audit_clean_pp(layout, microbatches, schedule):
    """Pipeline stages: the compiled step holds exactly the ledger's collectives, the
    stage ppermutes included (one forward and one backward shift per tick)."""
    from engine.run.step import Trainer

    cfg, lay = dataclasses.replace(_cfg(), n_layers=4), Layout.parse(layout)
    par = ParallelConfig(microbatches=microbatches, pp_schedule=schedule)
    result = _audit_step(cfg, layout, par)
    assert result.clean, (result.missing, result.extra)
    permutes = sum(n for k, n in result.matched.items() if k[0] == "collective-permute")
    ticks = Trainer(cfg, TCFG, lay, lay.abstract_mesh(), par).plan.ticks
    assert permutes == 2 * ticks
