"""The one table between Hugging Face tensor names and the param table
(engine/parallel/params.py), read in both directions.

Each row: the HF name (`{n}` the layer, `{e}` the expert), the HF tensor's dims as
letters (a torch Linear weight is [out, in]; a pair of letters in parentheses is one
flattened dim), our param, and our per-layer (per-expert) dims. Import reshapes the HF
tensor to its letters and transposes it to ours; export does the reverse. No q/k
permutation: HF's Llama (and Mistral, Mixtral) checkpoints are already in the
rotate-half RoPE layout (pairs k, k + K/2) that layers/rope.py uses.

    HF tensor                                          HF dims   param              ours
    model.embed_tokens.weight                          V D       embed              V D
    model.layers.{n}.input_layernorm.weight            D         blocks/attn_norm   D
    model.layers.{n}.self_attn.q_proj.weight           (H K) D   blocks/wq          D H K
    model.layers.{n}.self_attn.k_proj.weight           (G K) D   blocks/wk          D G K
    model.layers.{n}.self_attn.v_proj.weight           (G K) D   blocks/wv          D G K
    model.layers.{n}.self_attn.o_proj.weight           D (H K)   blocks/wo          H K D
    model.layers.{n}.post_attention_layernorm.weight   D         blocks/mlp_norm    D
    model.layers.{n}.mlp.gate_proj.weight              F D       blocks/wg          D F
    model.layers.{n}.mlp.up_proj.weight                F D       blocks/wu          D F
    model.layers.{n}.mlp.down_proj.weight              D F       blocks/wd          D F
    model.layers.{n}.block_sparse_moe.gate.weight      E D       blocks/router      D E
    model.layers.{n}.block_sparse_moe.experts.{e}.w1.weight  F D  blocks/we_g [e]    D F
    model.layers.{n}.block_sparse_moe.experts.{e}.w3.weight  F D  blocks/we_u [e]    D F
    model.layers.{n}.block_sparse_moe.experts.{e}.w2.weight  D F  blocks/we_d [e]    F D
    model.norm.weight                                  D         final_norm         D
    lm_head.weight                                     V D       unembed            D V

`lm_head.weight` is absent with `tie_word_embeddings` (our `tie_embed`: no `unembed`).
Our V is `padded_vocab`: import appends zero rows for the padding ids, export drops them.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from engine.parallel.params import _dims, table
from layers.config import ModelConfig

# (HF name, HF letters, param, our letters per layer / per expert)
ROWS = (
    ("model.embed_tokens.weight", "VD", "embed", "VD"),
    ("model.layers.{n}.input_layernorm.weight", "D", "blocks/attn_norm", "D"),
    ("model.layers.{n}.self_attn.q_proj.weight", "(HK)D", "blocks/wq", "DHK"),
    ("model.layers.{n}.self_attn.k_proj.weight", "(GK)D", "blocks/wk", "DGK"),
    ("model.layers.{n}.self_attn.v_proj.weight", "(GK)D", "blocks/wv", "DGK"),
    ("model.layers.{n}.self_attn.o_proj.weight", "D(HK)", "blocks/wo", "HKD"),
    ("model.layers.{n}.post_attention_layernorm.weight", "D", "blocks/mlp_norm", "D"),
    ("model.layers.{n}.mlp.gate_proj.weight", "FD", "blocks/wg", "DF"),
    ("model.layers.{n}.mlp.up_proj.weight", "FD", "blocks/wu", "DF"),
    ("model.layers.{n}.mlp.down_proj.weight", "DF", "blocks/wd", "DF"),
    ("model.layers.{n}.block_sparse_moe.gate.weight", "ED", "blocks/router", "DE"),
    ("model.layers.{n}.block_sparse_moe.experts.{e}.w1.weight", "FD", "blocks/we_g", "DF"),
    ("model.layers.{n}.block_sparse_moe.experts.{e}.w3.weight", "FD", "blocks/we_u", "DF"),
    ("model.layers.{n}.block_sparse_moe.experts.{e}.w2.weight", "DF", "blocks/we_d", "FD"),
    ("model.norm.weight", "D", "final_norm", "D"),
    ("lm_head.weight", "VD", "unembed", "DV"),
)
BY_PARAM = {row[2]: row for row in ROWS}


def _letters(spec: str) -> tuple[str, tuple[str, ...]]:
    """`(HK)D` -> ("HKD", ("HK", "D")): the dims unflattened, and the stored dims."""
    stored = tuple(m.group(1) or m.group(2) for m in re.finditer(r"\(([A-Z]+)\)|([A-Z])", spec))
    return "".join(stored), stored


def hf_shape(spec: str, dims: dict) -> tuple[int, ...]:
    """The stored shape of an HF tensor with dims `spec` (HF's V: the real vocab)."""
    return tuple(int(np.prod([dims[c] for c in group])) for group in _letters(spec)[1])


def _hf_dims(cfg: ModelConfig) -> dict:
    return dict(_dims(cfg), V=cfg.vocab)


def _slots(cfg: ModelConfig, param: str) -> list[tuple[str, tuple]]:
    """(HF name, index into our stacked param) of every HF tensor behind `param`."""
    name = BY_PARAM[param][0]
    layers = range(cfg.n_layers) if "{n}" in name else [None]
    experts = range(cfg.experts) if "{e}" in name else [None]
    return [(name.format(n=n, e=e), tuple(i for i in (n, e) if i is not None))
            for n in layers for e in experts]


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple]]:
    """[(HF name, HF shape)] of the model, in the param table's order."""
    dims = _hf_dims(cfg)
    return [(hf_name, hf_shape(BY_PARAM[param][1], dims))
            for param in table(cfg) for hf_name, _ in _slots(cfg, param)]


def to_ours(param: str, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One HF tensor (stored dims) -> our per-layer (per-expert) array, V padded."""
    _, hf_spec, _, ours = BY_PARAM[param]
    dims = _hf_dims(cfg)
    flat, _ = _letters(hf_spec)
    y = np.einsum(f"{flat}->{ours}", x.reshape([dims[c] for c in flat]))
    if "V" in ours and cfg.padded_vocab != cfg.vocab:
        pad = [(0, cfg.padded_vocab - cfg.vocab) if c == "V" else (0, 0) for c in ours]
        y = np.pad(y, pad)
    return y


def to_hf(param: str, y: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Our per-layer (per-expert) array -> the HF tensor's stored shape, padding dropped."""
    _, hf_spec, _, ours = BY_PARAM[param]
    dims = _hf_dims(cfg)
    if "V" in ours:
        y = y[tuple(slice(0, cfg.vocab) if c == "V" else slice(None) for c in ours)]
    flat, _ = _letters(hf_spec)
    return np.ascontiguousarray(np.einsum(f"{ours}->{flat}", y)).reshape(hf_shape(hf_spec,
                                                                                   dims))


def import_param(param: str, shape: tuple, cfg: ModelConfig, get) -> np.ndarray:
    """Our whole param `param` of global `shape` (f32), filled tensor by tensor from
    `get(hf_name)`; only this param and one HF tensor are in memory at once."""
    out = np.empty(shape, np.float32)
    for hf_name, index in _slots(cfg, param):
        out[index] = to_ours(param, get(hf_name), cfg)
    return out


def export_param(param: str, y: np.ndarray, cfg: ModelConfig) -> Iterator[tuple[str, object]]:
    """(HF name, make) of every HF tensor behind our param array `y` (global shape)."""
    for hf_name, index in _slots(cfg, param):
        yield hf_name, lambda index=index: to_hf(param, y[index], cfg)
