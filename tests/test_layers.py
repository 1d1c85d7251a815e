"""Every layer per-shard under shard_map over a tp axis against a plain unsharded
reference (tests/reference_model.py), values and gradients, for tp in {1, 2, 4} with
G=2 kv heads (so tp=4 > G exercises replicated kv heads)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import reference_model as ref
from layers import vocab
from layers.attention import attention
from layers.kernels import reference_attention
from layers.axes import Axes
from layers.block import block
from layers.config import ModelConfig
from layers.mlp import mlp
from layers.norm import rms_norm
from layers.rope import rope

CFG = ModelConfig(d_model=32, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=8, mlp_dim=64,
                  vocab=64, dtype="f32")
B, L = 2, 16
# f32 on both sides; the sharded path sums partial products in another order (tp-way
# psum). A norm scale's grad sums B*L products as large as the tensor's largest entry,
# so its error scales with that magnitude: 1e-5 of it (~100 ulps), as in test_step.py.
RTOL, ATOL = 1e-5, 1e-5
TPS = [1, 2, 4]


def tp_mesh(tp):
    return jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))


def axes_for(tp):
    return Axes(tp="tp" if tp > 1 else None, tp_size=tp)


def tp_spec(tp, *dims):
    """PartitionSpec with 'tp' on the named positions (None when tp == 1)."""
    return P(*("tp" if (d and tp > 1) else None for d in dims))


def weights(seed, shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {n: 0.3 * jax.random.normal(k, s, jnp.float32) for k, (n, s) in zip(keys, shapes.items())}


def assert_close(got, want, what):
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path, want)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL * max(1.0, float(jnp.max(jnp.abs(w)))),
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def check_value_and_grad(sharded, plain, args, what):
    """sharded and plain: args -> array. Compare values and the grads of <out, W>."""
    out = jax.jit(plain)(*args)
    W = jax.random.normal(jax.random.key(9), out.shape, jnp.float32)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * W), tuple(range(len(args)))))
    assert_close(jax.jit(sharded)(*args), out, f"{what} value")
    assert_close(grad(sharded)(*args), grad(plain)(*args), f"{what} grad")


def attn_weights(seed=0):
    D, H, G, K = CFG.d_model, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    return weights(seed, dict(wq=(D, H, K), wk=(D, G, K), wv=(D, G, K), wo=(H, K, D)))


def attn_specs(tp):
    kv = tp <= CFG.n_kv_heads
    return dict(wq=tp_spec(tp, 0, 1, 0), wk=tp_spec(tp, 0, kv, 0), wv=tp_spec(tp, 0, kv, 0),
                wo=tp_spec(tp, 1, 0, 0))


def mlp_weights(seed=1):
    D, F = CFG.d_model, CFG.mlp_dim
    return weights(seed, dict(wg=(D, F), wu=(D, F), wd=(D, F)))


def mlp_specs(tp):
    return dict(wg=tp_spec(tp, 0, 1), wu=tp_spec(tp, 0, 1), wd=tp_spec(tp, 0, 1))


def x_BLD(seed=2):
    return jax.random.normal(jax.random.key(seed), (B, L, CFG.d_model), jnp.float32)


@pytest.mark.parametrize("tp", TPS)
def test_attention(tp):
    p = attn_weights()
    sharded = jax.shard_map(lambda x, p: attention(x, p, CFG, axes_for(tp)), mesh=tp_mesh(tp),
                            in_specs=(P(), attn_specs(tp)), out_specs=P())
    plain = lambda x, p: ref.attention(x, p["wq"], p["wk"], p["wv"], p["wo"], CFG.rope_theta)
    check_value_and_grad(sharded, plain, (x_BLD(), p), f"attention tp={tp}")


@pytest.mark.parametrize("tp", TPS)
def test_mlp(tp):
    p = mlp_weights()
    sharded = jax.shard_map(lambda x, p: mlp(x, p, CFG, axes_for(tp)), mesh=tp_mesh(tp),
                            in_specs=(P(), mlp_specs(tp)), out_specs=P())
    plain = lambda x, p: ref.mlp(x, p["wg"], p["wu"], p["wd"])
    check_value_and_grad(sharded, plain, (x_BLD(), p), f"mlp tp={tp}")


@pytest.mark.parametrize("tp", TPS)
def test_block(tp):
    p = {**attn_weights(), **mlp_weights(),
         "attn_norm": 1 + 0.1 * jax.random.normal(jax.random.key(5), (CFG.d_model,)),
         "mlp_norm": 1 + 0.1 * jax.random.normal(jax.random.key(6), (CFG.d_model,))}
    specs = {**attn_specs(tp), **mlp_specs(tp), "attn_norm": P(), "mlp_norm": P()}
    sharded = jax.shard_map(lambda x, p: block(x, p, CFG, axes_for(tp)), mesh=tp_mesh(tp),
                            in_specs=(P(), specs), out_specs=P())

    def plain(x, p):
        x = x + ref.attention(ref.rms_norm(x, p["attn_norm"], CFG.norm_eps), p["wq"], p["wk"],
                              p["wv"], p["wo"], CFG.rope_theta)
        return x + ref.mlp(ref.rms_norm(x, p["mlp_norm"], CFG.norm_eps), p["wg"], p["wu"], p["wd"])

    check_value_and_grad(sharded, plain, (x_BLD(), p), f"block tp={tp}")


def tokens_BL(seed=3, length=L):
    return jax.random.randint(jax.random.key(seed), (B, length), 0, CFG.vocab)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embed(tp):
    table_VD = jax.random.normal(jax.random.key(4), (CFG.vocab, CFG.d_model))
    tokens = tokens_BL()
    sharded = jax.shard_map(lambda e: vocab.embed(tokens, e, axes_for(tp)), mesh=tp_mesh(tp),
                            in_specs=tp_spec(tp, 1, 0), out_specs=P())
    check_value_and_grad(sharded, lambda e: e[tokens], (table_VD,), f"embed tp={tp}")


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_cross_entropy(tp):
    w_DV = jax.random.normal(jax.random.key(4), (CFG.d_model, CFG.vocab)) / 4
    targets = tokens_BL(seed=7)
    sharded = jax.shard_map(
        lambda h, w: vocab.cross_entropy(h, w, targets, axes_for(tp), jnp.float32),
        mesh=tp_mesh(tp), in_specs=(P(), tp_spec(tp, 0, 1)), out_specs=P())

    def plain(h, w):
        logp = jax.nn.log_softmax(h @ w, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    check_value_and_grad(sharded, plain, (x_BLD(), w_DV), f"cross-entropy tp={tp}")


def test_rms_norm_and_rope_match_reference():
    x, s = x_BLD(), 1 + jax.random.normal(jax.random.key(8), (CFG.d_model,))
    check_value_and_grad(lambda x, s: rms_norm(x, s, 1e-5), lambda x, s: ref.rms_norm(x, s, 1e-5),
                         (x, s), "rms_norm")
    q = x.reshape(B, L, 4, 8)
    check_value_and_grad(lambda q: rope(q), lambda q: ref.rope(q, 10_000.0), (q,), "rope")


@pytest.mark.parametrize("causal", [True, False])
def test_reference_attention_gqa(causal):
    """The layer's attention kernel against repeat-kv dense attention."""
    kq, kk, kv = jax.random.split(jax.random.key(10), 3)
    q = jax.random.normal(kq, (B, L, 8, 8))
    k, v = jax.random.normal(kk, (B, L, 2, 8)), jax.random.normal(kv, (B, L, 2, 8))
    check_value_and_grad(lambda q, k, v: reference_attention(q, k, v, causal=causal),
                         lambda q, k, v: ref.dense_attention(q, k, v, causal=causal),
                         (q, k, v), f"reference_attention causal={causal}")


