"""Cost model: ledger FLOPs and collective bytes against closed forms, the compiled-HLO
audit's helpers, pricing formulas, and a 512-device prediction traced on one CPU (the
audit: test_audit.py; the bytes of single ops and scans: test_cost_bytes.py)."""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import calibration, hardware
from engine.cost.ledger import Row, step_ledger
from engine.cost.memory import compile_step
from engine.cost.price import collective_seconds, predict, predicted_mfu
from engine.parallel.layout import Layout
from engine.run.mfu import flops_per_token

# tp up to 8 needs 8 heads; G=2 exercises both kv rules (tp <= G sharded, tp > G replicated)
CFG = dict(n_heads=8, n_kv_heads=2, head_dim=8)
TCFG = TrainConfig(batch=8, seq=32)


def compiled_text(trainer, compiler_options: dict | None = None) -> str:
    """HLO text of `trainer.train_step` compiled for its (concrete) mesh, from shapes only."""
    return compile_step(trainer, compiler_options).as_text()


def _cfg(dtype="f32", remat="full"):
    return model_config("tiny", dtype=dtype, remat=remat, **CFG)


@functools.lru_cache(maxsize=None)
def _compiled(layout: str, dtype: str) -> str:
    from engine.run.step import Trainer

    lay = Layout.parse(layout)
    return compiled_text(Trainer(_cfg(dtype), TCFG, lay, lay.mesh()))


def _flops(rows, phases, kind="matmul"):
    return sum(r.total_flops for r in rows if r.kind == kind and r.phase in phases)


@pytest.mark.parametrize("layout", ["single", "fsdp4xtp2"])
def test_ledger_flops_match_model_formula(layout):
    """fwd + bwd matmul FLOPs summed over devices = 6 * (non-embedding params) * tokens
    + 12 N H K L * tokens (engine.run.mfu, PaLM's count: full, non-causal score matmuls).
    Remat recompute is hardware FLOPs, not model FLOPs: it is checked separately against
    the blocks' forward matmuls minus the MLP down projection, whose output the backward
    never needs (jax dead-code-eliminates it from the rematted forward)."""
    cfg, lay = _cfg(), Layout.parse(layout)
    rows = step_ledger(cfg, TCFG, lay)
    tokens = TCFG.batch * TCFG.seq
    model = flops_per_token(cfg, TCFG.seq) * tokens
    assert _flops(rows, ("fwd", "bwd")) * lay.size == pytest.approx(model, rel=0.02)
    D, H, G, K, F, N, L = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                           cfg.n_layers, TCFG.seq)
    recompute = N * tokens * (2 * D * (2 * H * K + 2 * G * K) + 4 * D * F + 4 * H * K * L)
    assert _flops(rows, ("recompute",)) * lay.size == pytest.approx(recompute, rel=0.02)


def _bytes_by(rows):
    out = collections.Counter()
    for r in rows:
        if r.kind == "collective" and r.bytes:
            out[(r.primitive, tuple(sorted(r.axes)))] += r.total_bytes
    return out


