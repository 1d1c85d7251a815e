"""Prefill and decode as `jit(shard_map)` programs over a sharded KV cache.

The cache [N, B, C, G', K] is sharded like training activations: batch over the batch
axes (dp, fsdp), kv heads over tp. G' = max(G, tp): when tp > G every tp rank caches
the one kv head its query heads read, so each device holds exactly the heads it uses.
Params stay stored as the param table says and each layer's weights are gathered over
fsdp inside the scan, as in training: no device ever holds more than one layer's
gathered weights, at the price of one set of fsdp gathers per forward (per token).

Logits come out vocab-parallel [B, V_tp]; both programs gather them over tp ([B, V] is
small) and sample on every tp rank with the same key, so the ranks agree. Row r's key
is fold_in(fold_in(key(seed), t), r) for token t and global row r: samples do not
depend on the layout. The logits gather is typed replicated over tp
(`gather(..., replicated=True)`), so both programs keep `check_vma=True`.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import collectives
from engine.config import ConfigError
from engine.parallel import validate
from engine.parallel.layout import Layout
from engine.parallel.params import activation_spec, fsdp_dims, param_specs
from layers import cache as kv
from layers.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k None samples from the whole vocab; top_p
    (nucleus) keeps the likeliest tokens whose probabilities reach p (after top_k), None
    keeps them all."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


def sample(logits_BV: jax.Array, seed, t, rows_B: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token of each row [B] int32 from full-vocab logits [B, V] (f32)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits_BV.shape[-1]:
        kth_B1 = lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
        p_BV = jax.nn.softmax(sorted_BV, axis=-1)
        keep_BV = jnp.cumsum(p_BV, axis=-1) - p_BV < sampling.top_p  # mass before < p
        least_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < least_B1, -jnp.inf, logits_BV)
    key = jax.random.fold_in(jax.random.key(seed), t)
    keys_B = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows_B)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)


def check_decoder(cfg: ModelConfig, layout: Layout, batch: int, cache_len: int) -> None:
    """`engine.parallel.validate.decoder_problems` for decoding `batch` rows into `cache_len`
    slots, the cache measured against the memory it will live in (on CPU every device of
    the layout shares this host's available RAM; on an accelerator each device has its
    own, as its memory_stats report); raises ConfigError before anything is allocated."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        memory = validate.available_host_memory()
        sharing = min(layout.size, jax.local_device_count())
    else:
        memory, sharing = (device.memory_stats() or {}).get("bytes_limit"), 1
    if found := validate.decoder_problems(cfg, layout, batch, cache_len, memory, sharing):
        raise ConfigError("; ".join(found))


