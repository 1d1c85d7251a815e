"""Tiny random-init Hugging Face models made with `save_pretrained`, and transformers'
logits, loss and grads on them: the reference the HF tests compare shardwise with.

Every family has 2 layers, d 64, 4 query heads over 2 kv heads (GQA), head dim 16 and a
vocab of 1001 (not a multiple of 8, nor of any tp). The weights are HF's init plus noise
of std 0.1 on every tensor (norm scales included), so that no mapping error (a swapped
norm, a transposed projection, unscaled RoPE) hides behind near-zero weights.
"""
from __future__ import annotations

import numpy as np

VOCAB = 1001
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # short, so that the scaled band covers most frequencies at seq 16
               "original_max_position_embeddings": 32}


def families() -> dict:
    """{name: (config class name, model class name, config kwargs)}."""
    return {
        "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON)),
        "llama31": ("LlamaConfig", "LlamaForCausalLM",
                    dict(COMMON, rope_parameters=LLAMA3_ROPE)),
        "llama32-tied": ("LlamaConfig", "LlamaForCausalLM",
                         dict(COMMON, tie_word_embeddings=True,
                              rope_parameters=LLAMA3_ROPE)),
        "mistral": ("MistralConfig", "MistralForCausalLM",
                    dict(COMMON, sliding_window=None, rope_parameters={
                        "rope_type": "default", "rope_theta": 1_000_000.0})),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    dict(COMMON, num_local_experts=4, num_experts_per_tok=2)),
    }


def save(name: str, directory: str, seed: int = 0) -> str:
    """Make family `name` with transformers, perturb it, `save_pretrained` it."""
    import torch
    import transformers

    cfg_cls, model_cls, kwargs = families()[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def load(directory: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")


def logits(directory: str, tokens_BL: np.ndarray) -> np.ndarray:
    """transformers' logits [B, L, V] (f32, eager attention)."""
    import torch

    with torch.no_grad():
        return load(directory)(torch.tensor(tokens_BL, dtype=torch.long)).logits.numpy()


def loss_and_grads(directory: str, tokens_BL1: np.ndarray) -> tuple[float, dict]:
    """Mean next-token cross-entropy of tokens [B, L+1] (inputs [:, :-1], targets
    [:, 1:]) and its grad of every tensor by torch autograd, {HF name: array}."""
    import torch

    model = load(directory)
    x = torch.tensor(tokens_BL1, dtype=torch.long)
    out = model(x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             x[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        grads.update(_saved_names(n, p.grad.numpy()))
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return float(loss.detach()), grads


def _saved_names(name: str, g: np.ndarray) -> dict:
    """transformers 5 keeps Mixtral's experts fused in memory (`mlp.experts.gate_up_proj`
    [E, 2F, D], gate rows first; `mlp.experts.down_proj` [E, D, F]; `mlp.gate`) and
    splits them into the per-expert names of the files (w1 gate, w3 up, w2 down) when
    saving: the grads are named as the files name the tensors."""
    prefix, _, leaf = name.rpartition(".mlp.")
    moe = f"{prefix}.block_sparse_moe"
    if leaf == "gate.weight":
        return {f"{moe}.gate.weight": g}
    if leaf == "experts.gate_up_proj":
        F = g.shape[1] // 2
        return {k: v for e in range(g.shape[0]) for k, v in (
            (f"{moe}.experts.{e}.w1.weight", g[e, :F]),
            (f"{moe}.experts.{e}.w3.weight", g[e, F:]))}
    if leaf == "experts.down_proj":
        return {f"{moe}.experts.{e}.w2.weight": g[e] for e in range(g.shape[0])}
    return {name: g}


def generate(directory: str, prompt_BL: np.ndarray, new: int) -> np.ndarray:
    """transformers' greedy continuation [B, new] of equal-length prompts."""
    import torch

    with torch.no_grad():
        out = load(directory).generate(torch.tensor(prompt_BL, dtype=torch.long), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False)
    return out[:, prompt_BL.shape[1]:].numpy()
