"""Attention kernels' published speeds: the `Hardware.attention_rates` of the GPU profiles
(engine/cost/hardware.py), and the profile fields of the kernels a framework may run
instead: older attention kernels (`KERNELS`) and a fused cross-entropy loss
(`FUSED_CROSS_ENTROPY`), as bench/published.py's frameworks name them.

Each table is transcribed from the figure named beside it; the comment below says which
kernel, chip, mask and head dim each figure measures.
"""
from __future__ import annotations

# Attention: the flash kernel XLA calls on GPU (cuDNN fused attention), bf16, head
# dim 128, causal.
# - H100: `attention_rates` from the FlashAttention-3 paper (Shah et al. 2024,
#   arXiv:2407.08608), H100 80GB SXM5, head dim 128, sequence 512 to 16k at 16k tokens
#   per batch: the forward figure with causal mask (Fig. 5, "Attention forward speed")
#   and the backward figure, published without causal mask only (Fig. 6, "Attention
#   backward speed"), taken as the causal backward's (an upper bound: at short
#   sequences a causal kernel runs below its non-causal speed, as the forward does).
#   cuDNN: forward 315 / 410 / 484 / 518 / 529 / 539 TFLOP/s, backward 305 / 408 / 465 /
#   499 / 518 / 516 at 512 / 1k / 2k / 4k / 8k / 16k (`H100_CUDNN`).
# - A100: FlashAttention-2 (Dao 2023, arXiv:2307.08691): forward + backward at 50-73% of
#   the A100's peak across its benchmarks, head dim 128 causal near the low end:
#   attention_eff 0.55 of the peak for both, over the causal tiles computed
#   (price.causal_tile_fraction); no per-length figures are transcribed here.
# A run whose framework called an older kernel is priced at that kernel's rate
# (`FLASH_ATTENTION_2`): FlashAttention-2 on H100 (no WGMMA / TMA, written for Ampere),
# same figures of the FlashAttention-3 paper: forward with causal mask 191 / 260 / 298 /
# 319 / 333 / 335 TFLOP/s (backward without it 214 / 260 / 291 / 310 / 318 / 322). Its
# causal backward is what the causal forward + backward of the flash-attention
# repository's H100 figure (assets/flash2_h100_fwd_bwd_benchmark.png, the
# FlashAttention-2 paper's Fig. 7d, "FlashAttention-2", causal, head dim 128) leaves
# after that forward: 163 / 221 / 265 / 294 / 308 / 328 TFLOP/s forward + backward, in
# the benchmark's convention of 2.5 forwards' FLOPs a backward (its
# benchmarks/benchmark_flash_attention.py `flops`), so backward = 2.5 / (3.5 / fwd_bwd -
# 1 / fwd): 154 / 208 / 254 / 285 / 299 / 325 (`causal_backward`), below the non-causal
# backward at every length but 16k, as a causal kernel's skipped and masked tiles make
# it. On A100 FlashAttention-2 is the kernel the profile already prices (0.55).
# The first FlashAttention's kernels (`FLASH_ATTENTION_TRITON`): its Triton port
# (flash_attn_triton.py of the flash-attention repository, Triton before its MLIR
# backend) on A100, and the CUDA kernel (FlashAttention-1) on H100, from the benchmark
# figures of the flash-attention repository's README (assets/flash2_a100_fwd_bwd_benchmark.png
# and flash2_h100_fwd_bwd_benchmark.png, the FlashAttention-2 paper's Figs. 4 and 7),
# forward + backward with causal mask, head dim 128, 512 / 1k / 2k / 4k / 8k / 16k:
# "FlashAttention Triton" on A100 80GB SXM4 50 / 61 / 68 / 74 / 78 / 80 TFLOP/s;
# "FlashAttention" on H100 80GB SXM5 98 / 109 / 108 / 126 / 135 / 137. The figures give
# forward + backward only, so both passes are priced at that rate (exact for their sum,
# the step's case without recomputation). No H100 figure of the Triton port is
# published; the CUDA kernel stands for it: on the A100 figure the two are within 1-5
# TFLOP/s at every length (FlashAttention 55 / 62 / 69 / 76 / 80 / 83), and the port's
# own docstring says "Overall Triton forward + backward is slightly slower than CUDA
# forward + backward".

