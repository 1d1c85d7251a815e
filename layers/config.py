"""The model's shape and numerics: one frozen dataclass, static under jit."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


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
    remat: str = "full"  # none | full | dots (layers/block.py REMAT)
    attention: str = "reference"  # auto | reference | chunked | blocked | pallas (layers/attention.py)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio R = H / G)."""
        return self.n_heads // self.n_kv_heads
