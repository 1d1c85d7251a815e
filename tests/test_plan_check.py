"""The bench tools that check the planner and the cost model by measurement:
`bench/plan_check.py` (Spearman, steps timed round robin), `bench/switches.py` (the
order check against the noise) and `bench/published_plan.py` (what the choice changed)."""
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import model_config  # noqa: E402
from engine.parallel import validate
from engine.parallel.layout import Layout  # noqa: E402
from engine.planner import search as plan  # noqa: E402


def test_plan_check_spearman_matches_the_textbook_formula():
    from bench import plan_check

    a, b = [0.3, 0.1, 0.2, 0.5, 0.4], [1.0, 3.0, 2.0, 5.0, 4.0]
    d = plan_check.ranks(a) - plan_check.ranks(b)
    n = len(a)
    assert plan_check.spearman(a, b) == pytest.approx(1 - 6 * (d * d).sum() / (n * (n * n - 1)))
    assert plan_check.spearman(a, a) == pytest.approx(1.0)
    assert plan_check.spearman(a, [-x for x in a]) == pytest.approx(-1.0)
    assert list(plan_check.ranks([2.0, 1.0, 2.0])) == [2.5, 1.0, 2.5]


def test_same_program_gaps_compare_only_one_program_in_two_orders():
    from types import SimpleNamespace

    from bench import plan_check

    cand = lambda program: SimpleNamespace(candidate=SimpleNamespace(program=program))
    cands = [cand("p"), cand("q"), cand("p"), cand("q"), cand("r")]
    times = [[2.0, 2.2], [1.0, 1.0], [2.1, 2.3], [1.0, 1.25], [9.0, 0.5]]
    fastest, paired = plan_check.same_program_gaps(cands, times)
    # p: fastest 2.0 vs 2.1 (5%), rounds 2.0/2.1 and 2.2/2.3; q: fastest 1.0 vs 1.0, rounds
    # 1.0/1.0 and 1.0/1.25, median 0.9, so 1/0.9 - 1; r has no second order, however far
    # its steps are from the others'
    assert fastest == pytest.approx(0.05)
    assert paired == pytest.approx(1 / 0.9 - 1)
    assert plan_check.same_program_gaps(cands[:2], times[:2]) is None


def test_plan_check_times_single_steps_round_robin_after_a_warm_up(monkeypatch):
    from types import SimpleNamespace

    from bench import plan_check, timing

    calls = []

    def compiled(cand, tcfg):
        def step(params, opt_state, tokens):
            calls.append(cand.describe())
            return params + 1, opt_state, {}
        return step, 0, None, None

    clock = iter(range(1000))
    monkeypatch.setattr(plan_check, "compiled", compiled)
    monkeypatch.setattr(timing, "timed_step", lambda step, params, opt, tokens: (
        *step(params, opt, tokens), float(next(clock))))
    cands = [SimpleNamespace(candidate=SimpleNamespace(describe=lambda n=n: n), step_s=1.0)
             for n in "abc"]
    times, held = plan_check.measure(cands, None, steps=1, rounds=3, say=lambda *a, **k: None)
    # one warm-up each, then the candidates in turn, one step at a time
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] * 3
    assert [len(t) for t in times] == [3, 3, 3]
    assert times == [[3.0, 6.0, 9.0], [4.0, 7.0, 10.0], [5.0, 8.0, 11.0]]
    assert timing.split_half_noise(times) == pytest.approx(1.0)  # a: fastest 3 vs 6
    assert timing.split_half_noise([[1.0, 1.1, 1.2, 1.05], [2.0, 2.0], [5.0]]) == (
        pytest.approx(0.05))
    # a drift common to each round cancels in the paired ratio, not in the fastest steps
    drift = [1.0, 1.6, 0.7, 1.3, 0.9]
    a, b = [1.06 * d for d in drift], [1.0 * d for d in drift]
    assert timing.paired_ratio(a, b) == pytest.approx(1.06)
    assert min(a) / min(b) == pytest.approx(1.06)  # the same here; not once b has a lucky step
    b[1] = 0.5
    assert timing.paired_ratio(a, b) == pytest.approx(1.06)
    assert min(a) / min(b) == pytest.approx(0.742 / 0.5)  # one lucky step of b: 1.48
    calls.clear()
    plan_check.measure(cands[:2], None, steps=2, rounds=2, say=lambda *a, **k: None)
    assert calls == ["a", "b", "a", "a", "b", "b", "a", "a", "b", "b"]
    # the head-to-head run reuses the compiled steps and their state: the first choice
    # against the candidate other than it with the fastest step, alternating
    assert plan_check.rival(times) == 1
    assert plan_check.rival([[1.0], [3.0, 2.5], [2.6]]) == 1
    assert plan_check.rival([[9.0], [3.0], [2.6]]) == 2
    # the first choice's own program in another axis order is not its rival
    assert plan_check.rival([[9.0], [3.0], [2.6]], ["p", "q", "p"]) == 1
    assert plan_check.rival([[9.0], [3.0]], ["p", "p"]) is None
    calls.clear()
    h = plan_check.head_to_head(held, 2, rounds=3, steps=1, say=lambda *a, **k: None)
    assert calls == ["a", "c"] * 3
    assert held[0][1] == 7 and held[2][1] == 7  # 1 warm-up + 3 rounds + 3 more each
    t0 = h["first_s"][0]
    assert h["first_s"] == [t0, t0 + 2, t0 + 4] and h["rival_s"] == [t0 + 1, t0 + 3, t0 + 5]
    assert h["fastest_ratio"] == pytest.approx(t0 / (t0 + 1))
    assert h["paired_ratio"] == pytest.approx(timing.paired_ratio(h["first_s"], h["rival_s"]))


