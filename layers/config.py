"""The model's shape and numerics: one frozen dataclass, static under jit."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from layers.rope import Rope

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LLaMA-style transformer. Letter key: D d_model, N layers, H heads,
    G kv heads, K head dim, F MLP hidden, V vocab; mixture of experts: E experts, I the
    shared experts' hidden (shared_experts * F), T tokens, A routed assignments (T * top_k).

    experts = 0 is the dense SwiGLU MLP. experts = E > 0 makes every block's MLP E routed
    SwiGLU experts of hidden F (softmax router, each token to its top_k) plus
    `shared_experts` SwiGLU experts every token passes through (layers/moe.py); the loss
    adds `aux_loss_coef` x the load-balancing loss and `z_loss_coef` x the router z-loss.
    capacity_factor C > 0: each expert takes at most ceil(C * L * top_k / E) of a
    sequence's assignments, the rest are dropped; 0: dropless. router_renorm: the top_k
    combine weights are divided by their sum (Mixtral's router, layers/moe.py `route`).

    tie_embed: the unembedding is the embedding's transpose (one param, `embed`).
    vocab_multiple: the embedding and unembedding have `padded_vocab` rows / columns, the
    vocab rounded up to this multiple (so that tp divides it); the padding ids are never
    looked up and their logits are kept out of the loss and out of decoding.
    rope_scaling_factor > 0: Llama 3's frequency-dependent RoPE scaling
    (layers/rope.py `Rope`) with the three fields after it."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 768
    vocab: int = 256
    dtype: str = "bf16"  # compute dtype of matmuls; params and optimizer state stay f32
    # dtype of the activations between matmuls: matmul results, the residual stream and
    # what the forward saves for the backward (norms, softmax and the loss compute in f32)
    activations: str = "f32"
    remat: str = "full"  # none | full | dots | alternate (layers/block.py REMAT_MODES)
    attention: str = "reference"  # auto | reference | chunked | blocked | pallas (layers/attention.py)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    rope_scaling_factor: float = 0.0  # 0: no scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max: int = 8192
    tie_embed: bool = False
    sliding_window: int = 0  # Mistral's; only 0 (none) or >= the sequence is accepted
    vocab_multiple: int = 1
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01  # Switch Transformer's alpha
    z_loss_coef: float = 0.001  # ST-MoE's router z-loss coefficient
    # packed documents (layers/documents.py): the end-of-document token id, or None (off);
    # when set a token attends only to earlier tokens of its own document, and with
    # document_positions RoPE positions restart at 0 at each document
    document_eos: int | None = None
    document_positions: bool = False
    router_renorm: bool = False

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def act_dtype(self):
        return DTYPES[self.activations]

    @property
    def padded_vocab(self) -> int:
        """V of the params: the vocab rounded up to a multiple of `vocab_multiple`."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    @property
    def rope(self) -> Rope:
        """The rotary frequencies' parameters (hashable, static under jit)."""
        return Rope(self.rope_theta, self.rope_scaling_factor, self.rope_low_freq_factor,
                    self.rope_high_freq_factor, self.rope_original_max)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio R = H / G)."""
        return self.n_heads // self.n_kv_heads
