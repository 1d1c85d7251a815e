"""The planner's candidate space (engine/planner/space.py): every factorisation in every
order, switches only where they change the program, programs grouped as their key says,
refused candidates never offered, and the orders (and the gpipe and 1f1b schedules) that
share one traced program."""
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import TrainConfig, model_config
from engine.cost import calibration, hardware
from engine.cost.ledger import step_ledger
from engine.cost.price import predict
from engine.parallel import validate
from engine.parallel.layout import Layout
from engine.planner import search as plan
from layers import roles

pytestmark = pytest.mark.usefixtures("own_ledger_cache")


def _brute_force_layouts(n: int) -> set[str]:
    """Every assignment of sizes 1..n to the registry's roles with product n, each in
    every order of its axes of size > 1, as layout strings."""
    names = list(roles.ROLES)
    out = set()
    for sizes in itertools.product(range(1, n + 1), repeat=len(names)):
        if math.prod(sizes) != n:
            continue
        axes = [(r, s) for r, s in zip(names, sizes) if s > 1]
        for order in itertools.permutations(axes):
            out.add(str(Layout(tuple(order))))
    return out


def test_enumeration_covers_every_factorisation_in_every_order():
    got = [str(lay) for lay in plan.layouts(8)]
    assert len(got) == len(set(got))
    assert set(got) == _brute_force_layouts(8)
    assert {str(lay) for lay in plan.layouts(1)} == {"single"}
    assert {str(lay) for lay in plan.layouts(6)} == _brute_force_layouts(6)


def test_programs_group_as_their_key_says():
    """`search.by_program` (keyed by config objects, read once per run of them) groups a
    plan's candidates exactly as `Candidate.program` does, in the same order, also
    where equal configs are distinct objects."""
    cfg = model_config("tiny")
    ok, _ = plan.candidates(cfg, TrainConfig(batch=16, seq=32), 8, None)
    copies = [dataclasses.replace(c, parallel=dataclasses.replace(c.parallel))
              for c in ok[::3]]  # equal to their originals, other objects
    want: dict = {}
    for c in ok + copies:
        want.setdefault(c.program, []).append(c)
    got = plan.by_program(ok + copies)
    assert list(got) == list(want) and got == want
    assert len(got) < len(ok)



def test_programs_hold_the_candidates_grouped_by_program():
    """`space.programs` (every order of a factorisation under the settings tracing to
    one program, candidates built as they are read) holds the candidates `by_program`
    groups, program by program in the same order, gpipe and 1f1b in one program; a
    Program reads by index, negative index and slice as the list of its candidates."""
    cfg = model_config("tiny")
    tcfg = TrainConfig(batch=16, seq=32)
    progs, refused = plan.programs(cfg, tcfg, 8, None)
    ok, refused_too = plan.candidates(cfg, tcfg, 8, None)
    want = plan.by_program(ok)
    assert [list(p) for p in progs] == list(want.values())
    assert refused == refused_too
    shared = [p for p in progs if len(p.settings) > 1]
    assert shared and all({par.pp_schedule for par, _ in p.settings} == {"gpipe", "1f1b"}
                          for p in shared)
    p = max(progs, key=len)
    every = list(p)
    assert [p[i] for i in range(-len(p), len(p))] == every + every
    assert p[1:-1:2] == every[1:-1:2] and len(p) == len(every)
    with pytest.raises(IndexError):
        p[len(p)]

def test_switches_multiply_only_where_they_change_the_program():
    cfg = model_config("small")
    flags = lambda text: [plan.Candidate(Layout.parse(text), p, c).flags
                          for p, c in plan.switch_settings(cfg, Layout.parse(text), {})]
    # dp alone: remat only; fsdp: zero 1/2/3 and prefetch under zero 3
    assert len(flags("dp8")) == 3
    assert len(flags("fsdp8")) == 3 * 4
    assert len(flags("fsdp4xtp2")) == 3 * 4 * 3
    assert len(flags("tp2xcp4")) == 3 * 3 * 2
    assert all(f["zero"] == 3 and not f["prefetch"] for f in flags("tp8"))
    pinned = plan.switch_settings(cfg, Layout.parse("fsdp8"), {"remat": "dots"})
    assert {c.remat for _, c in pinned} == {"dots"}


