"""The model's shape and numerics: one frozen dataclass, static under jit."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
REMAT = ("none", "full", "dots")
TP_COMM = ("allreduce", "sequence", "ring")
ZERO = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LLaMA-style transformer. Letter key: D d_model, N layers, H heads,
    G kv heads, K head dim, F MLP hidden, V vocab."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 768
    vocab: int = 256
    dtype: str = "bf16"  # compute dtype of matmuls; params and optimizer state stay f32
    remat: str = "full"  # none | full | dots
    attention: str = "reference"  # auto | reference | chunked | blocked | pallas (layers/attention.py)
    # Where bytes move (issue 6). tp_comm: allreduce = Megatron TP, activations replicated
    # over tp between blocks; sequence = Megatron sequence parallel (activations sharded
    # over tp along L between blocks: gather before the column-parallel matmul,
    # reduce-scatter after the row-parallel one); ring = sequence parallel with the gather
    # and reduce-scatter decomposed into ppermute steps interleaved with partial matmuls.
    tp_comm: str = "allreduce"
    # zero: 3 = params, grads and optimizer state sharded over fsdp (gather per layer);
    # 2 = params replicated, grads reduce-scattered, optimizer state sharded;
    # 1 = params replicated, grads all-reduced then sliced, optimizer state sharded.
    zero: int = 3
    prefetch: bool = False  # zero 3: gather layer i+1's weights before layer i's compute
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio R = H / G)."""
        return self.n_heads // self.n_kv_heads
