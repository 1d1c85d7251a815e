"""Hardware profiles: what one chip computes and moves per second, from published specs.

Peak figures are dense (no sparsity) per chip. Efficiency factors turn peaks into what
well-tuned kernels reach, each justified where it is set. The attention kernels' rates
are in engine/cost/attention_rates.py; the `cpu` profile, measured on this machine by
`bench/calibrate.py`, in engine/cost/calibration.py.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from engine.cost.attention_rates import A100_SXM_BF16, H100_CUDNN, H100_SXM_BF16, flash_rates
from engine.cost.nccl import NcclNet


@dataclasses.dataclass(frozen=True)
class Link:
    """One tier of interconnect as one device sees it along a mesh axis.

    bandwidth: bytes/s a device sends in one ring step (for a bidirectional ring on a
    torus axis, both directions); latency: seconds per ring hop."""

    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class Hardware:
    """peak_flops: matmul FLOP/s per operand dtype; vector_flops: elementwise FLOP/s of
    arithmetic (add, mul, select, convert, div, sqrt, ...: a few vector instructions an
    element); transcendental_flops: of the ops evaluated by polynomial approximation
    (`price.TRANSCENDENTAL`: exp, log, logistic, tanh, ...), 0: at vector_flops;
    hbm: memory bytes/s; fast / slow: links inside / across `fast_domain` devices (a
    GPU node over NVLink, a TPU slice over ICI) and beyond it (InfiniBand, DCN).
    *_eff: fraction of peak well-tuned kernels reach. overlap: FSDP weight gathers and
    grad reduce-scatters (independent of activations) run under compute (XLA's async
    collectives / latency-hiding scheduler); on CPU collectives are synchronous.
    shared_host: all devices are threads of one host sharing its cores, so per-device
    compute adds up across devices (forced host-platform devices).
    bf16_collectives_in_f32: the runtime moves bf16 collectives of the
    `ledger.WIDENED_KINDS` as f32 (XLA on CPU; the audit's `cpu_bf16_collectives_in_f32`
    rule), so they cost twice their ledger bytes.
    cold_hbm: bytes/s of traffic the caches do not hold (the stack's share of a
    `Row.scan_stack` row: a scan's stacked inputs and outputs, written an iteration loop
    before they are read), page faults apart (`fault_cost`); 0: `hbm`
    (accelerators: their memory rate is HBM's whatever the reuse distance)."""

    name: str
    peak_flops: dict
    vector_flops: float
    hbm: float
    fast: Link
    slow: Link
    fast_domain: int
    matmul_eff: float = 1.0
    # the share of its matmul rate a chip sustains once its tensor cores hold it at its
    # power limit, where the measurement behind matmul_eff is a short burst at the boost
    # clock (GPUs: `HOPPER_SUSTAINED`); 1: the rate as measured
    matmul_sustained: float = 1.0
    mem_eff: float = 1.0
    link_eff: float = 1.0
    overlap: bool = True
    # with `overlap`: how much slower compute kernels run while a collective runs beside
    # them (a GPU's collectives are kernels on the same SMs and HBM), as a fraction of
    # their time alone; a hidden collective still costs slowdown / (1 + slowdown) of its
    # own time (engine/cost/price.py)
    overlap_slowdown: float = 0.0
    # without `overlap` (a shared host): a collective the overlap model would hide
    # (`price.hideable`) still runs beside compute there, as XLA:CPU runs a device's
    # independent ops at once, and the two contend for the cores: it costs 1 +
    # beside_cost times its own time (engine/cost/microbench_comm.py `beside_cost`)
    beside_cost: float = 0.0
    shared_host: bool = False
    bf16_collectives_in_f32: bool = False
    collective_fit: dict = dataclasses.field(default_factory=dict)
    # Row.dot -> measured seconds of one execution (engine/cost/microbench.py); a dot
    # found here is priced by its measurement instead of the roofline
    dot_seconds: dict = dataclasses.field(default_factory=dict)
    # price.collective_key(row) -> measured seconds of one execution, every group of the
    # row's size running it at once (engine/cost/microbench.py); a collective found here
    # is priced by its measurement instead of `collective_fit` or the link formulas
    collective_seconds: dict = dataclasses.field(default_factory=dict)
    # the rates were measured with every device running at once (microbench), so a
    # shared host's compute is not multiplied by the device count again
    concurrent_rates: bool = False
    # accelerator XLA: fusion groups formed across inlined calls and into matmul
    # epilogues price memory traffic (Row.fused_bytes); CPU keeps Row.bytes
    fusion: bool = False
    # with `fusion`: a matmul's elementwise consumers join its kernel (XLA:TPU's
    # convolution fusions); False where a matmul is a library call that writes its
    # product (GPU: cuBLAS; engine/cost/fusion.py)
    epilogue_fusion: bool = True
    # flash attention kernel: fraction of the matmul peak its causal fwd + bwd reaches
    # (0: no kernel, the jnp key-block scan is priced as it runs, the CPU's case), and
    # its square score tile (queries = keys per tile)
    attention_eff: float = 0.0
    attention_tile: int = 128
    # the kernel's published speed per sequence length, where a benchmark gives it:
    # ((keys, forward, backward) as fractions of the bf16 matmul peak the benchmark ran
    # at, ...), in the benchmarks' FLOP convention (a causal kernel is credited half the
    # [L, L] FLOPs). When set, it prices the kernel instead of attention_eff and the tile
    # fraction (`attention_fraction`)
    attention_rates: tuple = ()
    # HBM per chip, bytes (what a step's peak must fit in); 0: unknown
    hbm_capacity: float = 0.0
    cold_hbm: float = 0.0
    # the memory model's platform for a chip (engine/cost/memory.py): "accelerator" (a
    # GPU, whose FlashAttention backward accumulates dq in an f32 HBM buffer),
    # "accelerator-xentropy" (the same with a fused cross-entropy loss,
    # `FUSED_CROSS_ENTROPY`) or "tpu" (Pallas kernels, accumulating in VMEM); a shared
    # host is "cpu" whatever this says
    memory_platform: str = "accelerator"
    # the MFU denominator per operand dtype, when it is not `peak_flops`: on the CPU,
    # `peak_flops` is the rate the step's own matmul shapes reach (what pricing uses)
    # and this is the best rate a large matmul reaches (engine/run/mfu.py's measurement)
    mfu_peak: dict = dataclasses.field(default_factory=dict)
    transcendental_flops: float = 0.0
    # TPUs: the side lengths of the torus a slice's ICI is built from; a mesh axis inside
    # a slice fills them in turn and runs its rings on every dimension it spans at once
    # (`price.torus_link`); (): one ring over the fast link
    torus: tuple = ()
    # GPUs: the bus bandwidths nccl-tests measures on the platform; collectives are then
    # priced as NCCL runs them (engine/cost/nccl.py) instead of the link formulas
    nccl: object = None
    # a shared host: seconds per byte that first touching freshly mapped memory adds (the
    # kernel's page fault and zero fill), the price of a step's temporaries mapped anew
    # each step (engine/run/host.py `mapped_each_step`, `price.fault_seconds`); 0: not priced
    fault_cost: float = 0.0
    # a shared host: bytes/s (read + written) one device gets copying a dot operand into
    # the layout XLA:CPU's dot library takes while every device does (`Row.relayout`,
    # engine/cost/microbench.py `relayout_bandwidth`); 0: such copies are not run (a
    # GPU's or TPU's dot kernels read transposed operands in place)
    relayout_bw: float = 0.0
    source: str = ""

    def matmul_peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def matmul_rate(self, dtype: str) -> float:
        """FLOP/s a training step's matmuls of `dtype` run at: the peak times
        matmul_eff times matmul_sustained."""
        return self.matmul_peak(dtype) * self.matmul_eff * self.matmul_sustained

    @property
    def hidden_comm_share(self) -> float:
        """Share of a hidden collective's time left on the critical path: the compute it
        hides under takes 1 + overlap_slowdown times as long."""
        return self.overlap_slowdown / (1 + self.overlap_slowdown)

    @property
    def flash(self) -> bool:
        """Whether attention runs as a flash kernel (else the jnp scan, the CPU's case)."""
        return bool(self.attention_eff or self.attention_rates)

    def attention_fraction(self, keys: int, backward: bool) -> float:
        """Fraction of the matmul peak the flash kernel's forward (or backward) reaches
        over `keys` keys: `attention_rates` interpolated in log2(keys) and held at its
        ends; attention_eff without them."""
        if not self.attention_rates:
            return self.attention_eff
        points = [(math.log2(k), b if backward else f) for k, f, b in self.attention_rates]
        x = math.log2(max(keys, 1))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def mfu_peak_of(self, dtype: str) -> float:
        """Peak matmul FLOP/s of `dtype` on one chip (on a shared host: on the host)."""
        return self.mfu_peak.get(dtype) or self.matmul_peak(dtype)


# TPU: bf16 MXU peak, HBM and ICI from Google's Cloud TPU system-architecture pages (and
# the scaling book's table: ICI one-way 4.5e10 B/s per link on v4/v5e, 9e10 on v5p). A
# mesh axis laid on a torus axis with wraparound is a bidirectional ring: 2 links' worth.
# f32 operands run at the bf16 rate (JAX's default matmul precision on TPU is one bf16
# pass). Vector units are not published as FLOP/s: peak/8 is an assumption (elementwise
# work on TPU is HBM-bound far before the VPU limits it). matmul_eff 0.85: large bf16
# matmuls in MaxText profiles reach 85-90% of MXU peak; HBM 0.9 (streaming copies);
# ICI 0.9 of link rate. DCN (across slices): 25 GB/s per host over 4 chips ~ 6.25e9/chip.
#
# Attention on TPU runs the Pallas flash / splash kernel (jax.experimental.pallas.ops.tpu),
# whose MXU work is the same [128, 128]-tiled matmuls as a dense layer's, plus the
# softmax on the VPU/EUP. No kernel-level TFLOP/s for it is published; it is priced at
# attention_eff = 0.5 of the MXU peak, the FlashAttention-2 paper's forward + backward
# fraction on A100 (below) taken as the same order for a tiled online-softmax kernel
# (an assumption, not a TPU measurement). HBM per chip: 32 GiB (v4), 16 GiB (v5e),
# 95 GiB (v5p), Cloud TPU system-architecture pages. No overlap_slowdown: no measurement
# of compute beside collectives on TPU was found (the GPU figure below is of collectives
# run as kernels on the compute cores; a TPU moves ICI data with DMA engines).
#
# ICI topology (`torus`): v5e slices are 2D tori of up to 16x16 chips (Cloud TPU v5e
# page: 256 chips a pod, "2D torus"); v4 and v5p slices are 3D tori built of 4x4x4 cubes
# ("All 4x4x4 and larger slices (one cube) have full 3D torus", Cloud TPU v5p page). A
# collective over an axis spanning d torus dimensions runs a bidirectional ring on each
# at once, each moving 1/d of the data: d times one dimension's bandwidth ("How to
# Scale Your Model", Austin et al. 2025, part 3: an AllGather over several ICI axes gets
# the bandwidth of each axis), with sum(side - 1) hops of the rings it runs in turn.
# Per-hop latencies (1 us ICI, 10 us DCN) are not from a published measurement.
def _tpu(name, bf16, hbm, ici_one_way, fast_domain, capacity, torus):
    return Hardware(name, {"bfloat16": bf16, "float32": bf16}, bf16 / 8, hbm,
                    Link(2 * ici_one_way, 1e-6), Link(6.25e9, 1e-5), fast_domain,
                    matmul_eff=0.85, mem_eff=0.9, link_eff=0.9, fusion=True,
                    attention_eff=0.5, hbm_capacity=capacity, memory_platform="tpu",
                    torus=torus, source="published specs")


# GPUs: NVIDIA A100-SXM4-80GB / H100-SXM5 datasheets: bf16 dense tensor-core peak; f32
# matmuls at the dense TF32 tensor-core peak (JAX's default precision on Ampere and later
# lets f32 dots use TF32); FP32 (non-tensor) for elementwise; HBM, NVLink per direction (600 / 900 GB/s bidirectional)
# within an 8-GPU node, one 200 Gb/s HDR (A100) / 400 Gb/s NDR (H100) NIC per GPU across
# nodes. matmul_eff: cuBLAS large bf16 GEMMs reach ~80% (A100, ~250 TFLOP/s) and ~75%
# (H100, ~740 TFLOP/s): below the best shape of a brute-force shape search, the
# "maximum achievable matmul FLOPS" of Bekman's ml-engineering book (compute/accelerator,
# mamf-finder.py, torch 2.6-2.7): 271.2 TFLOP/s on A100 SXM (86.9%), 794.5 on H100 SXM
# (80.3%), as a model's own shapes are not the best one. Those are bursts at the boost
# clock (100 iterations after 50 warmup a shape, well under a second); a training step
# holds the tensor cores busy for seconds and the clock settles where the board's power
# limit holds it. The same benchmark now reports both (ml-engineering, branch
# fast-mamf at commit 082816f, compute/accelerator/benchmarks/README.md, "What we
# measured: alone vs all-8 concurrent"; its compute/accelerator/README.md table: H200
# alone MSMF 708.5 / MAMF 841.9, 0.842): MAMF, "the boost-clock burst ceiling", and MSMF, "the power-saturated,
# sustained rate that matches real training throughput"; on 8 H200 computing at once
# (all 8 GPUs x 5 rounds, torch 2.14, bf16) MSMF 698.6 TFLOP/s at 1405-1527 MHz against
# MAMF 823.9: the sustained rate is 0.848 of the burst (`HOPPER_SUSTAINED`). The H200 is
# the H100's compute (the same GH100 die, 132 SMs, 989 TFLOP/s bf16 and 700 W; the
# source's MAMF table lists the H100 SXM with "H200 is the same"), so every Hopper
# profile's matmuls run at matmul_eff x 0.848 (`Hardware.matmul_sustained`). No such
# pair is published for the A100 (1.0 there), nor for the attention kernels, whose
# figures stay as published. mem_eff 0.85 (STREAM-like
# copies); link_eff 0.8: nccl-tests bus bandwidth ~230 GB/s of 300 (A100) and ~360 of
# 450 (H100). overlap_slowdown 0.189: Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning"
# (arXiv:2507.03114): GPT and LLaMA training on 4 A100, H100, MI250 and MI210, compute
# kernels overlapped with collectives run 18.9% slower on average (40.0% at most) than
# with no communication beside them.
# Attention: the kernels' published rates and their sources are in
# engine/cost/attention_rates.py (`H100_CUDNN`, `FLASH_ATTENTION_2`, ...).
# HBM per chip: 80 GB (A100-SXM4-80GB and H100-SXM5 datasheets).
#
# Collectives (`nccl`, engine/cost/nccl.py: NCCL's own cost model and algorithm choice),
# bus bandwidths as nccl-tests reports them at large sizes:
# - H100 NVLink ring 370 GB/s: "With the protocol overhead (~20%) NCCL can get an
#   effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
#   non-allreduce operations, or when running with NCCL_ALGO=RING" (S. Jeaugey, NVIDIA,
#   github.com/NVIDIA/nccl-tests/issues/212); NVLink SHARP all-reduce inside a node
#   480 GB/s ("On 8 GPUs, you should reach a peak busBw of ~480GB/s", same thread).
# - H100 NIC 48 GB/s: "You should achieve around 48GB/s from each CX7 NIC at 400Gbps"
#   (A. Ladd, NVIDIA, github.com/NVIDIA/nccl-tests/issues/319).
# - A100 NVLink ring 232 GB/s: single-node `all_reduce_perf -b 8 -e 4G -g 8` on 8
#   A100-SXM4 "result: 232.54GB/s" (github.com/NVIDIA/nccl-tests/issues/175); HDR NIC
#   24 GB/s: "when HCA=mlx5_0, reach the theoretical value (24GB/s)"
#   (github.com/NVIDIA/nccl/issues/1048, 200 Gb/s ConnectX-6).
# The GPU Links (fast: NVLink per direction, slow: one NIC) describe the links; a GPU
# profile's collectives are priced by `nccl`, not by them. Their latencies are NCCL's
# per-step Simple-ring latencies over NVLink and the network (tuning.cc `hwLatencies`:
# 3.4 us, 14 us).
def _gpu(name, bf16, tf32, fp32, hbm, nvlink_dir, nic, matmul_eff, attention_eff, net):
    return Hardware(name, {"bfloat16": bf16, "float32": tf32}, fp32, hbm,
                    Link(nvlink_dir, 3.4e-6), Link(nic, 14e-6), 8,
                    matmul_eff=matmul_eff, mem_eff=0.85, link_eff=0.8, fusion=True,
                    epilogue_fusion=False, overlap_slowdown=0.189,
                    attention_eff=attention_eff, hbm_capacity=80e9, nccl=net,
                    source="published specs")


H100_NCCL = NcclNet(nvlink=370e9, nic=48e9, arch="hopper", nvls=480e9)
# sustained / burst matmul rate of a Hopper GPU among 8 computing at once (MSMF / MAMF,
# the figures above)
HOPPER_SUSTAINED = 698.6 / 823.9
A100_NCCL = NcclNet(nvlink=232e9, nic=24e9, arch="ampere")


PROFILES = {
    "v4": _tpu("TPU v4", 275e12, 1.2e12, 4.5e10, 4096, 32 * 2**30, (4, 4, 4)),
    "v5e": _tpu("TPU v5e", 197e12, 8.1e11, 4.5e10, 256, 16 * 2**30, (16, 16)),
    "v5p": _tpu("TPU v5p", 459e12, 2.765e12, 9e10, 8960, 95 * 2**30, (4, 4, 4)),
    "a100": _gpu("A100-SXM 80GB", A100_SXM_BF16, 156e12, 19.5e12, 2.039e12, 300e9, 25e9, 0.8,
                 0.55, A100_NCCL),
    "h100": dataclasses.replace(
        _gpu("H100-SXM", H100_SXM_BF16, 494.7e12, 67e12, 3.35e12, 450e9, 50e9, 0.75, 0.0,
             H100_NCCL),
        attention_rates=flash_rates(H100_SXM_BF16, H100_CUDNN),
        matmul_sustained=HOPPER_SUSTAINED),
}

# H100 as torchtitan's benchmark pages describe their Grand Teton hosts: "96GB HBM2e with
# 2.4 TB/sec peak memory bandwidth", run at "the default 500W power limit" (the SXM5
# datasheet's is 700 W). Its tensor-core peak, in the same page's footnote: "the actual
# peak TFLOPs number is between SXM and NVL, and we don't know its exact value". NVIDIA's
# H100 datasheet gives dense bf16 989 (SXM) and 835.5 TFLOP/s (NVL, 350-400 W; half
# its 1,671 with sparsity), TF32 494.7 and 417.5: priced at the middle of that stated
# interval (912 / 456; the ends move the profile's matmul time by -8% / +9%). The MFU
# denominator stays the SXM peak, as torchtitan's own MFU figures use it.
_SXM = PROFILES["h100"].peak_flops
_NVL = {"bfloat16": 835.5e12, "float32": 417.5e12}
PROFILES["h100-gt"] = dataclasses.replace(
    PROFILES["h100"], name="H100 96GB HBM2e (Grand Teton)", hbm=2.4e12, hbm_capacity=96e9,
    peak_flops={k: (_SXM[k] + _NVL[k]) / 2 for k in _SXM}, mfu_peak=dict(_SXM))

# H100 SXM on Google Cloud's A3 High VMs (XPK's device type `h100-80gb-8`, where
# MaxText's A3 benchmarks ran): NVLink inside the VM as the SXM board's, and across VMs
# "A3 High (NVIDIA H100): up to 1,000 Gbps" a VM (GPUDirect-TCPX;
# https://cloud.google.com/compute/docs/gpus/gpu-network-bandwidth), shared by its 8
# GPUs: 1,000 / 8 Gb/s = 15.6 GB/s a GPU, the NIC share NCCL's rings get per rank
# (`NcclNet.nic`; the page's maximum, an upper bound: no nccl-tests figure over TCPX
# was found), against the 48 GB/s of a 400 Gb/s CX7 per GPU in the `h100` profile.
A3_HIGH_NIC = 1000e9 / 8 / 8
PROFILES["h100-a3"] = dataclasses.replace(
    PROFILES["h100"], name="H100-SXM (Google Cloud A3 High)",
    slow=Link(A3_HIGH_NIC, PROFILES["h100"].slow.latency),
    nccl=dataclasses.replace(H100_NCCL, nic=A3_HIGH_NIC))

def get(name: str, calibration: Path | str | None = None) -> Hardware:
    """Profile by command-line name: cpu | v4 | v5e | v5p | a100 | h100 | h100-gt |
    h100-a3."""
    if name == "cpu":
        from engine.cost.calibration import cpu_profile

        return cpu_profile(calibration)
    if name not in PROFILES:
        raise KeyError(f"unknown hardware {name!r} (known: cpu, {', '.join(PROFILES)})")
    return PROFILES[name]
