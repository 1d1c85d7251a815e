"""Model presets, the training config and the parallel config (frozen dataclasses)."""
from __future__ import annotations

import dataclasses

from layers.config import ModelConfig

PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=192, vocab=256),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, mlp_dim=768, vocab=256),
    # Mixtures of experts (layers/moe.py): every block's MLP is E routed SwiGLU experts.
    "moe-tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=96,
                     vocab=256, experts=8, top_k=2),
    "moe-small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                      mlp_dim=384, vocab=256, experts=8, top_k=2, shared_experts=1),
    "medium": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, mlp_dim=1536, vocab=256),
    # Real shapes, for cost predictions (Meta's Llama 3 model card).
    "llama3-8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                      mlp_dim=14336, vocab=128256, rope_theta=500_000.0),
    "llama3-70b": dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                       mlp_dim=28672, vocab=128256, rope_theta=500_000.0),
    # Mistral AI's Mixtral 8x7B (params.json of the release): 8 experts, top 2.
    "mixtral-8x7b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         mlp_dim=14336, vocab=32000, rope_theta=1_000_000.0, experts=8,
                         top_k=2),
}


# `--activations auto`: bf16 on GPUs and TPUs, what MaxText, torchtitan, Megatron-LM and
# llm-foundry run there; f32 on the CPU, where XLA:CPU runs bf16 elementwise work slower
# (`engine.train --layout single --model medium --steps 8` on this host: 1,804 tok/s with
# f32 activations, 1,117 with bf16)
AUTO_ACTIVATIONS = {"cpu": "f32", "gpu": "bf16", "tpu": "bf16"}


def platform_of(hardware: str | None = None) -> str:
    """"cpu" | "gpu" | "tpu": a cost profile's platform (engine/cost/hardware.py names:
    cpu, v4 / v5e / v5p, a100 / h100 / h100-gt), or with none the platform `engine.train`
    will run on, read without starting a JAX backend (starting one would fix the host
    device count before `force_host_devices`): JAX_PLATFORMS's first entry when set,
    else "tpu" / "gpu" when libtpu / a CUDA or ROCm plugin is installed, else "cpu"."""
    import importlib.util
    import os

    if hardware is not None:
        return "cpu" if hardware == "cpu" else "tpu" if hardware.startswith("v") else "gpu"
    chosen = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm", "gpu") else chosen
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"):
        if importlib.util.find_spec(plugin) is not None:
            return "gpu"
    return "cpu"


def resolve_activations(value: str, hardware: str | None = None) -> str:
    """The activation dtype `--activations value` means: itself, or for "auto" the
    platform's (`AUTO_ACTIVATIONS`, `platform_of`)."""
    return AUTO_ACTIVATIONS.get(platform_of(hardware), "f32") if value == "auto" else value


class ConfigError(ValueError):
    """Settings that cannot run together (engine/parallel/validate.py); the message is one line."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch: int = 16  # global sequences per step
    seq: int = 256
    steps: int = 50
    lr: float = 3e-3  # peak, after linear warmup; then `schedule` to lr * min_lr_ratio
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    # the step the lr schedule's decay ends at; None: `steps` (engine/run/optim.py)
    schedule_steps: int | None = None
    eps: float = 1e-8  # Adam's
    schedule: str = "cosine"  # after warmup: one of LR_SCHEDULES
    decay_fraction: float = 0.2  # warmup-stable-decay: the share of the steps that decay

    @property
    def horizon(self) -> int:
        """The step the learning-rate schedule decays to its floor at."""
        return self.schedule_steps or self.steps


# the learning rate after warmup (engine/run/optim.py `schedule`): name -> what it does
LR_SCHEDULES = {
    "cosine": "cosine decay from the peak to lr x min-lr-ratio",
    "linear": "linear decay from the peak to lr x min-lr-ratio",
    "constant": "the peak lr to the end (min-lr-ratio unused)",
    "warmup-stable-decay": "the peak lr, then a linear decay to lr x min-lr-ratio over the "
                           "last --decay-fraction of the steps",
}

# the dtypes fsdp may reduce-scatter weight grads in (ParallelConfig.grad_reduce)
GRAD_REDUCES = ("compute", "f32")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the layout's axes are used, apart from the model's shape. Each registry entry
    a switch names carries its one description (`doc`), which `--help` and
    docs/parallelism.md print (`engine.cli.args.switch_table`).

    zero:     what the fsdp axis shards: a level of `engine.parallel.zero.ZERO_LEVELS`.
    prefetch: zero 3: gather layer i+1's weights before layer i's compute.
    tp_comm:  how tp moves activations: a strategy of `collectives.ring.TP_COMMS`.
    cp_comm:  how attention reaches the keys of the other cp ranks: a strategy of
              `layers.kernels.context.CP_COMMS`.
    microbatches: the per-device batch is split into this many microbatches whose grads
              are accumulated before one optimizer update (the same loss and grads as
              one microbatch; activations of one microbatch alive at a time). Under
              pp these are the microbatches the pipeline schedule moves.
    pp_schedule: the pipeline schedule over the pp axis: a schedule of
              `engine.parallel.pipeline.SCHEDULES`.
    pp_virtual: the chunks per device of the interleaved schedule (1 otherwise).
    grad_reduce: the dtype fsdp reduce-scatters weight grads in (zero 2 and 3): compute =
              the compute dtype the weights were gathered in (half the bytes of f32);
              f32 = the params' (the cotangent cast back before the reduce-scatter),
              as PyTorch FSDP's mixed precision in torchtitan and llm-foundry
              (reduce_dtype float32). dp and zero 1 all-reduce grads in f32 either way.
    """

    zero: int = 3
    prefetch: bool = False
    tp_comm: str = "allreduce"
    cp_comm: str = "allgather"
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    grad_reduce: str = "compute"


def model_config(preset: str, **overrides) -> ModelConfig:
    """Preset plus overrides (None values are ignored)."""
    kw = dict(PRESETS[preset])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**kw)
