"""The model written plainly in jnp on global arrays: no shard_map, no collectives, no
scan, no remat, f32 throughout. The engine's `single` layout must match it."""
import math

import jax
import jax.numpy as jnp


def rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x_BLHK, theta):
    L, K = x_BLHK.shape[1], x_BLHK.shape[3]
    inv_freq = 1.0 / theta ** (jnp.arange(0, K, 2) / K)
    ang = jnp.arange(L)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x_BLHK[..., : K // 2], x_BLHK[..., K // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense_attention(q_BLHK, k_BSGK, v_BSGK, *, causal=True, q_offset=0, k_offset=0):
    """Softmax attention with the whole [L, S] score matrix in f32, kv heads repeated for
    GQA. Causal: the query at position q_offset + l sees the keys at positions
    k_offset + s <= its own (a lower triangle shifted by q_offset - k_offset)."""
    f32 = jnp.float32
    R = q_BLHK.shape[2] // k_BSGK.shape[2]
    k_BSHK = jnp.repeat(k_BSGK, R, axis=2).astype(f32)
    v_BSHK = jnp.repeat(v_BSGK, R, axis=2).astype(f32)
    s_BHLS = jnp.einsum("BLHK,BSHK->BHLS", q_BLHK.astype(f32), k_BSHK)
    s_BHLS = s_BHLS / math.sqrt(q_BLHK.shape[-1])
    if causal:
        L, S = s_BHLS.shape[-2:]
        s_BHLS = jnp.where(jnp.tril(jnp.ones((L, S), bool), k=q_offset - k_offset), s_BHLS,
                           -jnp.inf)
    o_BLHK = jnp.einsum("BHLS,BSHK->BLHK", jax.nn.softmax(s_BHLS, axis=-1), v_BSHK)
    return o_BLHK.astype(q_BLHK.dtype)


def attention(x, wq, wk, wv, wo, theta):
    """Multi-head causal attention (GQA by repeated kv heads)."""
    q = rope(jnp.einsum("BLD,DHK->BLHK", x, wq), theta)
    k = rope(jnp.einsum("BLD,DGK->BLGK", x, wk), theta)
    v = jnp.einsum("BLD,DGK->BLGK", x, wv)
    return jnp.einsum("BLHK,HKD->BLD", dense_attention(q, k, v), wo)


def mlp(x, wg, wu, wd):
    """wg, wu, wd: [D, F]."""
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd.T


def logits(params, inputs, n_layers, theta=10_000.0, eps=1e-5):
    """inputs [B, L] -> logits [B, L, V]."""
    x = params["embed"][inputs]
    b = params["blocks"]
    for i in range(n_layers):
        h = rms_norm(x, b["attn_norm"][i], eps)
        x = x + attention(h, b["wq"][i], b["wk"][i], b["wv"][i], b["wo"][i], theta)
        h = rms_norm(x, b["mlp_norm"][i], eps)
        x = x + mlp(h, b["wg"][i], b["wu"][i], b["wd"][i])
    return rms_norm(x, params["final_norm"], eps) @ params["unembed"]


def loss(params, tokens, n_layers, theta=10_000.0, eps=1e-5):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logp = jax.nn.log_softmax(logits(params, inputs, n_layers, theta, eps), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
