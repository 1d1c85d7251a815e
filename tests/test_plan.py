"""The planner (engine/planner/search.py): it enumerates every layout, never ranks what
engine.parallel.validate refuses or what does not fit, prices as the cost model does (in worker
processes, from the ledger cache, with `refine`'s timed matmuls). Its command lines:
tests/test_plan_cli.py."""
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import TrainConfig, model_config  # noqa: E402
from engine.cost import calibration, hardware  # noqa: E402
from engine.cost.ledger import step_ledger  # noqa: E402
from engine.cost.price import predict  # noqa: E402
from engine.parallel import validate
from engine.parallel.layout import Layout  # noqa: E402
from engine.planner import search as plan  # noqa: E402
from engine.planner.auto import hardware_profile  # noqa: E402
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
    gpipe step's ledger priced along 1f1b's table is 1f1b's own prediction (the stash's
    zero fill outside the ticks is all that differs: < 0.1%)."""
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
    for hw in (calibration.cpu_defaults(), hardware.get("h100")):
        own = predict_step(rows["1f1b"], hw, lay, by["1f1b"].parallel)[0].step_s
        shared = predict_step(rows["gpipe"], hw, lay, by["1f1b"].parallel)[0].step_s
        assert shared == pytest.approx(own, rel=1e-3)
        gpipe = predict_step(rows["gpipe"], hw, lay, by["gpipe"].parallel)[0].step_s
        assert gpipe != pytest.approx(own, rel=1e-3)  # the tables do price differently


def test_a_step_over_memory_is_retried_with_more_microbatches():
    """With room for fsdp8's zero-3 step only at 2 microbatches, the plan ranks it at
    M = 2 (its peak under the capacity), keeps M = 1 where that fits, and leaves over
    memory what fits at no M that divides the per-device batch."""
    from engine.cost import fit

    cfg, tcfg = model_config("small", remat="full"), TrainConfig(batch=32, seq=256)
    h100, lay = hardware.get("h100"), Layout.parse("fsdp8")
    peak = {m: fit.peak_bytes(cfg, tcfg, validate.ParallelConfig(microbatches=m), lay, h100)
            for m in (1, 2)}
    assert peak[2] < peak[1]
    cap = (peak[1] + peak[2]) / 2
    result = plan.plan(cfg, tcfg, 8, h100, cap, {"remat": "full"}, names=("fsdp",))
    assert result.ranked
    by = {c.candidate.describe(): c for c in result.ranked}
    assert by["fsdp8 zero 3 remat full microbatches 2"].peak_bytes == peak[2]
    for p in result.ranked:
        assert p.peak_bytes <= cap
        m = p.candidate.parallel.microbatches
        if m > 1:  # the next smaller M did not fit
            half = dataclasses.replace(p.candidate.parallel, microbatches=m // 2)
            assert fit.peak_bytes(cfg, tcfg, half, lay, h100) > cap
    for c, over in result.over:  # M = 4 per device is the most that divides
        assert over > cap and c.parallel.microbatches == 4


@pytest.mark.slow
def test_progress_is_said_only_for_slow_plans():
    """A plan calls `progress` once per program priced; `progress_line` turns that
    into a line at most every `every_s` seconds, none for a plan quicker than that."""
    cfg, tcfg = model_config("tiny", remat="full"), TrainConfig(batch=4, seq=32)
    calls, said = [], []
    plan.plan(cfg, tcfg, 2, hardware.get("h100"), pinned={"remat": "full"},
              progress=lambda done, total, front=None: calls.append((done, total, front)))
    assert calls and calls[-1][0] == calls[-1][1] == len(calls)
    top, tenth, bound = calls[-1][2]()  # best-first: where the search stands
    assert top == 10 and tenth is not None and tenth < bound
    calls = [c[:2] for c in calls]
    quiet = plan.progress_line(said.append, every_s=3600)
    for done, total in calls:
        quiet(done, total)
    assert said == []
    chatty = plan.progress_line(said.append, every_s=0)
    chatty(3, 7)
    assert said and said[0].startswith("planning: 3/7 programs priced")
    ticks = iter([0.0, 10.0, 12.0, 30.0])  # start, then three reports
    timed = plan.progress_line(said.append, every_s=15, clock=lambda: next(ticks))
    timed(2, 6)  # 10 s in: quiet
    timed(3, 6)  # 12 s in: quiet
    timed(4, 6)  # 30 s in: 7.5 s per program so far, 2 left
    assert said[-1] == "planning: 4/6 programs priced (30 s, about 15 s left)"
    best = plan.progress_line(said.append, every_s=0)  # best-first: no time left guessed
    best(832, 33582, lambda: (10, 15.81, 15.2))
    assert said[-1] == ("planning: 832 of 33582 programs checked (0 s); 10th best step "
                        "15.81 s, least bound left 15.2 s (done when it passes the step)")
    best(2, 33582, lambda: (3, None, 12.0))
    assert said[-1].endswith("; fewer than 3 priced, least bound left 12 s (done when it "
                             "passes the step)")


def test_the_reason_line_skips_the_first_choice_in_another_order():
    """With one link tier the orders of a layout price alike: the line says why the first
    choice beats the next other program, not itself with its axes swapped."""
    def priced(text, zero, step):
        c = plan.Candidate(Layout.parse(text), validate.ParallelConfig(zero=zero),
                           model_config("tiny"))
        return plan.Priced(c, step, step, 0.0, 0.0, 0.1, None)

    from engine.planner.report import runner_up
    assert runner_up([priced("fsdp2xtp2", 3, 1.0), priced("tp2xfsdp2", 3, 1.0),
                      priced("fsdp2xtp2", 1, 1.1)]) == 2
    assert runner_up([priced("fsdp2xtp2", 3, 1.0), priced("tp2xfsdp2", 3, 1.2)]) == 1
    assert runner_up([priced("fsdp2xtp2", 3, 1.0), priced("tp2xfsdp2", 3, 1.0)]) is None


def test_chunks_cover_the_jobs_in_order_largest_first():
    """The pool's runs of consecutive jobs: every job once, in order, runs never
    growing or longer than `LONGEST_RUN`, the last ones single jobs."""
    for n, workers in [(0, 2), (1, 2), (7, 1), (621, 2), (1000, 8), (7146, 2)]:
        runs = plan.chunks(n, workers)
        assert [i for r in runs for i in r] == list(range(n))
        sizes = [len(r) for r in runs]
        assert sizes == sorted(sizes, reverse=True)
        assert not runs or (sizes[-1] == 1 and sizes[0] <= plan.LONGEST_RUN)
    assert [len(r) for r in plan.chunks(40, 2)][:3] == [8, 8, 6]


@pytest.mark.slow
def test_worker_processes_price_as_this_process_does():
    """The pool's workers (spawned processes) rank and price the candidates, and grow
    steps over memory into microbatches, exactly as pricing in this process does."""
    from engine.cost import fit

    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    hw = hardware_profile("cpu", say=lambda s: None)
    here = plan.plan(cfg, tcfg, 2, hw, None, {"remat": "full"})
    with plan.Pool(2) as ex:
        there = plan.plan(cfg, tcfg, 2, hw, None, {"remat": "full"}, executor=ex)
        # under a capacity some step fits only at M = 2, the workers retry what is over
        # with more microbatches as this process does
        tcfg8 = TrainConfig(batch=8, seq=32)
        cap = min(fit.peak_bytes(g.cfg, tcfg8, g.parallel, g.layout, hw) for c in
                  plan.candidates(cfg, tcfg8, 2, {"remat": "full"})[0]
                  if (g := plan.accumulated(c, tcfg8)) is not None
                  and fit.peak_bytes(g.cfg, tcfg8, g.parallel, g.layout, hw)
                  < fit.peak_bytes(c.cfg, tcfg8, c.parallel, c.layout, hw))
        grown_here = plan.plan(cfg, tcfg8, 2, hw, cap, {"remat": "full"})
        grown_there = plan.plan(cfg, tcfg8, 2, hw, cap, {"remat": "full"}, executor=ex)
    assert len(here.ranked) == 10
    assert [p.record() for p in there.ranked] == [p.record() for p in here.ranked]
    assert any(p.candidate.parallel.microbatches > 1 and p.candidate.layout.degree("pp") == 1
               for p in grown_here.ranked)
    assert [p.record() for p in grown_there.ranked] == [p.record() for p in grown_here.ranked]
    # over memory in the order the workers' results came back: the same set
    assert sorted((c.describe(), peak) for c, peak in grown_there.over) == \
        sorted((c.describe(), peak) for c, peak in grown_here.over)


def test_refine_prices_the_near_candidates_with_their_timed_matmuls():
    """`refine` prices again, with `time_dots`' seconds for their matmuls, exactly the
    candidates within `within` of the first: each as the roofline's prediction with
    those seconds in the profile, ranked among themselves ahead of the rest. Timing every
    dot at what the profile's one rate gives it changes no step."""
    import jax

    from engine.cost.price import compute_seconds

    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    hw = calibration.cpu_defaults()
    ranked = plan.plan(cfg, tcfg, 2, hw, None, {"remat": "full"}).ranked
    near = [p for p in ranked if p.step_s <= 1.15 * ranked[0].step_s]
    assert 1 < len(near) < len(ranked)
    asked = []

    def at_the_rate(rows, mesh):
        asked.append((mesh.size, [r.dot for r in rows]))
        return {r.dot: compute_seconds(r, hw, 2)[0] for r in rows}

    same, _, k = plan.refine(ranked, tcfg, hw, 2, jax.devices(), 0.15, at_the_rate)
    assert k == len(near) and asked[0][0] == 2
    assert {p.candidate.describe(): p.step_s for p in same[:k]} == pytest.approx(
        {p.candidate.describe(): p.step_s for p in near}, rel=1e-12)
    assert all(p.dots_timed for p in same[:k]) and same[k:] == ranked[k:]

    def mlp_slow(rows, mesh):  # the MLP's matmuls 20x what the rate gives, the rest as is
        return {r.dot: compute_seconds(r, hw, 2)[0] * (20 if r.scope == "mlp" else 1)
                for r in rows}

    again, hw_t, k = plan.refine(ranked, tcfg, hw, 2, jax.devices(), 0.15, mlp_slow)
    assert k == len(near) and [p.step_s for p in again[:k]] == sorted(p.step_s for p in again[:k])
    assert {p.candidate.describe() for p in again[:k]} == {p.candidate.describe() for p in near}
    for p in again[:k]:
        assert p.step_s == plan.predict_candidate(p.candidate, tcfg, hw_t).step_s
    was = {p.candidate.describe(): p.step_s for p in near}
    assert all(p.step_s > was[p.candidate.describe()] for p in again[:k])
    assert again[k:] == ranked[k:]


