"""Context parallelism (`cp`): the load-balanced chunk layout, the all-gather attention
kernel, and the whole step under every cp layout equal to `single` in loss and grads.

As in test_tp_comm.py, params are drawn once with numpy (matrices N(0, 0.1²), so
attention is far from uniform and a wrong position or mask shows) and placed in each
layout, and programs are compiled with XLA's backend optimization off (compile time is
nearly all of this file's). Tolerances as in test_step.py.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_model as ref
from jax.sharding import PartitionSpec as P
from test_step import CFG, RTOL, TCFG, assert_tree_close, host, run
from test_tp_comm import compiled_loss_and_grads, random_params

import collectives
from engine.config import ConfigError, ParallelConfig, TrainConfig
from engine.parallel import validate
from engine.parallel.layout import Layout
from engine.parallel.params import activation_spec
from engine.run.data import synthetic_tokens
from engine.run.step import Trainer
from layers import context
from layers.kernels import KERNELS, BlockSizes
from layers.kernels.context import CP_COMMS, CP_KERNELS

CP_LAYOUTS = ["cp4xfsdp2", "cp2xfsdp2xtp2", "dp2xcp4", "cp8"]


def tokens(tcfg):
    return synthetic_tokens(tcfg.seed, 0, tcfg.batch, tcfg.seq, CFG.vocab)


def loss_and_grads(layout, init, cfg=CFG, tcfg=TCFG, parallel=ParallelConfig()):
    """(loss, grads, grad norm, the compiled program's collective ops) from host params."""
    lay = Layout.parse(layout)
    t = Trainer(cfg, tcfg, lay, lay.mesh(), parallel)
    return compiled_loss_and_grads(t, init, t.put_batch(tokens(tcfg)))


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, TCFG.seed)


def plain(init, tcfg):
    """Loss and grads of the plain jnp model (tests/reference_model.py), on the host."""
    loss, grads = jax.jit(jax.value_and_grad(ref.loss), static_argnums=2)(
        init, tokens(tcfg), CFG.n_layers)
    return float(loss), host(grads)


def assert_matches(got, want, what):
    loss, grads, gnorm, _ = got
    want_loss, want_grads = want
    want_gnorm = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want_grads))))
    assert abs(loss - want_loss) <= RTOL * abs(want_loss), f"{what} loss {loss} vs {want_loss}"
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm, f"{what} grad norm"
    assert_tree_close(grads, want_grads, what=f"{what} grads ")


@pytest.fixture(scope="module")
def single(init):
    got = loss_and_grads("single", init)
    assert_matches(got, plain(init, TCFG), "single vs plain model")
    return got[:2]


# -- the layout -------------------------------------------------------------------------
def test_cp_layouts_parse_and_fit():
    for text in CP_LAYOUTS:
        lay = Layout.parse(text)
        assert str(lay) == text and lay.size == 8
        validate.check(CFG, TCFG, ParallelConfig(), lay)
    axes = Layout.parse("dp2xcp4").role_axes()
    assert (axes.cp, axes.cp_size, axes.batch, axes.data, axes.data_size) == (
        "cp", 4, ("dp",), ("dp", "cp"), 8)
    assert activation_spec("residual", Layout.parse("cp2xfsdp2xtp2"), "sequence") == P(
        ("fsdp",), ("cp", "tp"), None)
    assert activation_spec("tokens", Layout.parse("cp4xfsdp2")) == P(("fsdp",), None)