def test_candidates_keep_the_grad_reduce_they_are_given():
    """`--grad-reduce` is not a switch of the plan: every candidate, and every neighbour
    of one, carries the base's (as `--layout auto` and `python -m engine.plan` pass it)."""
    from engine.cli.args import parse
    from engine.config import ParallelConfig

    par = parse(["--layout", "fsdp8", "--model", "tiny", "--grad-reduce", "f32"])[2]
    assert par.grad_reduce == "f32"
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=8, seq=32)
    ok, _ = plan.candidates(cfg, tcfg, 8, base=ParallelConfig(grad_reduce="f32"))
    assert ok and {c.parallel.grad_reduce for c in ok} == {"f32"}
    fsdp = next(c for c in ok if c.layout.degree("fsdp") > 1)
    assert {c.parallel.grad_reduce for c in plan.neighbours(fsdp, tcfg)} == {"f32"}
    assert {c.parallel.grad_reduce for c in plan.candidates(cfg, tcfg, 8)[0]} == {"compute"}


def test_restricted_layouts_are_the_brute_force_ones_within_the_limits():
    def within(text, names, limits):
        lay = Layout.parse(text)
        return (all(r in names for r, _ in lay.axes)
                and all(lay.degree(r) <= m for r, m in limits.items()))

    names, limits = ("dp", "fsdp", "tp"), {"tp": 4}
    got = [str(lay) for lay in plan.layouts(16, names, limits)]
    assert len(got) == len(set(got))
    assert set(got) == {t for t in _brute_force_layouts(16) if within(t, names, limits)}
    assert "tp8xfsdp2" not in got and "fsdp4xtp4" in got


def test_pinned_switches_apply_only_where_they_change_the_program():
    cfg = model_config("small")
    pinned = {"zero": 1, "prefetch": True, "tp_comm": "ring", "remat": "dots"}
    for text in ("dp8", "fsdp8", "fsdp4xtp2", "tp8"):
        lay = Layout.parse(text)
        (par, c), = plan.switch_settings(cfg, lay, pinned)
        default = validate.ParallelConfig()
        assert c.remat == "dots"
        assert par.zero == (1 if lay.degree("fsdp") > 1 else default.zero)
        assert par.prefetch is False  # zero 1: prefetch never applies
        assert par.tp_comm == ("ring" if lay.degree("tp") > 1 else default.tp_comm)


def test_neighbours_change_one_switch_and_stay_runnable():
    cfg, tcfg = model_config("small"), TrainConfig(batch=16, seq=256)
    par = validate.ParallelConfig(zero=3, prefetch=True, tp_comm="sequence")
    start = plan.Candidate(Layout.parse("fsdp4xtp2"), par, dataclasses.replace(cfg, remat="dots"))
    got = plan.neighbours(start, tcfg)
    assert {str(c.layout) for c in got} == {"fsdp4xtp2", "tp2xfsdp4"}
    changed = {}
    for c in got:
        assert validate.problems(c.cfg, tcfg, c.parallel, c.layout) == []
        diff = {k: v for k, v in c.flags.items() if v != start.flags[k]}
        if c.parallel.zero != 3:  # prefetch stops applying: back to its default
            assert diff.pop("prefetch") is False
        (name, value), = diff.items()
        changed.setdefault(name, set()).add(value)
    assert changed == {"zero": {1, 2}, "prefetch": {False}, "tp_comm": {"allreduce", "ring"},
                       "remat": {"none", "full"}}


def test_refused_candidates_never_appear():
    # heads=6, kv 2: tp4 does not divide the heads and cp4 does not cut seq=36 into 8
    cfg = model_config("tiny", n_heads=6, n_kv_heads=2)
    tcfg = TrainConfig(batch=4, seq=36)
    ok, refused = plan.candidates(cfg, tcfg, 4, {"remat": "full"})
    assert refused and ok
    for c in ok:
        assert validate.problems(c.cfg, tcfg, c.parallel, c.layout) == []
    for c, reason in refused:
        assert reason == "; ".join(validate.problems(c.cfg, tcfg, c.parallel, c.layout))
    assert {str(c.layout) for c, _ in refused} >= {"tp4", "cp4"}
    assert not {str(c.layout) for c in ok} & {"tp4", "cp4"}