@pytest.mark.slow
def test_over_memory_candidates_are_dropped():
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    hw = calibration.cpu_defaults()
    full = plan.plan(cfg, tcfg, 2, hw, None, {"remat": "full"})
    peaks = sorted({p.peak_bytes for p in full.ranked})
    cut = (peaks[0] + peaks[-1]) / 2
    part = plan.plan(cfg, tcfg, 2, hw, cut, {"remat": "full"})
    assert part.ranked and part.over
    assert all(p.peak_bytes <= cut for p in part.ranked)
    assert all(peak > cut for _, peak in part.over)
    assert len(part.ranked) + len(part.over) == len(full.ranked)


def test_ledger_cache_returns_what_a_trace_gives(tmp_path, monkeypatch):
    from engine.cost import cache

    monkeypatch.setenv("SHARDWISE_LEDGER_CACHE", str(tmp_path))
    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    par = validate.ParallelConfig(zero=2)
    a, b = Layout.parse("fsdp2xtp2"), Layout.parse("tp2xfsdp2")
    rows, hit = cache.step_ledger(cfg, tcfg, a, par)
    assert not hit and rows == step_ledger(cfg, tcfg, a, par)
    again, hit = cache.step_ledger(cfg, tcfg, b, par)  # another order: the same program
    assert hit and again == rows
    _, hit = cache.step_ledger(cfg, tcfg, a, validate.ParallelConfig(zero=1))
    assert not hit
    monkeypatch.setenv("SHARDWISE_LEDGER_CACHE", "off")
    assert cache.step_ledger(cfg, tcfg, a, par) == (rows, False)