@pytest.mark.parametrize("layout, tcfg, parallel, cfg, phrase", [
    ("cp4xfsdp2", TrainConfig(batch=8, seq=12), ParallelConfig(), CFG,
     "seq=12 not divisible by 8"),
    ("cp8", TrainConfig(batch=8, seq=24), ParallelConfig(), CFG,
     "seq=24 not divisible by 16"),
    ("cp2xtp4", TrainConfig(batch=8, seq=12), ParallelConfig(tp_comm="sequence"), CFG,
     "seq/cp=6 tokens over tp: not divisible by tp=4"),
    ("cp4xfsdp2", TCFG, ParallelConfig(cp_comm="nope"), CFG, "cp_comm='nope' not one of"),
    ("cp4xfsdp2", TCFG, ParallelConfig(), dataclasses.replace(CFG, attention="pallas"),
     "attention='pallas' takes no global offsets"),
])
def test_invalid_cp_is_refused_in_one_line(layout, tcfg, parallel, cfg, phrase):
    with pytest.raises(ConfigError) as e:
        validate.check(cfg, tcfg, parallel, Layout.parse(layout))
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_chunks_are_load_balanced_and_gather_back_in_order():
    """Rank i holds chunks i and 2cp-1-i with their global positions; all-gathering every
    rank's chunks and `natural_order` give the sequence back."""
    lay = Layout.parse("cp4")
    axes = lay.role_axes()
    x_BL = np.arange(2 * 24).reshape(2, 24).astype(np.int32)

    def body(x_BL):
        mine_BL = context.shard_sequence(x_BL, axes)
        pos_L = context.local_positions(mine_BL.shape[1], axes)
        back_BL = context.natural_order(collectives.gather(mine_BL, "cp", dim=1), 4)
        return mine_BL, pos_L[None], back_BL

    out_specs = (P(None, "cp"), P(None, "cp"), P("cp"))
    mine, pos, back = jax.jit(jax.shard_map(body, mesh=lay.mesh(), in_specs=P(),
                                            out_specs=out_specs))(x_BL)
    c = 3
    for i in range(4):
        want_L = np.concatenate([np.arange(i * c, i * c + c), np.arange((7 - i) * c, (8 - i) * c)])
        np.testing.assert_array_equal(np.asarray(pos)[0, 6 * i:6 * i + 6], want_L)
        np.testing.assert_array_equal(np.asarray(mine)[:, 6 * i:6 * i + 6], x_BL[:, want_L])
        np.testing.assert_array_equal(np.asarray(back)[2 * i:2 * i + 2], x_BL)


@pytest.mark.parametrize("comm, kernel", [
    *(pytest.param(comm, "reference", marks=pytest.mark.slow) for comm in CP_COMMS),
    pytest.param("allgather", "chunked", marks=pytest.mark.slow),
    ("allgather", "blocked"), ("ring", "blocked")])
def test_cp_attention_matches_dense_values_and_grads(comm, kernel, monkeypatch):
    """Each cp kernel alone on cp4 (chunks of c=5; the local kernels with tiles of 4, so
    tiles straddle chunk edges): outputs and dq, dk, dv equal the dense causal attention
    of the whole sequence (GQA: 4 query heads over 2 kv heads)."""
    lay = Layout.parse("cp4")
    axes = lay.role_axes()
    B, L, H, G, K = 2, 40, 4, 2, 8
    small = {"chunked": BlockSizes(block_q=4), "blocked": BlockSizes(block_k=4)}
    attend = CP_COMMS[comm]
    if kernel in small and comm == "allgather":
        monkeypatch.setitem(CP_KERNELS, kernel,
                            functools.partial(KERNELS[kernel], blocks=small[kernel]))
    elif kernel in small:
        attend = functools.partial(attend, blocks=small[kernel])
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in
               [(B, L, H, K), (B, L, G, K), (B, L, G, K)])
    w = rng.normal(size=(B, L, H, K)).astype(np.float32)

    def local(q, k, v, w):  # whole sequences in, this rank's chunks through the kernel
        cut = lambda x: context.shard_sequence(x, axes)
        o = attend(cut(q), cut(k), cut(v), axes=axes, kernel=kernel)
        return collectives.all_reduce(jnp.sum(o * cut(w)), "cp")

    sharded = jax.jit(jax.value_and_grad(
        jax.shard_map(local, mesh=lay.mesh(), in_specs=P(), out_specs=P()), argnums=(0, 1, 2)))
    dense = jax.jit(jax.value_and_grad(lambda q, k, v, w: jnp.sum(ref.dense_attention(q, k, v) * w),
                                       argnums=(0, 1, 2)))
    got, want = host(sharded(q, k, v, w)), host(dense(q, k, v, w))
    assert abs(got[0] - want[0]) <= RTOL * abs(want[0])
    assert_tree_close(got[1], want[1], what="dq, dk, dv ")


@pytest.mark.parametrize("kernel", ["chunked", "blocked"])
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("q_offset, k_offset", [
    (5, 3), *(pytest.param(q, k, marks=pytest.mark.slow) for q, k in [(16, 0), (30, 2), (0, 0)])])