def test_candidates_are_every_order_validated_on_its_own():
    """The switches and the validation run once per factorisation: the result is what
    running them for each order of the axes gives, reasons naming that order's layout."""
    cfg = model_config("tiny", n_heads=6, n_kv_heads=2)
    tcfg = TrainConfig(batch=4, seq=36)
    ok, refused = plan.candidates(cfg, tcfg, 8, {})
    want_ok, want_refused = set(), set()
    for lay in plan.layouts(8):
        for par, c in plan.switch_settings(cfg, lay, {}):
            found = validate.problems(c, tcfg, par, lay)
            if found:
                want_refused.add((str(lay), par, c, "; ".join(found)))
            else:
                want_ok.add((str(lay), par, c))
    got_ok = [(str(x.layout), x.parallel, x.cfg) for x in ok]
    got_refused = [(str(x.layout), x.parallel, x.cfg, why) for x, why in refused]
    assert len(got_ok) == len(set(got_ok)) and set(got_ok) == want_ok
    assert len(got_refused) == len(set(got_refused)) and set(got_refused) == want_refused
    named = {str(x.layout): why for x, why in refused if why.startswith("layout ")}
    assert named["tp2xpp4"].startswith("layout tp2xpp4 (")
    assert named["pp4xtp2"].startswith("layout pp4xtp2 (")


def test_orders_share_one_traced_program():
    """The cache key leaves out the order of the axes: both orders trace the same rows
    (up to the order a row names its axes in) and each is priced the same from the
    other's rows."""
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    a, b = Layout.parse("fsdp2xtp2"), Layout.parse("tp2xfsdp2")
    ca, cb = (plan.Candidate(lay, validate.ParallelConfig(), cfg) for lay in (a, b))
    assert ca.program == cb.program
    rows_a, rows_b = step_ledger(cfg, tcfg, a), step_ledger(cfg, tcfg, b)
    same_axes = lambda rows: [dataclasses.replace(r, axes=tuple(sorted(r.axes))) for r in rows]
    assert same_axes(rows_a) == same_axes(rows_b)
    assert rows_a != rows_b  # the comparison above can fail
    for hw in (calibration.cpu_defaults(), hardware.get("h100")):
        for lay in (a, b):
            assert (predict(rows_a, hw, lay.mesh_axes()).step_s
                    == predict(rows_b, hw, lay.mesh_axes()).step_s)


def test_pp_candidates_choose_a_schedule_and_share_its_trace():
    """pp layouts come with every schedule at 4·pp microbatches (interleaved with 2
    chunks per device where the layers divide); gpipe and 1f1b are one program: the
    gpipe step's ledger priced along 1f1b's table is 1f1b's own prediction up to the
    stash's zero fill before the ticks (gpipe's M slots against 1f1b's fewer): < 0.1% of
    the step on the h100, < 0.5% on the cpu profile, whose out-of-cache rate
    (`hbm_cold`) prices a whole stack's fill (0.38% on this program)."""
    from engine.cost.pipeline import predict_step

    cfg, tcfg = model_config("small"), TrainConfig(batch=32, seq=256)
    ok, _ = plan.candidates(cfg, tcfg, 8, {"remat": "full"})
    pp = [c for c in ok if c.layout.degree("pp") > 1]
    assert {c.parallel.pp_schedule for c in pp} == {"gpipe", "1f1b", "interleaved", "zb1"}
    assert all(c.parallel.microbatches == 4 * c.layout.degree("pp") for c in pp)
    assert all((c.parallel.pp_virtual == 2) == (c.parallel.pp_schedule == "interleaved")
               for c in pp)
    lay = Layout.parse("pp2xfsdp2xtp2")
    by = {c.parallel.pp_schedule: c for c in pp if c.layout == lay
          and c.parallel.tp_comm == "ring" and c.parallel.zero == 3 and not c.parallel.prefetch}
    assert by["gpipe"].program == by["1f1b"].program != by["interleaved"].program
    rows = {s: step_ledger(cfg, tcfg, lay, by[s].parallel) for s in ("gpipe", "1f1b")}
    for hw, rel in ((calibration.cpu_defaults(), 5e-3), (hardware.get("h100"), 1e-3)):
        own = predict_step(rows["1f1b"], hw, lay, by["1f1b"].parallel)[0].step_s
        shared = predict_step(rows["gpipe"], hw, lay, by["1f1b"].parallel)[0].step_s
        assert shared == pytest.approx(own, rel=rel)
        gpipe = predict_step(rows["gpipe"], hw, lay, by["gpipe"].parallel)[0].step_s
        assert gpipe != pytest.approx(own, rel=1e-3)  # the tables do price differently
