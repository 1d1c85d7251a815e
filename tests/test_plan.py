"""The planner (engine/planner/search.py): it never ranks what does not fit, prices as the
cost model does (in worker processes, engine/planner/worker.py, from the ledger cache,
with `refine`'s timed matmuls). Its candidate space: tests/test_plan_space.py; its
command lines: tests/test_plan_cli.py."""
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import TrainConfig, model_config  # noqa: E402
from engine.cost import calibration, hardware  # noqa: E402
from engine.cost.ledger import step_ledger  # noqa: E402
from engine.parallel import validate
from engine.parallel.layout import Layout  # noqa: E402
from engine.planner import search as plan, worker  # noqa: E402
from engine.planner.auto import hardware_profile  # noqa: E402

pytestmark = pytest.mark.usefixtures("own_ledger_cache")


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
        runs = worker.chunks(n, workers)
        assert [i for r in runs for i in r] == list(range(n))
        sizes = [len(r) for r in runs]
        assert sizes == sorted(sizes, reverse=True)
        assert not runs or (sizes[-1] == 1 and sizes[0] <= worker.LONGEST_RUN)
    assert [len(r) for r in worker.chunks(40, 2)][:3] == [8, 8, 6]


@pytest.mark.slow
def test_worker_processes_price_as_this_process_does():
    """The pool's workers (spawned processes) rank and price the candidates, and grow
    steps over memory into microbatches, exactly as pricing in this process does."""
    from engine.cost import fit

    cfg, tcfg = model_config("tiny"), TrainConfig(batch=4, seq=32)
    hw = hardware_profile("cpu", say=lambda s: None)
    here = plan.plan(cfg, tcfg, 2, hw, None, {"remat": "full"})
    with worker.Pool(2) as ex:
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