def test_local_kernels_take_global_offsets(kernel, traced, q_offset, k_offset):
    """chunked and blocked with q_offset / k_offset (static ints, or traced int32 as a cp
    rank's chunk offsets are) equal the dense reference at the same offsets: values and
    dq, dk, dv (f32, L=24 queries against S=40 keys, tiles of 8)."""
    if (q_offset, k_offset) == (0, 0) and not traced:
        pytest.skip("no offsets: test_flash.py")
    B, L, S, H, G, K = 2, 24, 40, 4, 2, 8
    rng = np.random.default_rng(2)
    q, w = (rng.normal(size=(B, L, H, K)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(B, S, G, K)).astype(np.float32) for _ in range(2))

    def run(attend, traced):
        def f(q, k, v, qo, ko):
            qo, ko = (qo, ko) if traced else (q_offset, k_offset)
            return jnp.sum(attend(q, k, v, q_offset=qo, k_offset=ko) * w)
        return host(jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(
            q, k, v, jnp.int32(q_offset), jnp.int32(k_offset)))

    got = run(functools.partial(KERNELS[kernel], blocks=BlockSizes(8, 8)), traced)
    want = run(ref.dense_attention, traced=False)  # the oracle's mask is built statically
    assert abs(got[0] - want[0]) <= RTOL * abs(want[0])
    assert_tree_close(got[1], want[1], what=f"{kernel} dq, dk, dv ")


@pytest.mark.parametrize("q_offset", [8, "traced"])
def test_blocked_skips_key_blocks_no_query_sees(q_offset):
    """Queries at positions 8..15 against keys 0..31 in blocks of 8: blocks 2 and 3 are
    invisible. NaN in their values would reach the output through any product with them
    (0 x NaN is NaN), so finite values and grads equal to attention over the first two
    blocks show those blocks were never computed."""
    B, L, S, H, G, K = 1, 8, 32, 2, 1, 4
    rng = np.random.default_rng(3)
    q = rng.normal(size=(B, L, H, K)).astype(np.float32)
    k, v = (rng.normal(size=(B, S, G, K)).astype(np.float32) for _ in range(2))
    v[:, 16:] = np.nan

    def f(q, k, v, off):
        return jnp.sum(KERNELS["blocked"](q, k, v, q_offset=off if q_offset == "traced" else 8,
                                          blocks=BlockSizes(8, 8)))

    value, grads = host(jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v, jnp.int32(8)))
    want, want_grads = host(jax.value_and_grad(
        lambda q, k, v: jnp.sum(ref.dense_attention(q, k, v, q_offset=8)), argnums=(0, 1, 2))(
            q, k[:, :16], v[:, :16]))
    assert np.isfinite(value) and abs(value - want) <= RTOL * abs(want)
    assert_tree_close(grads[0], want_grads[0], what="dq ")
    assert_tree_close(grads[1][:, :16], want_grads[1], what="dk ")
    assert np.all(grads[1][:, 16:] == 0) and np.all(grads[2][:, 16:] == 0)


# -- the whole step ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", CP_LAYOUTS)
def test_cp_layout_matches_single(layout, init, single):
    got = loss_and_grads(layout, init)
    assert_matches(got, single, layout)
    assert "all-gather" in got[3]  # K and V over cp (and params over fsdp)


@pytest.mark.parametrize("layout", [
    "cp4xfsdp2", "cp8", *(pytest.param(lay, marks=pytest.mark.slow)
                          for lay in ("cp2xfsdp2xtp2", "dp2xcp4"))])
def test_cp_ring_matches_single(layout, init, single):
    got = loss_and_grads(layout, init, parallel=ParallelConfig(cp_comm="ring"))
    assert_matches(got, single, f"{layout} ring")
    assert "collective-permute" in got[3]  # K and V around the cp ring


@pytest.mark.parametrize("layout, parallel", [
    ("cp2xtp4", ParallelConfig()),  # tp=4 > G=2 kv heads: kv weights replicated over tp
    ("cp2xfsdp2xtp2", ParallelConfig(tp_comm="sequence")),
    pytest.param("cp2xfsdp2xtp2", ParallelConfig(tp_comm="ring"), marks=pytest.mark.slow),
    pytest.param("cp4xfsdp2", ParallelConfig(zero=1), marks=pytest.mark.slow),
    pytest.param("cp4xfsdp2", ParallelConfig(zero=2), marks=pytest.mark.slow),
    pytest.param("cp4xfsdp2", ParallelConfig(prefetch=True), marks=pytest.mark.slow),
])
def test_cp_composes_with_tp_and_zero(layout, parallel, init, single):
    assert_matches(loss_and_grads(layout, init, parallel=parallel), single,
                   f"{layout} {parallel}")


