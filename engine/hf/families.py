"""config.json <-> ModelConfig for the architectures the converter supports.

    config.json field                  ModelConfig field        notes
    hidden_size                        d_model
    num_hidden_layers                  n_layers
    num_attention_heads                n_heads
    num_key_value_heads                n_kv_heads               default: n_heads
    head_dim                           head_dim                 default: d_model / n_heads
    intermediate_size                  mlp_dim                  Mixtral: each expert's
    vocab_size                         vocab                    params padded to vocab_multiple
    rms_norm_eps                       norm_eps
    rope_parameters / rope_theta       rope_theta
    rope_scaling {rope_type: llama3}   rope_scaling_factor, rope_low_freq_factor,
                                       rope_high_freq_factor, rope_original_max
    tie_word_embeddings                tie_embed
    sliding_window (Mistral)           sliding_window           refused when < the sequence
    num_local_experts (Mixtral)        experts
    num_experts_per_tok (Mixtral)      top_k                    router_renorm on, dropless
    router_aux_loss_coef (Mixtral)     aux_loss_coef            when output_router_logits,
                                                                else 0 (as HF trains); z 0

Refused (one line): another architecture, `attention_bias` or `mlp_bias` true, a
`hidden_act` other than silu, a rope type other than default / llama3.
"""
from __future__ import annotations

import json
import os

from engine.hf.io import HFError
from layers.config import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "MixtralForCausalLM": "mixtral"}


def read_config(directory: str) -> dict:
    """config.json of `directory` as a dict (HFError if missing or unreadable)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFError(f"{directory} is not a directory")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise HFError(f"{directory} has no config.json (not a Hugging Face model "
                      f"directory)") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: unreadable ({e})") from None
    if not isinstance(hf, dict):
        raise HFError(f"{path}: not a JSON object")
    return hf


def architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise HFError(f"architecture {arch} is not supported (supported: "
                      f"{', '.join(SUPPORTED)})")
    return arch


def _rope(hf: dict) -> dict:
    """The rope fields of ModelConfig from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (earlier files)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        out.update(rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max=int(params["original_max_position_embeddings"]))
    elif kind != "default":
        raise HFError(f"rope type {kind!r} is not supported (default, llama3)")
    return out


def model_config(hf: dict, vocab_multiple: int = 1, **numerics) -> ModelConfig:
    """The ModelConfig of an HF config.json; `numerics`: dtype, activations, remat,
    attention (not in the file)."""
    arch = architecture(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFError(f"{flag}: true is not supported (the model has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    try:
        heads = int(hf["num_attention_heads"])
        fields = dict(
            d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            mlp_dim=int(hf["intermediate_size"]), vocab=int(hf["vocab_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embed=bool(hf.get("tie_word_embeddings", False)),
            vocab_multiple=vocab_multiple, sliding_window=int(hf.get("sliding_window") or 0),
            **_rope(hf))
        if arch == "MixtralForCausalLM":
            fields.update(experts=int(hf["num_local_experts"]),
                          top_k=int(hf["num_experts_per_tok"]), router_renorm=True,
                          capacity_factor=0.0, shared_experts=0, z_loss_coef=0.0,
                          aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0))
                          if hf.get("output_router_logits") else 0.0)
    except KeyError as e:
        raise HFError(f"config.json lacks {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"config.json: {e}") from None
    return ModelConfig(**fields, **numerics)


def hf_config(cfg: ModelConfig, source: dict | None = None) -> dict:
    """config.json for `cfg`: the source's (architecture and the fields we do not model
    kept) with every modelled field set from `cfg`; `LlamaForCausalLM` for a native
    model."""
    out = dict(source) if source else {"architectures": ["LlamaForCausalLM"],
                                       "model_type": "llama", "hidden_act": "silu",
                                       "attention_bias": False, "mlp_bias": False,
                                       "max_position_embeddings": 2048}
    arch = architecture(out)
    out.update(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
               head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim, vocab_size=cfg.vocab,
               rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embed,
               model_type=MODEL_TYPES[arch])
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling_factor > 0:
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                    low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max)
    out.pop("rope_scaling", None)
    out.pop("rope_theta", None)
    out["rope_parameters"] = rope
    if cfg.moe:
        if arch != "MixtralForCausalLM" or cfg.shared_experts or not cfg.router_renorm:
            raise HFError("only a Mixtral-routed model (router_renorm, no shared experts) "
                          "exports with experts")
        out.update(num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k)
    elif arch == "MixtralForCausalLM":
        raise HFError("a dense model cannot export as MixtralForCausalLM")
    return out
