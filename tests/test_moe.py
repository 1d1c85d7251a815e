"""Mixture of experts (layers/moe.py) and the ep axis.

The oracle is a plain per-token loop: for every token, its router softmax, its top-K
experts in order, each expert's SwiGLU on that token alone, weighted by the router prob
(`moe_reference`), with a capacity counted token by token per sequence in k-major order.
It shares no code with layers/moe.py (no buffers, no slots, no all-to-all). The MoE layer
alone and the whole single-device step are checked against it (values and grads), then
every ep layout against `single` (tolerances as in test_step.py).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_model as ref
from test_step import RTOL, TCFG, assert_tree_close, host, tokens
from test_tp_comm import compiled_loss_and_grads, random_params

from engine.config import ConfigError, ParallelConfig, TrainConfig, model_config
from engine.parallel.layout import Layout
from engine.parallel.validate import check
from engine.run.step import Trainer
from layers import moe
from layers.axes import Axes

CFG = model_config("moe-tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32",
                   shared_experts=1, experts=8, top_k=2)
LAYOUTS = ["ep8", "ep4xfsdp2", "ep2xfsdp2xtp2"]


def choices_reference(x_BLD, router_DE, k):
    """[B, L, K] each token's K most probable experts, most probable first (concrete:
    the routing is a decision, not differentiated)."""
    probs = np.asarray(jax.nn.softmax(x_BLD @ router_DE, axis=-1))
    return np.argsort(-probs, axis=-1, kind="stable")[..., :k]


def moe_reference(x_BLD, p, cfg, choices_BLK):
    """(y [B, L, D], dropped assignments, assignments per expert) token by token."""
    B, L, D = x_BLD.shape
    cap = (math.ceil(cfg.capacity_factor * L * cfg.top_k / cfg.experts)
           if cfg.capacity_factor > 0 else L)
    rows, dropped, counts = [], 0, np.zeros(cfg.experts)
    for b in range(B):
        probs = [jax.nn.softmax(x_BLD[b, l] @ p["router"]) for l in range(L)]
        choices = choices_BLK[b]
        taken = np.zeros(cfg.experts, int)
        out = [jnp.zeros(D) for _ in range(L)]
        for k in range(cfg.top_k):  # every first choice of the row before any second
            for l in range(L):
                e = int(choices[l][k])
                counts[e] += 1
                if taken[e] >= cap:
                    dropped += 1
                    continue
                taken[e] += 1
                h = jax.nn.silu(x_BLD[b, l] @ p["we_g"][e]) * (x_BLD[b, l] @ p["we_u"][e])
                out[l] = out[l] + probs[l][e] * (h @ p["we_d"][e])
        for l in range(L):
            if cfg.shared_experts:
                out[l] = out[l] + ref.mlp(x_BLD[b, l], p["ws_g"], p["ws_u"], p["ws_d"])
        rows.append(jnp.stack(out))
    return jnp.stack(rows), dropped, counts


def router_losses_reference(x_BLD, router_DE, cfg, choices_BLK):
    """(load-balancing loss, z-loss) of one layer over all its tokens, from the plain
    formulas: E * sum_e (fraction of assignments to e) * (mean prob of e); mean lse²."""
    logits_TE = x_BLD.reshape(-1, x_BLD.shape[-1]) @ router_DE
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    top_TK = choices_BLK.reshape(-1, cfg.top_k)
    f_E = np.bincount(top_TK.reshape(-1), minlength=cfg.experts) / top_TK.size
    aux = cfg.experts * jnp.sum(f_E * jnp.mean(probs_TE, axis=0))
    z = jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)
    return aux, z


def reference_loss(params, tokens_BL, cfg, choices=None):
    """The plain model of tests/reference_model.py with the MLP as `moe_reference`, plus
    the router losses averaged over layers. choices: each layer's routing (from a first,
    undifferentiated call, which fills the list given)."""
    inputs, targets = tokens_BL[:, :-1], tokens_BL[:, 1:]
    logits, aux, z = reference_logits(params, inputs, cfg, choices)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z


def reference_logits(params, inputs, cfg, choices=None):
    """(logits [B, L, V], load-balancing loss, z-loss) of the plain model."""
    record = choices is None or not choices
    choices = [] if choices is None else choices
    x = params["embed"][inputs]
    b = params["blocks"]
    aux = z = 0.0
    for i in range(cfg.n_layers):
        h = ref.rms_norm(x, b["attn_norm"][i], cfg.norm_eps)
        x = x + ref.attention(h, b["wq"][i], b["wk"][i], b["wv"][i], b["wo"][i],
                              cfg.rope_theta)
        h = ref.rms_norm(x, b["mlp_norm"][i], cfg.norm_eps)
        layer = {k: v[i] for k, v in b.items()}
        if record:
            choices.append(choices_reference(h, layer["router"], cfg.top_k))
        x = x + moe_reference(h, layer, cfg, choices[i])[0]
        a, zz = router_losses_reference(h, layer["router"], cfg, choices[i])
        aux, z = aux + a / cfg.n_layers, z + zz / cfg.n_layers
    logits = ref.rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]
    return logits, aux, z


def layer_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    E, D, F, I = cfg.experts, cfg.d_model, cfg.mlp_dim, cfg.shared_experts * cfg.mlp_dim
    shapes = dict(router=(D, E), we_g=(E, D, F), we_u=(E, D, F), we_d=(E, F, D),
                  ws_g=(D, I), ws_u=(D, I), ws_d=(D, I))
    return {k: jnp.asarray(0.3 * rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("capacity_factor", [0.0, *(pytest.param(c, marks=pytest.mark.slow)
                                                  for c in (1.0, 0.5))])
def test_layer_matches_per_token_reference(capacity_factor):
    cfg = model_config("moe-tiny", dtype="f32", shared_experts=1,
                       capacity_factor=capacity_factor)
    p = layer_params(cfg)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, cfg.d_model)), jnp.float32)
    y, stats = jax.jit(lambda x, p: moe.moe(x, p, cfg, Axes()))(x, p)
    choices = choices_reference(x, p["router"], cfg.top_k)
    want, dropped, counts = moe_reference(x, p, cfg, choices)
    assert_tree_close(host(y), host(want), what="moe values ")
    assert float(stats["dropped"]) == dropped
    np.testing.assert_array_equal(np.asarray(stats["count_E"]), counts)
    assert (dropped > 0) == (capacity_factor > 0), dropped  # the capacities here drop some
    ct = jnp.asarray(np.random.default_rng(2).normal(size=y.shape), jnp.float32)
    got = jax.grad(lambda x, p: jnp.sum(moe.moe(x, p, cfg, Axes())[0] * ct), (0, 1))(x, p)
    ref_g = jax.grad(lambda x, p: jnp.sum(moe_reference(x, p, cfg, choices)[0] * ct),
                     (0, 1))(x, p)
    assert_tree_close(host(got), host(ref_g), what="moe grads ")


def test_dropped_tokens_pass_through():
    """Capacity 1 per expert per sequence: a token whose every choice was dropped gets
    exactly 0 from the layer, so the block leaves it as it came."""
    cfg = model_config("moe-tiny", dtype="f32", capacity_factor=1e-6)
    p = layer_params(cfg)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 16, cfg.d_model)), jnp.float32)
    y, stats = moe.moe(x, p, cfg, Axes())
    _, dropped, _ = moe_reference(x, p, cfg, choices_reference(x, p["router"], cfg.top_k))
    assert float(stats["dropped"]) == dropped > 0
    zero_rows = np.all(np.asarray(y) == 0, axis=-1)
    assert zero_rows.sum() >= 2 * 16 - 2 * cfg.experts  # at most E tokens kept per row
    assert zero_rows.sum() < 2 * 16


def trainer(layout, cfg=CFG, tcfg=TCFG, parallel=ParallelConfig()):
    lay = Layout.parse(layout)
    return Trainer(cfg, tcfg, lay, lay.mesh(), parallel)


def run(layout, init, cfg=CFG, parallel=ParallelConfig()):
    t = trainer(layout, cfg, parallel=parallel)
    return compiled_loss_and_grads(t, init, t.put_batch(tokens()))


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, TCFG.seed)


@pytest.fixture(scope="module")
def single(init):
    return run("single", init)


@pytest.mark.slow
def test_single_matches_per_token_reference_model():
    tcfg = TrainConfig(batch=2, seq=8)
    cfg = model_config("moe-tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32",
                       shared_experts=1, capacity_factor=1.0)
    init = random_params(cfg, 1)
    toks = np.asarray(tokens())[:2, :9]
    t = trainer("single", cfg, tcfg)
    loss, grads, _, _ = compiled_loss_and_grads(t, init, t.put_batch(toks))
    choices = []
    reference_loss(init, jnp.asarray(toks), cfg, choices)
    want, want_grads = jax.value_and_grad(reference_loss)(init, jnp.asarray(toks), cfg,
                                                          choices)
    assert abs(loss - float(want)) <= RTOL * abs(float(want))
    assert_tree_close(grads, host(want_grads), what="single vs per-token reference ")


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n != "ep4xfsdp2"
                                    else n for n in LAYOUTS])
def test_ep_layout_matches_single(layout, init, single):
    loss, grads, gnorm, ops = run(layout, init)
    want_loss, want_grads, want_gnorm, _ = single
    assert abs(loss - want_loss) <= RTOL * abs(want_loss)
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm
    assert_tree_close(grads, want_grads, what=f"{layout} grads ")
    assert "all-to-all" in ops, ops


@pytest.mark.slow
def test_capacity_is_layout_invariant(init):
    """Capacity counts per sequence, so ep drops exactly what single drops."""
    cfg = CFG.__class__(**{**CFG.__dict__, "capacity_factor": 0.5})
    want_loss, want_grads, _, _ = run("single", init, cfg)
    loss, grads, _, _ = run("ep4xfsdp2", init, cfg)
    assert abs(loss - want_loss) <= RTOL * abs(want_loss)
    assert_tree_close(grads, want_grads, what="capacity ep4xfsdp2 grads ")


@pytest.mark.parametrize("overrides,layout,phrase", [
    (dict(experts=6), "ep4", "experts=6 not divisible by ep=4"),
    (dict(experts=0), "ep2", "ep=2 shards experts: the model has none"),
    (dict(top_k=9), "single", "top_k=9 must be in [1, experts=8]"),
    (dict(capacity_factor=-1.0), "single", "capacity_factor=-1.0 must be >= 0"),
    (dict(capacity_factor=1.0), "cp2", "--capacity-factor counts a sequence's tokens"),
])
def test_invalid_moe_settings_refused_in_one_line(overrides, layout, phrase):
    cfg = CFG.__class__(**{**CFG.__dict__, **overrides})
    with pytest.raises(ConfigError) as e:
        check(cfg, TCFG, ParallelConfig(), Layout.parse(layout))
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_sequence_tp_comm_refused():
    with pytest.raises(ConfigError, match="experts route whole tokens"):
        check(CFG, TCFG, ParallelConfig(tp_comm="sequence"), Layout.parse("tp2"))


@pytest.mark.parametrize("parallel", [pytest.param(ParallelConfig(zero=1), marks=pytest.mark.slow),
                                      pytest.param(ParallelConfig(zero=2), marks=pytest.mark.slow),
                                      pytest.param(ParallelConfig(prefetch=True),
                                                   marks=pytest.mark.slow)],
                         ids=["zero1", "zero2", "prefetch"])
def test_zero_levels_and_prefetch_on_ep(parallel, init, single):
    loss, grads, gnorm, _ = run("ep4xfsdp2", init, parallel=parallel)
    want_loss, want_grads, want_gnorm, _ = single
    assert abs(loss - want_loss) <= RTOL * abs(want_loss)
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm
    assert_tree_close(grads, want_grads, what="ep4xfsdp2 grads ")


@pytest.mark.parametrize("remat", ["none", *(pytest.param(r, marks=pytest.mark.slow)
                                            for r in ("dots", "alternate"))])
def test_remat_policies_compute_the_same(remat, init, single):
    cfg = CFG.__class__(**{**CFG.__dict__, "remat": remat})
    loss, grads, _, _ = run("ep8", init, cfg)
    assert abs(loss - single[0]) <= RTOL * abs(single[0])
    assert_tree_close(grads, single[1], what=f"remat {remat} grads ")


@pytest.mark.slow
def test_ep_checkpoint_resumes_on_other_layouts(init, tmp_path):
    """Params and optimizer state saved from ep4xfsdp2 load exactly on fsdp8 and single
    (experts gathered instead of sharded) and on ep8, and train on from there alike."""
    import dataclasses

    from engine.run import checkpoint

    t = trainer("ep4xfsdp2")
    shapes = jax.tree_util.tree_flatten_with_path(init)[0]
    opt = jax.eval_shape(t.tx.init, init)
    rng = np.random.default_rng(5)
    opt_host = jax.tree.map(lambda s: (np.zeros(s.shape, s.dtype) if s.dtype == np.int32 else
                                       1e-3 * np.abs(rng.normal(size=s.shape)).astype(s.dtype)),
                            opt)
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x)
                         for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    meta = dict(model=dataclasses.asdict(CFG), layout="ep4xfsdp2")
    state = checkpoint.Checkpoint("<host>", 0, meta, {jax.tree_util.keystr(p): x
                                                      for p, x in shapes}, flat(opt_host))
    params, opt_state = checkpoint.restore(state, t)
    params, opt_state, m = t.train_step(params, opt_state, t.put_batch(tokens(0)))
    path = checkpoint.save(str(tmp_path), 1, params, opt_state, meta, 1)
    saved = flat(params)
    losses = {}
    for layout in ["ep4xfsdp2", "fsdp8", "single", "ep8"]:
        other = trainer(layout)
        p2, o2 = checkpoint.restore(checkpoint.read(path), other)
        got = flat(p2)
        assert all(np.array_equal(got[k], saved[k]) for k in saved), layout
        _, _, m2 = other.train_step(p2, o2, other.put_batch(tokens(1)))
        losses[layout] = float(m2["loss"])
    want = losses["ep4xfsdp2"]
    assert all(abs(v - want) <= RTOL * abs(want) for v in losses.values()), losses
    assert np.isfinite(float(m["tokens_per_expert_max"]))
    assert float(m["dropped_fraction"]) == 0.0  # dropless


@pytest.mark.parametrize("layout", ["ep2xfsdp2xtp2", *(pytest.param(n, marks=pytest.mark.slow)
                                                      for n in ("single", "ep8"))])
def test_cached_decoding_equals_full_sequence(layout, init):
    """Prefill + decode steps through the KV cache give the per-token reference model's
    logits on the whole sequence (rows of different lengths, right-padded)."""
    from jax.sharding import NamedSharding

    from engine.parallel.params import param_specs
    from engine.run.decode import Decoder, Sampling

    B, new, lengths = 8, 3, np.array([5, 2, 4, 5, 3, 1, 5, 2], np.int32)
    lay = Layout.parse(layout)
    mesh = lay.mesh()
    decoder = Decoder(CFG, lay, mesh, B, int(lengths.max()) + new, Sampling())
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), init,
                          param_specs(CFG, lay))
    prompt_BL = np.asarray(tokens())[:B, :int(lengths.max())].astype(np.int32)
    prompt_BL = np.where(np.arange(prompt_BL.shape[1]) < lengths[:, None], prompt_BL, 0)
    cache, next_B, logits_BV = decoder.prefill(params, prompt_BL, lengths, 0)
    out, logits = [np.asarray(next_B)], [np.asarray(logits_BV)]
    for t in range(1, new):
        cache, next_B, logits_BV = decoder.step(params, cache, next_B, lengths + t - 1, t, 0)
        out.append(np.asarray(next_B))
        logits.append(np.asarray(logits_BV))
    full_BL = np.zeros((B, int(lengths.max()) + new), np.int32)
    for b in range(B):
        full_BL[b, :lengths[b] + new] = list(prompt_BL[b, :lengths[b]]) + [o[b] for o in out]
    want_BLV = np.asarray(reference_logits(init, jnp.asarray(full_BL), CFG)[0])
    for t in range(new):
        want_BV = want_BLV[np.arange(B), lengths - 1 + t]
        err = float(np.max(np.abs(logits[t] - want_BV)))
        assert err <= RTOL * float(np.max(np.abs(want_BV))), f"{layout} token {t}: {err:.2e}"


@pytest.mark.slow
def test_cli_logs_router_metrics(tmp_path):
    import json

    from test_cli import train as cli

    path = tmp_path / "m.jsonl"
    r = cli("--model", "moe-tiny", "--layout", "ep4xfsdp2", "--steps", "2", "--batch", "8",
            "--seq", "16", "--log-every", "1", "--capacity-factor", "1.0",
            "--metrics-file", str(path))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for key in ("aux_loss", "z_loss", "tokens_per_expert_max", "tokens_per_expert_mean",
                "dropped_fraction", "ce_loss"):
        assert all(isinstance(row[key], float) for row in rows), key
    assert all(row["tokens_per_expert_max"] >= row["tokens_per_expert_mean"] for row in rows)
    assert "E=8 top-2 S=0 capacity 1" in r.stdout
    assert "aux " in r.stdout and "tokens/expert max/mean" in r.stdout and "dropped" in r.stdout
    bad = cli("--model", "moe-tiny", "--layout", "ep4", "--experts", "6")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "experts=6 not divisible by ep=4" in bad.stderr