class Decoder:
    """The model bound to a layout, a global batch of B rows and a cache of C slots.

    prefill(params, tokens [B, L], lengths [B], seed) -> (cache, next [B], logits [B, V])
        the right-padded prompts in one forward; next/logits at each row's last token.
    step(params, cache, tokens [B], pos [B], t, seed) -> (cache, next [B], logits [B, V])
        token t of each row (at cache slot pos) in; the cache is donated.
    Both run compiled executables: one per prompt length for prefill, one for step.
    """

    def __init__(self, cfg: ModelConfig, layout: Layout, mesh, batch: int, cache_len: int,
                 sampling: Sampling):
        check_decoder(cfg, layout, batch, cache_len)
        # a capacity counts a sequence's tokens in one forward; decoding is dropless
        cfg = dataclasses.replace(cfg, capacity_factor=0.0)
        self.cfg, self.layout, self.mesh = cfg, layout, mesh
        self.batch, self.cache_len, self.sampling = batch, cache_len, sampling
        self.axes = layout.role_axes()
        self.specs = param_specs(cfg, layout)
        self._dims = fsdp_dims()
        self.row_spec, self.tokens_spec, self.logits_spec = (
            activation_spec(name, layout) for name in ("rows", "tokens", "logits"))
        self.cache_spec = kv.KVCache(*(activation_spec("cache", layout),) * 2)
        kv_heads = max(cfg.n_kv_heads, self.axes.tp_size)
        self.cache_shape = (cfg.n_layers, batch, cache_len, kv_heads, cfg.head_dim)
        shard = functools.partial(jax.shard_map, mesh=mesh)
        outs = (self.cache_spec, self.row_spec, self.logits_spec)
        self._prefill = jax.jit(shard(
            self._prefill_body, out_specs=outs,
            in_specs=(self.specs, self.tokens_spec, self.row_spec, P())))
        self._step = jax.jit(shard(
            self._step_body, out_specs=outs,
            in_specs=(self.specs, self.cache_spec, self.row_spec, self.row_spec, P(), P())),
            donate_argnums=(1,))
        self._prefill_exe: dict[int, object] = {}
        self._step_exe = None

    # -- per-shard bodies -------------------------------------------------------------
    def _rows(self, b_local: int) -> jax.Array:
        """Global row indices of this device's rows."""
        return collectives.axis_index(self.axes.batch) * b_local + jnp.arange(b_local)

    def _finish(self, logits_BV, seed, t):
        logits_BV = collectives.gather(logits_BV, self.axes.tp, dim=1, replicated=True)  # [B, V]
        return sample(logits_BV, seed, t, self._rows(logits_BV.shape[0]), self.sampling), logits_BV

    def _prefill_body(self, params, tokens_BL, lengths_B, seed):
        B = tokens_BL.shape[0]
        local = (self.cfg.n_layers, B, self.cache_len, self.cache_shape[3] // self.axes.tp_size,
                 self.cfg.head_dim)
        empty = kv.KVCache(*(jnp.zeros(local, self.cfg.compute_dtype),) * 2)
        start_B = jnp.zeros((B,), jnp.int32)
        logits_BV, cache = kv.forward(params, empty, tokens_BL, start_B, lengths_B - 1,
                                      self._dims, self.cfg, self.axes)
        return (cache, *self._finish(logits_BV, seed, 0))

    def _step_body(self, params, cache, tokens_B, pos_B, t, seed):
        logits_BV, cache = kv.forward(params, cache, tokens_B[:, None], pos_B,
                                      jnp.zeros_like(pos_B), self._dims, self.cfg, self.axes)
        return (cache, *self._finish(logits_BV, seed, t))

    # -- host side --------------------------------------------------------------------
    def _abstract(self, shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

    def _put(self, x, spec, dtype=np.int32):
        """Host values -> a device array placed as `spec` (device arrays pass through)."""
        if isinstance(x, jax.Array):
            return x
        return jax.device_put(np.asarray(x, dtype), NamedSharding(self.mesh, spec))

    def compile(self, params, prompt_len: int) -> float:
        """Compile prefill for prompts of `prompt_len` tokens and the step; seconds taken."""
        t0 = time.perf_counter()
        rows = self._abstract((self.batch,), jnp.int32, self.row_spec)
        scalar, seed = (self._abstract((), dt, P()) for dt in (jnp.int32, jnp.uint32))
        if prompt_len not in self._prefill_exe:
            tokens = self._abstract((self.batch, prompt_len), jnp.int32, self.tokens_spec)
            self._prefill_exe[prompt_len] = self._prefill.lower(
                params, tokens, rows, seed).compile()
        if self._step_exe is None:
            cache = kv.KVCache(*(self._abstract(self.cache_shape, self.cfg.compute_dtype, s)
                                 for s in self.cache_spec))
            self._step_exe = self._step.lower(params, cache, rows, rows, scalar, seed).compile()
        return time.perf_counter() - t0

    def prefill(self, params, tokens_BL, lengths_B, seed: int):
        self.compile(params, np.shape(tokens_BL)[1])
        return self._prefill_exe[np.shape(tokens_BL)[1]](
            params, self._put(tokens_BL, self.tokens_spec), self._put(lengths_B, self.row_spec),
            self._put(seed, P(), np.uint32))

    def step(self, params, cache, tokens_B, pos_B, t: int, seed: int):
        return self._step_exe(params, cache, self._put(tokens_B, self.row_spec),
                              self._put(pos_B, self.row_spec), self._put(t, P()),
                              self._put(seed, P(), np.uint32))