def test_a_step_that_maps_its_temporaries_pays_their_page_faults_on_the_cpu():
    """A step whose predicted temporaries (the memory model's peak less the step's
    arguments) outgrow a device thread's heap maps them anew every step on a shared
    host: the plan adds their page faults (price.fault_seconds) to its step, and not a
    step whose temporaries stay in the heap, nor one on an accelerator."""
    from engine.cost import fit
    from engine.cost.pipeline import predict_step
    from engine.cost.price import fault_seconds
    from engine.run import host

    if not host.keep_freed_memory():
        pytest.skip("not glibc: the mapped temporaries are not modelled")
    cfg, tcfg, hw = model_config("small", remat="full", dtype="bf16"), TrainConfig(), \
        calibration.cpu_defaults()
    (single,) = plan.plan(cfg, tcfg, 1, hw, None, {"remat": "full"}).ranked
    c = single.candidate
    mem = fit.predicted(cfg, tcfg, c.parallel, c.layout, hw)
    temps = mem.peak - mem.params - mem.opt_state - mem.tokens  # less its arguments
    assert single.mapped_bytes == temps > host.THREAD_HEAP_MAX
    rows = step_ledger(cfg, tcfg, c.layout, c.parallel)
    unfaulted = predict_step(rows, hw, c.layout, c.parallel)[0].step_s
    assert single.step_s == pytest.approx(unfaulted + fault_seconds(hw, 1, temps))
    assert plan.predict_candidate(c, tcfg, hw, single.mapped_bytes).step_s \
        == pytest.approx(single.step_s)
    fsdp8 = plan.plan(cfg, tcfg, 8, hw, None, {"remat": "full", "prefetch": False},
                      names=("fsdp",)).ranked
    assert fsdp8 and all(p.mapped_bytes == 0 for p in fsdp8)  # 18 MiB a device
    assert fit.mapped_bytes(mem, hardware.get("h100")) == 0


