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


def attention(x, wq, wk, wv, wo, theta):
    """Multi-head attention with kv heads repeated for GQA; causal."""
    H, G = wq.shape[1], wk.shape[1]
    q = rope(jnp.einsum("BLD,DHK->BLHK", x, wq), theta)
    k = rope(jnp.einsum("BLD,DGK->BLGK", x, wk), theta)
    v = jnp.einsum("BLD,DGK->BLGK", x, wv)
    k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
    s = jnp.einsum("BLHK,BSHK->BHLS", q, k) / math.sqrt(q.shape[-1])
    L = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    o = jnp.einsum("BHLS,BSHK->BLHK", jax.nn.softmax(s, axis=-1), v)
    return jnp.einsum("BLHK,HKD->BLD", o, wo)


def mlp(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def loss(params, tokens, n_layers, theta=10_000.0, eps=1e-5):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    b = params["blocks"]
    for i in range(n_layers):
        h = rms_norm(x, b["attn_norm"][i], eps)
        x = x + attention(h, b["wq"][i], b["wk"][i], b["wv"][i], b["wo"][i], theta)
        h = rms_norm(x, b["mlp_norm"][i], eps)
        x = x + mlp(h, b["wg"][i], b["wu"][i], b["wd"][i])
    logits = rms_norm(x, params["final_norm"], eps) @ params["unembed"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
