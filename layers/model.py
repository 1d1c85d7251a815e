"""The whole model per shard as three stages, `embed` -> `blocks` -> `head`, and the
training loss composed of them (vocab-parallel cross-entropy after the head).

Between the stages the residual stream is x [B, L, D] (`cfg.act_dtype`) replicated over tp
(axes.tp_comm allreduce) or [B, L_tp, D] (sequence, ring). params: local shards as stored
(see engine/parallel/params.py); fsdp_dims: for every param, the dim sharded over fsdp (None if
replicated), in per-layer coordinates.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

import collectives
from layers import block, scopes, vocab
from layers.axes import Axes
from layers.config import ModelConfig
from layers.documents import Documents
from layers.norm import rms_norm


def embed(params: dict, inputs_BL: jax.Array, fsdp_dims: Mapping, cfg: ModelConfig,
          axes: Axes) -> jax.Array:
    """Token ids [B, L] -> the residual stream x [B, L, D] (or [B, L_tp, D])."""
    with jax.named_scope(scopes.EMBED):
        embed_VD = collectives.gather(params["embed"], axes.fsdp, dim=fsdp_dims["embed"])
        return vocab.embed(inputs_BL, embed_VD, axes, axes.tp_comm, cfg.act_dtype)


def blocks(params: dict, x_BLD: jax.Array, fsdp_dims: Mapping, cfg: ModelConfig,
           axes: Axes, docs: Documents | None = None) -> tuple[jax.Array, dict]:
    """The N decoder blocks (`layers.block.blocks`: scan, fsdp gathers, remat):
    x [B, L, D] -> [B, L, D] (or [B, L_tp, D] -> [B, L_tp, D]), and the router sums of a
    mixture-of-experts MLP stacked over layers ({} for the dense MLP). docs: packed
    documents kept apart (layers/documents.py)."""
    return block.blocks(x_BLD, params["blocks"], fsdp_dims["blocks"], cfg, axes, docs)


def head(params: dict, x_BLD: jax.Array, fsdp_dims: Mapping, cfg: ModelConfig,
         axes: Axes) -> tuple[jax.Array, jax.Array]:
    """The final norm and the unembedding: logits are h @ unembed.

    x [B, L, D] (or [B, L_tp, D]) -> (h [B, L, D] in x's dtype, the same sharding as x; unembed
    [D, V_tp] in the compute dtype, gathered over fsdp; with `tie_embed` the embedding
    transposed, so its grad sums both uses). The training loss feeds both
    to the vocab-parallel cross-entropy (full logits never built); the decoder
    (layers/cache.py) multiplies them for the last token's logits."""
    # sequence, ring: x is [B, L_tp, D], so the scale's grad is a partial sum over tp,
    # all-reduced by the broadcast's bwd (allreduce: x replicated, nothing to reduce)
    h_BLD = rms_norm(x_BLD, collectives.broadcast(params["final_norm"], axes.seq_tp),
                     cfg.norm_eps)
    name = "embed" if cfg.tie_embed else "unembed"  # tied: embed [V_tp, D] transposed
    w = collectives.gather(params[name], axes.fsdp, dim=fsdp_dims[name],
                           cast=cfg.compute_dtype, keep_grad_dtype=axes.grad_reduce == "f32")
    return h_BLD, w.T if cfg.tie_embed else w


def padding(cfg: ModelConfig) -> int | None:
    """The real vocab when the params carry padding ids (`vocab.mask_padding`), else None."""
    return cfg.vocab if cfg.padded_vocab != cfg.vocab else None


def loss(params: dict, inputs_BL: jax.Array, targets_BL: jax.Array, fsdp_dims: Mapping,
         cfg: ModelConfig, axes: Axes) -> jax.Array:
    """`loss_and_stats`'s cross-entropy alone (for a mixture of experts: without the
    router losses)."""
    return loss_and_stats(params, inputs_BL, targets_BL, fsdp_dims, cfg, axes)[0]


def loss_and_stats(params: dict, inputs_BL: jax.Array, targets_BL: jax.Array,
                   fsdp_dims: Mapping, cfg: ModelConfig, axes: Axes,
                   docs: Documents | None = None) -> tuple[jax.Array, dict]:
    """(cross-entropy, the router's local sums per layer, {} dense: `layers.moe.
    router_losses` makes the router losses of them over the data axes).

    Mean next-token cross-entropy over the global batch (a scalar, the same on every
    device): `embed`, `blocks`, `head`, then the vocab-parallel cross-entropy.

    inputs, targets: [B_batch, L] with the batch sharded over `axes.batch`; position t of
    inputs predicts position t of targets (for a token stream, targets are the inputs
    shifted by one). Under cp, [B_batch, L_cp]: this rank's two load-balanced chunks
    (`layers.context.shard_sequence`); the loss is summed over every data axis (batch
    axes and cp) and divided by the global token count. docs: the windows' packed
    documents (`layers.documents.documents`), None without document masking.
    """
    x_BLD = embed(params, inputs_BL, fsdp_dims, cfg, axes)
    x_BLD, stats = blocks(params, x_BLD, fsdp_dims, cfg, axes, docs)
    return head_loss(params, x_BLD, targets_BL, fsdp_dims, cfg, axes), stats


def head_loss(params: dict, x_BLD: jax.Array, targets_BL: jax.Array, fsdp_dims: Mapping,
              cfg: ModelConfig, axes: Axes) -> jax.Array:
    """`head` and the vocab-parallel cross-entropy of the last block's output x [B, L, D]
    (or [B, L_tp, D]): the mean next-token loss over the global batch, as `loss` says."""
    with jax.named_scope(scopes.LOSS):
        h_BLD, unembed_DV = head(params, x_BLD, fsdp_dims, cfg, axes)
        # the head's column gathers h once: its backward follows its forward in one
        # program, where XLA would merge a second gather into the first
        loss_BL = vocab.cross_entropy(h_BLD, unembed_DV, targets_BL, axes, cfg.compute_dtype,
                                      collectives.tp_comm(axes.tp_comm).once(), padding(cfg))
        n_tokens = loss_BL.size * axes.data_size
        return collectives.all_reduce(jnp.sum(loss_BL), axes.data) / n_tokens