def test_published_plan_names_what_changed_and_refuses_bad_flags(capsys):
    from bench import published_plan

    cfg = model_config("small")
    cand = lambda text, remat="none", **par: plan.Candidate(
        Layout.parse(text), validate.ParallelConfig(**par), dataclasses.replace(cfg, remat=remat))
    a = cand("fsdp4xtp2", zero=3, prefetch=True, tp_comm="sequence")
    assert published_plan.changes(a, a) == "none"
    # tp-comm stops applying on fsdp8 ("-"); zero does not apply to dp8
    assert published_plan.changes(a, cand("fsdp8", "dots", zero=3)) == (
        "layout fsdp4xtp2 -> fsdp8; prefetch True -> False; tp_comm sequence -> -; "
        "remat none -> dots")
    # prefetch applies under zero 3 only
    assert published_plan.changes(cand("dp8"), cand("fsdp8", zero=2)) == (
        "layout dp8 -> fsdp8; zero - -> 2")
    assert published_plan.changes(cand("dp8"), cand("fsdp8", zero=3)) == (
        "layout dp8 -> fsdp8; zero - -> 3; prefetch - -> False")
    for argv, word in ((["--rounds", "-1"], "rounds=-1"), (["--only", "no such run"], "no run")):
        assert published_plan.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and word in err, err


def test_switches_order_check_counts_only_pairs_apart_by_more_than_the_noise():
    from bench.switches import order_pairs

    measured = [1.00, 1.02, 1.20, 0.90]
    predicted = [1.0, 0.9, 1.1, 1.05]
    pairs = order_pairs(predicted, measured, noise=0.05)
    # (0, 1) are 2% apart: within the noise, not counted
    assert [q["pair"] for q in pairs] == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert [q["right"] for q in pairs] == [True, False, True, False, True]
    assert pairs[0]["measured_gap"] == pytest.approx(0.2)
    assert order_pairs(predicted, measured, noise=0.5) == []


def test_dot_passes_keeps_the_shared_flags_and_refuses_bad_counts(capsys):
    """bench/dot_passes.py: its own flags (and their values) are taken out of what every
    candidate parses; pass counts below 1 are one line, exit 2."""
    from bench import dot_passes

    own = dot_passes.own_parser()
    argv = ["--model", "tiny", "--passes", "1,3", "--candidate", "fsdp8 --zero 3", "--seq=64",
            "--repeats=2", "--batch", "8"]
    assert own.parse_known_args(argv)[1] == ["--model", "tiny", "--seq=64", "--batch", "8"]
    for bad in (["--passes", "0"], ["--passes", "1,x"], ["--repeats", "0"]):
        assert dot_passes.main(["--model", "tiny", *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --passes") and err.count("\n") == 1


def test_collective_context_chains_compute_the_same_values():
    """bench/collective_context.py times three chains that differ only in what each link
    adds after its matmul: nothing, a sync, an all-reduce over devices holding the same
    rows (so all_reduce / n is the identity). Their values must agree, or the timing
    compares different work."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench import collective_context

    mesh = jax.make_mesh((8,), ("d",))
    fs = collective_context.programs(mesh, chain=3)
    rows_rw = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
    x = jax.device_put(jnp.tile(rows_rw, (8, 1)), NamedSharding(mesh, P("d")))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (16, 16)) / 4,
                       NamedSharding(mesh, P()))
    want = rows_rw
    for _ in range(3):
        want = jnp.tanh(want @ w)
    for name, f in fs.items():
        np.testing.assert_allclose(f(x, w), jnp.tile(want, (8, 1)), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