@pytest.mark.parametrize("q_offset,k_offset", [(8, 0), (8, 4), (3, 3)])
def test_reference_attention_offsets(q_offset, k_offset):
    """Queries at global positions q_offset + [0, L_q) against keys at k_offset + [0, S):
    the causal mask of a sequence shard equals that slice of whole-sequence attention."""
    kq, kk, kv = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(kq, (B, 8, 4, 8))
    k, v = jax.random.normal(kk, (B, 12, 2, 8)), jax.random.normal(kv, (B, 12, 2, 8))
    check_value_and_grad(
        lambda q, k, v: reference_attention(q, k, v, q_offset=q_offset, k_offset=k_offset),
        lambda q, k, v: ref.dense_attention(q, k, v, q_offset=q_offset, k_offset=k_offset),
        (q, k, v), f"reference_attention q_offset={q_offset} k_offset={k_offset}")


def test_reference_attention_query_slice():
    """The second half of the queries at q_offset = L/2 against all keys equals the second
    half of whole-sequence causal attention."""
    kq, kk, kv = jax.random.split(jax.random.key(13), 3)
    q = jax.random.normal(kq, (B, L, 4, 8))
    k, v = jax.random.normal(kk, (B, L, 2, 8)), jax.random.normal(kv, (B, L, 2, 8))
    half = L // 2
    got = reference_attention(q[:, half:], k, v, q_offset=half)
    np.testing.assert_allclose(got, reference_attention(q, k, v)[:, half:], rtol=1e-5,
                               atol=1e-6)


def test_reference_attention_per_row_offsets():
    """An offset per row (the KV-cache decode path) equals each row alone."""
    kq, kk, kv = jax.random.split(jax.random.key(12), 3)
    q = jax.random.normal(kq, (3, 2, 4, 8))
    k, v = jax.random.normal(kk, (3, 10, 2, 8)), jax.random.normal(kv, (3, 10, 2, 8))
    start_B = jnp.array([0, 4, 8])
    got = reference_attention(q, k, v, q_offset=start_B)
    for b, start in enumerate([0, 4, 8]):
        want = ref.dense_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], q_offset=start)
        np.testing.assert_allclose(got[b:b + 1], want, rtol=1e-5, atol=1e-6)