@pytest.mark.parametrize("layout", ["fsdp8", "fsdp4xtp2", "dp2xfsdp2xtp2"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_collective_bytes_match_hand_formulas(layout, dtype):
    """Per device per step, with tp <= G (kv heads sharded), itemsize c of the compute
    dtype, B_b = B / (dp * fsdp) local sequences:
    - fsdp all-gather: block weights per tp shard, cast to c, gathered in the forward and
      again in the remat'd backward: 2 N (2DHK + 2DGK + 3DF) / tp * c, plus the f32
      embedding V D / tp * 4 and the unembedding D V / tp * c, once each;
    - fsdp reduce-scatter: the same, once per step (the transpose of each gather);
    - tp all-reduce of activations [B_b, L, D] f32: per layer 2 forward, 1 recomputed
      (attention; the MLP output is dead in the backward), 2 backward; plus the embedding
      forward and the loss backward: (5 N + 2) B_b L D 4;
    - dp all-reduce of grads: every fsdp-sharded param's local shard in f32."""
    cfg, lay = _cfg(dtype), Layout.parse(layout)
    dp, fsdp, tp = (lay.degree(r) for r in ("dp", "fsdp", "tp"))
    D, H, G, K, F, N, V, L = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              cfg.mlp_dim, cfg.n_layers, cfg.vocab, TCFG.seq)
    c = 2 if dtype == "bf16" else 4
    block = (2 * D * H * K + 2 * D * G * K + 3 * D * F) // tp
    got = _bytes_by(step_ledger(cfg, TCFG, lay))
    assert got[("all_gather", ("fsdp",))] == 2 * N * block * c + V * D // tp * 4 + D * V // tp * c
    assert got[("reduce_scatter", ("fsdp",))] == N * block * c + V * D // tp * 4 + D * V // tp * c
    b_local = TCFG.batch // (dp * fsdp)
    if tp > 1:
        assert got[("psum_invariant", ("tp",))] == (
            (5 * N + 2) * b_local * L * D * 4 + 2 * b_local * L * 4)
    if dp > 1:
        sharded = (2 * V * D + N * block * tp) // (fsdp * tp)
        assert got[("psum_invariant", ("dp",))] == sharded * 4


def test_the_ledger_traces_the_targets_weight_gather():
    """bf16 weights are gathered as uint32 pairs for a target that widens bf16
    collectives (the CPU profile), as themselves for one that does not (every
    accelerator profile); the bytes they move are the same."""
    cfg, lay = _cfg("bf16"), Layout.parse("fsdp8")
    packed, plain = (step_ledger(cfg, TCFG, lay, pack=p) for p in (True, False))

    def gathered(rows):
        return {r.dtype for r in rows if r.primitive == "all_gather" and r.bytes}

    assert "uint32" in gathered(packed) and "uint32" not in gathered(plain)
    assert _bytes_by(packed) == _bytes_by(plain)
    assert calibration.cpu_defaults().bf16_collectives_in_f32
    assert not any(hardware.get(n).bf16_collectives_in_f32 for n in ("v5e", "h100", "a100"))


def test_ring_formulas_on_a_tpu():
    """all-gather over an axis inside one slice: (n-1)/n * bytes / (ICI * eff) + (n-1)
    hops; all-reduce twice that; over an axis spanning slices: the DCN rate. (GPU
    profiles price collectives as NCCL runs them: tests/test_nccl.py.)"""
    hw = hardware.get("v5e")
    mesh = (("dp", 4), ("fsdp", 8))
    ici = hw.fast.bandwidth * hw.link_eff
    row = Row("mlp", "fwd", "collective", "all_gather", "bfloat16", (1,), 0.0, 8e6, 1,
              ("fsdp",), 8)
    expect = 7 / 8 * 8e6 / ici + 7 * hw.fast.latency
    assert collective_seconds(row, hw, mesh) == pytest.approx(expect)
    ar = Row("mlp", "fwd", "collective", "psum", "float32", (1,), 0.0, 8e6, 1, ("fsdp",), 8)
    assert collective_seconds(ar, hw, mesh) == pytest.approx(2 * expect)
    across_mesh = (("dp", 4), ("fsdp", 256))
    across = Row("mlp", "fwd", "collective", "all_gather", "bfloat16", (1,), 0.0, 8e6, 1,
                 ("dp",), 4)
    assert collective_seconds(across, hw, across_mesh) == pytest.approx(
        3 / 4 * 8e6 / (hw.slow.bandwidth * hw.link_eff) + 3 * hw.slow.latency)
    a2a = Row("mlp", "fwd", "collective", "all_to_all", "bfloat16", (1,), 0.0, 8e6, 1,
              ("fsdp",), 8)  # pairwise exchange: as an all-gather of the same buffer
    assert collective_seconds(a2a, hw, mesh) == pytest.approx(expect)


def test_an_axis_spanning_torus_dimensions_runs_a_ring_on_each():
    """fsdp64 on a v5p slice fills a 4x4x4 cube: its rings run on all three dimensions
    at once (3x one dimension's bandwidth) in 3 x 3 hops; 8 chips of a v5e row stay on
    one dimension of its 16x16 torus."""
    hw = hardware.get("v5p")
    ici = hw.fast.bandwidth * hw.link_eff
    row = Row("mlp", "fwd", "collective", "all_gather", "bfloat16", (1,), 0.0, 8e6, 1,
              ("fsdp",), 64)
    assert collective_seconds(row, hw, (("fsdp", 64),)) == pytest.approx(
        63 / 64 * 8e6 / (3 * ici) + 9 * hw.fast.latency)
    ar = dataclasses.replace(row, primitive="psum")
    assert collective_seconds(ar, hw, (("fsdp", 64),)) == pytest.approx(
        2 * 63 / 64 * 8e6 / (3 * ici) + 18 * hw.fast.latency)


def test_predict_only_512_devices():
    """llama3-8b on fsdp64xtp8 traces on an AbstractMesh on one CPU and prices sanely."""
    cfg = model_config("llama3-8b", dtype="bf16", remat="full")
    tcfg = TrainConfig(batch=64, seq=1024)
    lay = Layout.parse("fsdp64xtp8")
    rows = step_ledger(cfg, tcfg, lay)
    sizes = {r.axis_size for r in rows if r.kind == "collective" and r.bytes}
    assert sizes >= {64, 8}
    assert _flops(rows, ("fwd", "bwd")) * lay.size == pytest.approx(
        flops_per_token(cfg, tcfg.seq) * tcfg.batch * tcfg.seq, rel=0.02)
    pred = predict(rows, hardware.get("h100"), lay.mesh_axes())
    assert pred.step_s >= pred.compute_s > 0 and pred.comm_s > 0
    assert 0 < predicted_mfu(pred, cfg, tcfg, hardware.get("h100"), lay.size) < 1
    assert math.isfinite(pred.step_s)


# ~20 s of microbenchmarks; tests/test_roofline_cli.py checks in-run rates by default
@pytest.mark.slow
def test_in_run_rates_price_every_dot_and_collective_by_its_measurement():
    """The in-run profile times each distinct dot and each distinct collective of the
    ledger on all devices at once; pricing then charges each matmul and collective row
    exactly its measured seconds x count, and compute is no longer multiplied by the
    device count."""
    import jax

    from engine.cost.microbench import in_run_profile
    from engine.cost.price import collective_key, hideable

    lay = Layout.parse("fsdp2")
    rows = step_ledger(_cfg(), TCFG, lay)
    hw = in_run_profile(hardware.get("cpu"), rows, jax.devices()[:2],
                        collective_sizes=[1 << 12, 1 << 14])
    dots = [r for r in rows if r.kind == "matmul"]
    assert dots and all(r.dot in hw.dot_seconds for r in dots)
    assert len(hw.dot_seconds) == len({r.dot for r in dots}) > 1
    assert hw.concurrent_rates and hw.hbm > 0 and hw.vector_flops > 0
    assert hw.transcendental_flops > 0 and hw.fault_cost > 0 and hw.relayout_bw > 0
    assert hw.cold_hbm > 0
    pred = predict(rows, hw, lay.mesh_axes())
    priced = sum(p.seconds for p in pred.rows if p.row.kind == "matmul")
    assert priced == pytest.approx(sum(hw.dot_seconds[r.dot] * r.count for r in dots))
    assert set(hw.collective_fit) >= {"all-gather", "reduce-scatter", "all-reduce"}
    moved = [r for r in rows if r.kind == "collective" and r.bytes and r.axis_size > 1]
    assert {collective_key(r)[0] for r in moved} >= {"all-gather", "reduce-scatter"}
    assert set(hw.collective_seconds) == {collective_key(r) for r in moved}
    assert all(t > 0 for t in hw.collective_seconds.values())
    priced = sum(p.seconds for p in pred.rows if p.row in moved)
    beside = lambda r: 1 + hw.beside_cost if hideable(r) else 1  # noqa: E731
    assert hw.beside_cost >= 0 and any(hideable(r) for r in moved)
    assert priced == pytest.approx(
        sum(hw.collective_seconds[collective_key(r)] * r.count * beside(r) for r in moved))


def test_group_collectives_run_in_groups_of_the_rows_size():
    """A collective over a sub-axis is timed with the devices split into groups of its
    size: an all-reduce over 2 of 4 devices sums 2 devices' operands, not 4 (checked by
    running the op the timing compiles on values that tell the groups apart)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from engine.cost import microbench_comm
    from engine.cost.price import collective_key

    row = Row("mlp", "fwd", "collective", "psum", "float32", (8,), 0.0, 32.0, 3,
              ("tp",), 2)
    key = collective_key(row)
    assert key == ("all-reduce", 2, 32, "float32")
    devices = jax.devices()[:4]
    times = microbench_comm.group_collective_seconds([row], devices, reps=1)
    assert set(times) == {key} and times[key] > 0
    mesh = Mesh(np.array(devices).reshape(2, 2), ("r", "d"))
    spec = P(("r", "d"))
    f = jax.jit(jax.shard_map(microbench_comm.COLLECTIVE_OPS["all-reduce"], mesh=mesh,
                              in_specs=spec, out_specs=spec))
    x = jnp.repeat(jnp.arange(4.0), 8)  # device i holds 8 copies of i
    got = np.asarray(f(jax.device_put(x, NamedSharding(mesh, spec))))
    np.testing.assert_array_equal(got, np.repeat([1.0, 1.0, 5.0, 5.0], 8))


def test_an_all_reduce_is_timed_between_the_matmuls_that_feed_it(monkeypatch):
    """`group_collective_seconds` times an all-reduce with `in_chain_seconds` (a chain
    x = all_reduce(tanh(x @ w)) / g against the same chain without it) and other kinds
    with `collective_run`. The two chains it times must compute the same values when the
    devices of a group hold the same rows and groups hold different ones: each group's
    result is its own rows' plain chain, which a reduction over the wrong devices would
    mix. The seconds are the paired difference over the links."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from engine.cost import microbench_comm
    from engine.cost.price import collective_key

    paired = []
    monkeypatch.setattr(microbench_comm, "paired_seconds", lambda f, base, *args, reps: (
        paired.append((f, base, args)) or 2.0))
    monkeypatch.setattr(microbench_comm, "collective_run", lambda kind, *a: 3.0)
    ar = Row("mlp", "fwd", "collective", "psum", "float32", (64,), 0.0, 256.0, 3, ("tp",), 2)
    rs = dataclasses.replace(ar, primitive="reduce_scatter")
    devices = jax.devices()[:4]
    timed = microbench_comm.group_collective_seconds([ar, rs], devices, reps=1)
    assert timed == {collective_key(ar): 2.0 / microbench_comm.CHAIN_LINKS,
                     collective_key(rs): 3.0}
    (reduce, plain, (x, w)), = paired
    assert x.shape == (4, 64) and w.shape == (64, 64)  # 64 elements a device, W = 64
    mesh = x.sharding.mesh
    assert mesh.devices.shape == (2, 2)
    rows_gw = jax.random.normal(jax.random.key(0), (2, 64), jnp.float32)
    w_ww = jax.random.normal(jax.random.key(1), (64, 64), jnp.float32) / 8
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    x = put(jnp.repeat(rows_gw, 2, axis=0), P(("r", "d")))  # devices (r, d) in order
    w = put(w_ww, P())
    want = rows_gw
    for _ in range(microbench_comm.CHAIN_LINKS):
        want = jnp.tanh(want @ w_ww)
    for f in (reduce, plain):
        np.testing.assert_allclose(f(x, w), jnp.repeat(want, 2, axis=0), rtol=1e-5,
                                   atol=1e-6)


def test_a_measured_collective_is_priced_at_its_measurement():
    """`Hardware.collective_seconds` prices a collective row whose key it holds at that
    time, whatever the fit says; any other row keeps the fit's ring formula."""
    from engine.cost.price import collective_key

    row = Row("mlp", "fwd", "collective", "psum", "float32", (256,), 0.0, 1024.0, 1,
              ("tp",), 2)
    other = row.replace(bytes=2048.0)
    hw = dataclasses.replace(calibration.cpu_defaults(),
                             collective_seconds={collective_key(row): 0.125})
    assert collective_seconds(row, hw, (("tp", 2),)) == 0.125
    latency, bw = hw.collective_fit["all-reduce"]
    assert collective_seconds(other, hw, (("tp", 2),)) == pytest.approx(
        2048 / bw + 2 * latency)


def test_exp_and_its_kind_are_priced_at_the_transcendental_rate():
    """An elementwise row of `price.TRANSCENDENTAL` costs FLOPs / transcendental_flops
    and any other FLOPs / vector_flops; a profile without the rate prices both at
    vector_flops. Checked on every exp-like row of a traced step and on its multiplies."""
    from engine.cost.price import TRANSCENDENTAL, compute_seconds

    rows = step_ledger(_cfg(), TCFG, Layout.parse("single"))
    exps = [r for r in rows if r.primitive in TRANSCENDENTAL]
    muls = [r for r in rows if r.primitive == "mul" and r.flops]
    assert {r.primitive for r in exps} >= {"exp", "logistic"} and muls
    base = dataclasses.replace(hardware.get("h100"), vector_flops=1e9, hbm=1e30)
    split = dataclasses.replace(base, transcendental_flops=1e7)
    for r in exps + muls:
        rate = 1e7 if r in exps else 1e9
        assert compute_seconds(r, split, 1) == (pytest.approx(r.flops / rate), "compute")
        assert compute_seconds(r, base, 1)[0] == pytest.approx(r.flops / 1e9)


def test_page_faults_add_every_devices_mapped_bytes_spread_over_the_cores(monkeypatch):
    """A step's page faults cost each device's bytes mapped anew x `fault_cost`, summed
    over the devices and spread over min(devices, cores), and add to the predicted step,
    pipelined or not; nothing without mapped bytes or without a fault cost."""
    from engine.cost import price
    from engine.cost.pipeline import predict_step

    monkeypatch.setattr(price.os, "cpu_count", lambda: 2)
    hw = dataclasses.replace(calibration.cpu_defaults(), fault_cost=1e-9)
    assert price.fault_seconds(hw, 1, 1e8) == pytest.approx(0.1)
    assert price.fault_seconds(hw, 8, 1e8) == pytest.approx(8 * 0.1 / 2)
    assert price.fault_seconds(hw, 8, 0) == 0.0
    assert price.fault_seconds(dataclasses.replace(hw, fault_cost=0.0), 8, 1e8) == 0.0
    for layout, par in (("fsdp4xtp2", ParallelConfig()),
                        ("pp2xfsdp4", ParallelConfig(microbatches=2))):
        lay = Layout.parse(layout)
        rows = step_ledger(_cfg(), TrainConfig(batch=8, seq=32), lay, par)
        bare, _ = predict_step(rows, hw, lay, par)
        faulted, pipe = predict_step(rows, hw, lay, par, mapped_bytes=1e8)
        assert bare.fault_s == 0.0 and faulted.fault_s == pytest.approx(0.4)
        assert faulted.step_s == pytest.approx(bare.step_s + 0.4)
        assert pipe is None or pipe.step_s == faulted.step_s


def test_canonical_dot_keeps_the_matmul():
    """The canonical [batch, M, K] x [batch, K, N] form of each ledger dot does the same
    FLOPs as the dot the ledger counted."""
    from engine.cost.microbench import canonical_dot

    rows = [r for r in step_ledger(_cfg(), TCFG, Layout.parse("fsdp4xtp2")) if r.dot]
    assert len({r.dot for r in rows}) > 5
    for r in rows:
        (b, m, k), (b2, k2, n) = canonical_dot(*r.dot[:2], r.dot[4])
        assert (b, k) == (b2, k2) and 2 * b * m * k * n == r.flops, r.dot


def test_dot_seconds_keeps_each_dots_fastest_pass(monkeypatch):
    """With passes, every dot is timed once per pass over all of them (a slow spell of
    the host falls on a few dots of one pass) and its fastest pass kept; each dot's
    programs are built once, not once per pass."""
    from engine.cost import microbench

    rows = [r for r in step_ledger(_cfg(), TCFG, Layout.parse("fsdp4xtp2")) if r.dot]
    dots = sorted({r.dot for r in rows}, key=repr)
    built, calls, clock = [], [], iter([5.0, 3.0, 9.0, 4.0, 1.0, 7.0] * 100)

    def timer(mesh, fn, shapes_dtypes, reps=5):
        key = dots[len(built)]
        built.append(key)

        def seconds():
            calls.append(key)
            return next(clock)
        return seconds

    monkeypatch.setattr(microbench, "_device_timer", timer)
    out = microbench.dot_seconds(rows, None, passes=3)
    assert built == dots and calls == dots * 3  # built once; pass after pass in one order
    ticks = [5.0, 3.0, 9.0, 4.0, 1.0, 7.0] * 100
    n = len(dots)
    assert out == {d: min(ticks[i], ticks[n + i], ticks[2 * n + i]) for i, d in enumerate(dots)}
    built.clear(), calls.clear()
    assert microbench.dot_seconds(rows, None)[dots[0]] == ticks[3 * n]  # one pass
    assert calls == dots


def test_paired_seconds_subtracts_each_dispatch_timed_beside_its_program(monkeypatch):
    """The program and its dispatch are timed in alternating pairs and the median of
    the pairs' differences kept: a dispatch slowed by a busy moment is subtracted from
    the program timed beside it, not from every collective (the old single dispatch
    timing, larger than a small collective's whole time, priced it at nothing)."""
    from engine.cost import microbench

    now, order = [0.0], []
    monkeypatch.setattr(microbench.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(microbench.jax, "block_until_ready", lambda x: x)
    program_s = iter([9.0, 3.0, 4.0, 8.0, 3.5, 5.0])  # warm-up first
    dispatch_s = iter([9.0, 1.0, 2.5, 6.0, 1.0, 4.5])

    def run(name, seconds):
        def f(x):
            order.append(name)
            now[0] += next(seconds)
            return x
        return f

    got = microbench.paired_seconds(run("p", program_s), run("d", dispatch_s), 0, reps=5)
    assert order == ["p", "d"] + ["p", "d"] * 5
    assert got == 2.0  # differences 2, 1.5, 2, 2.5, 0.5: median 2
    order.clear()
    slower_dispatch = iter([1.0] * 6)
    faster_program = iter([0.5] * 6)
    assert microbench.paired_seconds(run("p", faster_program), run("d", slower_dispatch), 0,
                                     reps=5) == 1e-7


def test_paused_gc_restores_the_collector():
    """`ledger.paused_gc` turns the collector off for its block and back to what it was
    after it, nested or not, on an error too."""
    import gc

    from engine.cost.ledger import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_gc():
        raise ValueError
    assert gc.isenabled()


def test_row_replace_is_dataclasses_replace():
    """`Row.replace` (the walk's and pipeline pricing's cheap copy) gives the Row
    `dataclasses.replace` gives, and leaves the original and frozenness alone."""
    row = Row("mlp", "fwd", "matmul", "dot_general", "float32", (4, 8), 64.0, 96.0, 2,
              dot=((4, 2), (2, 8), "float32", "float32", (((1,), (0,)), ((), ())), "float32"))
    for changes in ({"count": 6}, {"fused_bytes": 0.0, "lib_bytes": 0.0},
                    {"kernel": "blocked", "fusion": 3}):
        got, want = row.replace(**changes), dataclasses.replace(row, **changes)
        assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
        assert got is not row and row.count == 2 and row.kernel == ""
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.count = 1


def test_a_cond_counts_its_costliest_branch():
    """A device runs one branch of a cond: the ledger holds the rows of the branch with
    the most FLOPs (two dots against one), in a scan's body too (its count)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost.ledger import ledger

    def step(p, x_BD, w_DD):
        return lax.cond(p, lambda x: jnp.tanh(x @ w_DD),
                        lambda x: (x @ w_DD) @ w_DD, x_BD)

    def scanned(p, x_BD, w_DD):
        return lax.scan(lambda c, _: (step(p, c, w_DD), None), x_BD, None, length=3)[0]

    x, w = jnp.ones((16, 32), jnp.float32), jnp.ones((32, 32), jnp.float32)
    for f, count in ((step, 1), (scanned, 3)):
        rows = ledger(jax.make_jaxpr(f)(True, x, w), Layout.parse("single"))
        dots = [r for r in rows if r.primitive == "dot_general"]
        assert [r.count for r in dots] == [count, count]
        assert not [r for r in rows if r.primitive == "tanh"]


def test_cp_ring_counts_one_remote_tile_a_step():
    """The cp ring's forward score tiles, per device: its own chunk's [L, L] tile, then
    at each of the cp - 1 remote steps one of two [L, L/2] tiles (a `lax.cond`: the
    remote block's first keys against every query, or every key against the second
    queries), each tile two dots (scores, values) of 2 B H K FLOPs a score."""
    cfg, cp = _cfg(remat="none"), 4
    rows = step_ledger(cfg, TCFG, Layout.parse(f"cp{cp}"), ParallelConfig(cp_comm="ring"))
    L = TCFG.seq // cp
    scores = L * L + (cp - 1) * L * L // 2
    want = 2 * 2 * TCFG.batch * cfg.n_heads * cfg.head_dim * scores * cfg.n_layers
    tiles = [r for r in rows if r.kind == "matmul" and r.phase == "fwd" and len(r.shape) == 5]
    assert sum(r.total_flops for r in tiles) == want