@pytest.mark.parametrize("kernel, comm", [
    ("blocked", "ring"), *(pytest.param(k, c, marks=pytest.mark.slow)
                           for k, c in [("chunked", "allgather"), ("chunked", "ring"),
                                        ("blocked", "allgather")])])
def test_cp_step_with_local_kernels_matches_single(kernel, comm, init, single):
    """cp4xfsdp2 with the chunked or blocked kernel (allgather: per local chunk; ring:
    blocked runs each step's tile, chunked is the ring's dense tiles)."""
    cfg = dataclasses.replace(CFG, attention=kernel)
    assert_matches(loss_and_grads("cp4xfsdp2", init, cfg=cfg,
                                  parallel=ParallelConfig(cp_comm=comm)),
                   single, f"cp4xfsdp2 {kernel} {comm}")


def test_odd_chunks_match_the_plain_model(init):
    """seq 24 on cp4: chunks of 3 tokens (odd), compared with the plain model."""
    tcfg = dataclasses.replace(TCFG, seq=24)
    assert_matches(loss_and_grads("cp4xfsdp2", init, tcfg=tcfg), plain(init, tcfg),
                   "cp4xfsdp2 seq 24")


@pytest.mark.slow
def test_cp_training_steps_match_single():
    """Three optimizer steps from the engine's init (test_step.run): losses, and params
    after them, as under `single`."""
    got, want = run("cp4xfsdp2"), run("single")
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
    assert_tree_close(got["params"], want["params"], atol=1e-2 * TCFG.lr,
                      what="cp4xfsdp2 params after 3 steps ")


@pytest.mark.slow
@pytest.mark.parametrize("comm", list(CP_COMMS))
def test_cp_bf16_stays_close_to_f32(comm, init, single):
    """bf16 compute under cp4xfsdp2 (bf16 K/V gathered or passed around the ring):
    within the bounds test_step.py gives bf16 against f32."""
    cfg = dataclasses.replace(CFG, dtype="bf16")
    loss, _, gnorm, _ = loss_and_grads("cp4xfsdp2", init, cfg=cfg,
                                       parallel=ParallelConfig(cp_comm=comm))
    want_gnorm = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(single[1]))))
    assert abs(loss - single[0]) <= 1e-2 * single[0]
    assert abs(gnorm - want_gnorm) <= 5e-2 * want_gnorm


@pytest.mark.slow
def test_cp_checkpoint_resumes_on_other_layouts_and_back(tmp_path):
    """One step under cp4xfsdp2, saved; loaded under fsdp4xtp2 and single (values
    identical) the next step's loss equals the cp run's; saved again from fsdp4xtp2 and
    loaded back under cp8, the same."""
    from test_checkpoint import (
        assert_same,
        batch,
        flat_host,
        host_state,
        meta,
        trainer as ck_trainer,
    )

    from engine.run import checkpoint

    for sub in ("cp", "back"):
        (tmp_path / sub).mkdir()
    t = ck_trainer("cp4xfsdp2")
    params, opt_state = checkpoint.restore(host_state(t, 0), t)
    params, opt_state, _ = t.train_step(params, opt_state, batch(t, 0))
    path = checkpoint.save(str(tmp_path / "cp"), 1, params, opt_state,
                           meta(layout="cp4xfsdp2"), 2)
    want = float(t.loss(params, batch(t, 1)))
    for layout in ("fsdp4xtp2", "single"):
        other = ck_trainer(layout)
        ckpt = checkpoint.read(path)
        loaded = checkpoint.restore(ckpt, other)
        assert_same(flat_host(loaded[0]), ckpt.params)
        assert abs(float(other.loss(loaded[0], batch(other, 1))) - want) <= RTOL * abs(want)
    back_path = checkpoint.save(str(tmp_path / "back"), 1, *checkpoint.restore(
        checkpoint.read(path), ck_trainer("fsdp4xtp2")), meta(layout="fsdp4xtp2"), 2)
    cp8 = ck_trainer("cp8")
    back = checkpoint.restore(checkpoint.read(back_path), cp8)
    assert_same(flat_host(back[0]), checkpoint.read(path).params)
    assert abs(float(cp8.loss(back[0], batch(cp8, 1))) - want) <= RTOL * abs(want)


def test_decoding_under_cp_refused_in_one_line():
    found = validate.decoder_problems(CFG, Layout.parse("cp2xtp4"), 2, 32, None)
    assert len(found) == 1 and "without cp" in found[0]
