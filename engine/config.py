"""Model presets and the training config (frozen dataclasses; no jax import)."""
from __future__ import annotations

import dataclasses

from layers.config import DTYPES, REMAT, TP_COMM, ZERO, ModelConfig

PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=192, vocab=256),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, mlp_dim=768, vocab=256),
    "medium": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, mlp_dim=1536, vocab=256),
    # Real shapes, for cost predictions (Meta's Llama 3 model card).
    "llama3-8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                      mlp_dim=14336, vocab=128256, rope_theta=500_000.0),
    "llama3-70b": dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                       mlp_dim=28672, vocab=128256, rope_theta=500_000.0),
}
ATTENTIONS = ("auto", "reference", "chunked", "blocked", "pallas")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch: int = 16  # global sequences per step
    seq: int = 256
    steps: int = 50
    lr: float = 3e-3  # peak, after linear warmup; cosine decay to lr * min_lr_ratio
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0


def model_config(preset: str, **overrides) -> ModelConfig:
    """Preset plus overrides (None values are ignored)."""
    kw = dict(PRESETS[preset])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**kw)


def config_problems(cfg: ModelConfig, tcfg: TrainConfig) -> list[str]:
    """Everything wrong with the model and training numbers, each as a short phrase."""
    problems = []
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("batch", "seq", "steps"):
        if getattr(tcfg, name) < 1:
            problems.append(f"{name}={getattr(tcfg, name)} must be >= 1")
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even (RoPE rotates pairs)")
    if cfg.n_kv_heads >= 1 and cfg.n_heads % cfg.n_kv_heads:
        problems.append(f"heads={cfg.n_heads} not divisible by kv_heads={cfg.n_kv_heads}")
    if cfg.dtype not in DTYPES:
        problems.append(f"dtype={cfg.dtype!r} not one of {sorted(DTYPES)}")
    if cfg.remat not in REMAT:
        problems.append(f"remat={cfg.remat!r} not one of {list(REMAT)}")
    if cfg.tp_comm not in TP_COMM:
        problems.append(f"tp_comm={cfg.tp_comm!r} not one of {list(TP_COMM)}")
    if cfg.zero not in ZERO:
        problems.append(f"zero={cfg.zero} not one of {list(ZERO)}")
    if cfg.prefetch and cfg.zero != 3:
        problems.append(f"--prefetch needs --zero 3 (zero {cfg.zero} keeps params replicated)")
    if not tcfg.lr > 0 or tcfg.lr > 10:
        problems.append(f"lr={tcfg.lr} must be in (0, 10]")
    if tcfg.warmup < 0:
        problems.append(f"warmup={tcfg.warmup} must be >= 0")
    return problems