# (sequence, forward TFLOP/s, backward TFLOP/s) of the FlashAttention-3 paper's
# H100 SXM5 benchmarks, head dim 128 (the figures in the comment above)
H100_CUDNN = ((512, 315, 305), (1024, 410, 408), (2048, 484, 465), (4096, 518, 499),
              (8192, 529, 518), (16384, 539, 516))
H100_FA2_FWD = ((512, 191), (1024, 260), (2048, 298), (4096, 319), (8192, 333),
                (16384, 335))
# (sequence, forward + backward TFLOP/s) of FlashAttention-2 on H100, causal, head dim 128
H100_FA2_FWD_BWD = ((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308),
                    (16384, 328))


def causal_backward(forward, forward_backward) -> tuple:
    """((sequence, forward, backward TFLOP/s), ...) from a kernel's published forward
    and forward + backward speeds at the same sequences: the backward's time is the pair's
    less the forward's, its FLOPs 2.5 forwards' (the flash-attention benchmarks' count)."""
    both = dict(forward_backward)
    return tuple((s, f, 2.5 / (3.5 / both[s] - 1 / f)) for s, f in forward)


H100_FA2 = causal_backward(H100_FA2_FWD, H100_FA2_FWD_BWD)
# (sequence, forward + backward TFLOP/s) of the first FlashAttention's kernels, head dim
# 128, causal (the figures in the comment above)
A100_FA_TRITON = ((512, 50), (1024, 61), (2048, 68), (4096, 74), (8192, 78), (16384, 80))
H100_FA1 = ((512, 98), (1024, 109), (2048, 108), (4096, 126), (8192, 135), (16384, 137))


# the bf16 peaks the benchmarks' chips are rated at (H100 SXM5, A100 SXM4)
H100_SXM_BF16 = 989e12
A100_SXM_BF16 = 312e12


def flash_rates(peak: float, table) -> tuple:
    """`Hardware.attention_rates` from ((sequence, forward, backward TFLOP/s), ...)
    measured on a chip of bf16 matmul `peak` FLOP/s; ((sequence, forward + backward),
    ...): both passes at that rate."""
    return tuple((s, r[0] * 1e12 / peak, r[-1] * 1e12 / peak) for s, *r in table)


# The profile fields of FlashAttention-2 (the kernel PyTorch's SDPA flash backend and
# flash-attn 2 run) per GPU profile, from the figures above.
_H100_FA2 = dict(attention_rates=flash_rates(H100_SXM_BF16, H100_FA2))
FLASH_ATTENTION_2 = {"h100": _H100_FA2, "h100-gt": _H100_FA2,
                     "a100": dict(attention_eff=0.55, attention_rates=())}
# The profile fields of the first FlashAttention's kernels (its Triton port on A100, the
# CUDA kernel standing for it on H100), from the figures above.
_H100_FA1 = dict(attention_rates=flash_rates(H100_SXM_BF16, H100_FA1))
FLASH_ATTENTION_TRITON = {"h100": _H100_FA1, "h100-gt": _H100_FA1,
                          "a100": dict(attention_eff=0.0, attention_rates=flash_rates(
                              A100_SXM_BF16, A100_FA_TRITON))}
# A GPU run whose loss is flash-attn's fused softmax cross-entropy (its CrossEntropyLoss,
# the xentropy CUDA kernel: llm-foundry's MPT `loss_fn` default, `fused_crossentropy`,
# llmfoundry/models/mpt/modeling_mpt.py): its forward saves the logits as they come (bf16
# under autocast) and its backward writes dlogits with `torch.empty_like(logits)`, so the
# loss holds two compute-dtype [B, L, V] buffers where an f32 loss holds f32 ones
# (engine/cost/memory_items.py `loss_items`).
FUSED_CROSS_ENTROPY = dict(memory_platform="accelerator-xentropy")
# a framework's attention kernel (bench/published.py `FRAMEWORKS`) -> its fields
KERNELS = {"flash2": FLASH_ATTENTION_2, "triton": FLASH_ATTENTION_TRITON}