def test_ledger_cache_hits_across_run_length_flags(tmp_path, monkeypatch):
    """`--steps`, the learning rate, its warmup and horizon and the seed change constants
    in the step, not its operations: a run of another length finds the ledger the
    planner traced (and a fresh trace of it gives the same rows); another batch misses."""
    import dataclasses

    from engine.cost import cache

    monkeypatch.setenv("SHARDWISE_LEDGER_CACHE", str(tmp_path))
    cfg, par, lay = model_config("tiny"), validate.ParallelConfig(), Layout.parse("fsdp2")
    planned = TrainConfig(batch=4, seq=32, steps=50)
    run = dataclasses.replace(planned, steps=20, lr=1e-3, warmup=3, seed=7, schedule_steps=80)
    rows, hit = cache.step_ledger(cfg, planned, lay, par)
    assert not hit
    again, hit = cache.step_ledger(cfg, run, lay, par)
    assert hit and again == rows
    assert step_ledger(cfg, run, lay, par) == rows
    _, hit = cache.step_ledger(cfg, dataclasses.replace(run, batch=8), lay, par)
    assert not hit


def test_auto_after_a_plan_at_another_run_length_prices_from_the_cache():
    """`python -m engine.plan` (its run length the default 50 steps) then `python -m
    engine.train --layout auto --steps 20`: the configs each CLI builds key the same
    ledgers, so the second plan traces nothing."""
    from engine.cli.args import parse_or_exit
    from engine.cli.given import auto_pins
    from engine.cli.plan import build_parser
    from engine.cli.train import parse

    common = ["--model", "tiny", "--batch", "4", "--seq", "32"]
    cfg, tcfg, _, _, _ = parse_or_exit(["--devices", "2", "--hardware", "cpu", *common],
                                       build_parser())
    hw = hardware.get("cpu")  # what `--layout auto` plans with on this host
    first = plan.plan(cfg, tcfg, 2, hw, names=("fsdp",))
    assert first.cached == 0 and first.programs > 0
    cfg2, tcfg2, par2, _, args = parse(["--layout", "auto", *common, "--steps", "20"],
                                       auto=True)
    pinned, base = auto_pins(cfg2, par2, args.given)
    second = plan.plan(cfg2, tcfg2, 2, hw, names=("fsdp",), pinned=pinned, base=base)
    assert second.cached == second.programs == first.programs
    assert [p.step_s for p in second.ranked] == [p.step_s for p in first.ranked]
