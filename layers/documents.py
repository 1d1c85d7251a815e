"""Packed documents: the document ids and in-document positions of a token window.

Training windows are cut from a stream of documents, each ended by an end-of-document
token (EOS, `ModelConfig.document_eos`), so one window may hold the end of one document,
whole documents and the start of another. With document masking a position attends only
to earlier positions of its own document. The ids are a pure function of the tokens:
a document ends after its EOS, so the id of position l is the number of EOS tokens
strictly before l in the window (an exclusive cumsum; ids ascend along the row). No
input array is added: the step derives the ids from the window it already has.

The loss is unchanged: the target after an EOS (the first token of the next document)
stays a normal target, predicted from the EOS's own document (as in MaxText and
torchtitan; the EOS position learns what starts a document).

Under cp the tokens are replicated over cp, so each rank derives the ids of the whole
window and cuts its own chunks of them as it cuts the tokens (`layers.context`);
attention's keys use the whole window's ids (`layers.kernels.context`). Under pp the
ids are derived per microbatch on every stage from the microbatch's tokens.

Letter key: B batch, L tokens of the window (L_cp a cp rank's chunks), S the whole
window's keys.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from layers.axes import Axes
from layers.config import ModelConfig
from layers.context import shard_sequence
from layers.kernels.shared import SegmentIds


class Documents(NamedTuple):
    """The document structure attention sees (int32 arrays, nothing differentiable).

    ids_BL:       document id of each local token [B, L] (under cp [B, L_cp], this
                  rank's two chunks).
    window_BS:    document ids of the whole window in position order [B, S] (the keys
                  under cp; without cp the same as ids_BL).
    positions_BL: RoPE position of each local token within its document
                  (`document_positions`), or None: positions in the window."""

    ids_BL: jax.Array
    window_BS: jax.Array
    positions_BL: jax.Array | None

    def segment_ids(self) -> SegmentIds:
        """The local queries' ids against the keys of the whole window."""
        return SegmentIds(self.ids_BL, self.window_BS)


def document_ids(inputs_BL: jax.Array, eos: int) -> jax.Array:
    """Number of EOS tokens strictly before each position: [B, L] int32."""
    is_eos_BL = (inputs_BL == eos).astype(jnp.int32)
    return jnp.cumsum(is_eos_BL, axis=1) - is_eos_BL


def document_positions(inputs_BL: jax.Array, eos: int) -> jax.Array:
    """Each token's position within its document (0 at a document's first token, which
    is the window's first token or one after an EOS): [B, L] int32."""
    L = inputs_BL.shape[1]
    l_L = jnp.arange(L, dtype=jnp.int32)
    after_eos_BL = jnp.pad(inputs_BL[:, :-1] == eos, ((0, 0), (1, 0)))
    start_BL = lax.cummax(jnp.where(after_eos_BL, l_L, 0), axis=1)
    return l_L - start_BL


def documents(inputs_BL: jax.Array, cfg: ModelConfig, axes: Axes) -> Documents | None:
    """The documents of the whole windows inputs [B, L] (before the cp cut), cut as the
    tokens are; None when document masking is off (`cfg.document_eos` None)."""
    if cfg.document_eos is None:
        return None
    ids_BL = document_ids(inputs_BL, cfg.document_eos)
    positions_BL = None
    if cfg.document_positions:
        positions_BL = shard_sequence(document_positions(inputs_BL, cfg.document_eos), axes)
    return Documents(shard_sequence(ids_BL, axes), ids_BL, positions_BL)


def microbatches(docs: Documents | None, m: int) -> Documents | None:
    """Each array of `docs` [B, ...] as [M, B/M, ...] (one row per microbatch)."""
    if docs is None:
        return None
    return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), docs)
