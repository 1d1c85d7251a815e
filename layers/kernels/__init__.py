"""Attention kernels and the table `layers/attention.py` picks one from.

Every kernel has the signature in layers/kernels/shared.py:
`kernel(q_BLHK, k_BSGK, v_BSGK, *, causal=True, axes=None, **options) -> o_BLHK`.

  reference  reference.py  dense scores, f32; takes the global positions of the first
                           query and key (q_offset, k_offset)
  chunked    chunked.py    dense scores per query chunk, causal tiles skipped, flash bwd
  blocked    blocked.py    scan over key blocks (online softmax), O(L * block) memory
  pallas     pallas.py     Pallas forward, dQ and dK/dV kernels (interpret mode on CPU)

A kernel that communicates (over a mesh axis named in `axes`) is one more entry here.
"""
from __future__ import annotations

from layers.kernels.blocked import blocked_attention
from layers.kernels.chunked import chunked_attention
from layers.kernels.pallas import pallas_attention
from layers.kernels.reference import reference_attention
from layers.kernels.shared import BlockSizes

KERNELS = {"reference": reference_attention, "chunked": chunked_attention,
           "blocked": blocked_attention, "pallas": pallas_attention}

# Sequences at least this long use the blocked flash path under `attention="auto"`: from
# there on dense O(L^2) scores dominate memory (bench/attention.py). Shorter ones use
# `chunked`: dense scores, causal tiles skipped, flash backward (the fastest kernel on
# CPU at L = 256: bench/results/2026-11-22-attention-zen5c2.md).
AUTO_BLOCKED_FROM = 1024


def resolve_attention(name: str, seq: int) -> str:
    """The kernel `ModelConfig.attention` names for sequences of `seq` tokens: `auto` is
    `blocked` from AUTO_BLOCKED_FROM tokens on, else `chunked`."""
    if name == "auto":
        return "blocked" if seq >= AUTO_BLOCKED_FROM else "chunked"
    return name


def attention_kernel(name: str, seq: int):
    """The kernel function `name` resolves to for sequences of `seq` tokens."""
    return KERNELS[resolve_attention(name, seq)]


__all__ = ["KERNELS", "AUTO_BLOCKED_FROM", "BlockSizes", "attention_kernel", "resolve_attention",
           "blocked_attention", "chunked_attention", "pallas_attention", "reference_attention"]
