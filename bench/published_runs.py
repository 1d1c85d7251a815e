"""The published training runs bench/published.py prices: facts, each quoted from its source.

A `Run` holds what one row of a public benchmark states and nothing else: the chip and
its count, the model's dimensions, sequence, global batch, parallel layout, precision,
activation checkpointing, framework, the throughput and the source's own MFU. Every
fact is quoted from the source (`Run.quotes`); a fact the source does not state is
absent from `quotes`, printed "not stated", and priced at the engine's default
(bench/published.py `source_settings`). The facts map to engine settings by the rules
in bench/published.py, the same rules for every row.

`RUNS` is the table; `HELD_OUT` is a set of published runs from the same sources that is
not in the table, reported on its own and never used while the model is changed.
Both were fixed before the cost-model changes of the section they were added in
(bench/results/2026-11-28-published-cpu.md).

Model differences are matched on FLOPs, never by changing the model: MPT and GPT
(Megatron) use a two-matrix GELU MLP with hidden 4D, whose matmul FLOPs equal a SwiGLU
with hidden 8D/3 (2·D·4D = 3·D·F), rounded to a multiple of tp (`gelu_match`); ALiBi and
learned positions cost no matmul FLOPs (RoPE here costs a few elementwise ones).
Llama 3 405B's 126 layers over 16 pipeline stages (the paper removes one layer from the
first and the last stage) are priced as 128, as this engine splits layers evenly.
"""
from __future__ import annotations

import dataclasses
import math

FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/"
           "README.md")
TITAN_2412 = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
              "llama3_h100_202412_torchtitan.md")
TITAN_ASYNC = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
               "asyncTP_llama3_h100_2025-06_torchtitan.md")
MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/main/src/maxtext/configs/{}/README.md"
MEGATRON = ("https://arxiv.org/abs/2104.04473 (Table 1); micro-batch sizes and schedules from "
            "https://github.com/NVIDIA/Megatron-LM/blob/main/examples/sc21/run_table_1.sh")
LLAMA3 = "https://arxiv.org/abs/2407.21783 (Table 4; section 3.3.2)"
PEAK = {"h100": 989e12, "h100-gt": 989e12, "h100-a3": 989e12, "a100": 312e12, "v4": 275e12, "v5e": 197e12,
        "v5p": 459e12}

# the frameworks a row's `framework` fact names (bench/published.py FRAMEWORKS: their rules)
FRAMEWORK_NAMES = ("composer", "torchtitan-compile", "torchtitan-eager", "maxtext",
                   "megatron-2021", "meta-llama3")


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run. throughput: tokens/s per chip ("tps"), model TFLOP/s per chip in
    MaxText's convention ("maxtext_tflops"; its 2023 one, 6 x the parameters a token:
    "params6_tflops"), hardware TFLOP/s per GPU in Megatron's
    ("megatron_tflops"), or TFLOP/s per GPU in a convention the source does not state,
    read as this engine's ("engine_tflops"). source_mfu: the source's own MFU figure.
    remat: none | full | dots | alternate (the engine's policy the source's maps to). zero: 0 for
    plain data parallelism. microbatches: accumulated per step (0: not stated).
    grad_reduce: the dtype fsdp reduces grads in ("compute" or "f32"; "" not stated).
    tp_overlap: the source overlaps its tp collectives with compute. schedule / virtual:
    the pipeline schedule and its chunks per device (0: not stated). quotes: (fact, the source's words)."""

    name: str
    hardware: str
    chips: int
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab: int
    seq: int
    batch: int
    layout: str
    remat: str
    zero: int
    throughput: float
    unit: str
    source_mfu: float | None
    source: str
    framework: str
    quotes: tuple = ()
    microbatches: int = 0
    grad_reduce: str = ""
    tp_overlap: bool = False
    schedule: str = ""
    virtual: int = 1
    note: str = ""

    def quote(self, fact: str) -> str:
        """The source's words for `fact`, or "not stated"."""
        return dict(self.quotes).get(fact, "not stated")

    @property
    def pp(self) -> int:
        for part in self.layout.split("x"):
            if part.startswith("pp"):
                return int(part[2:])
        return 1


def gelu_match(d: int, tp: int = 1) -> int:
    """SwiGLU hidden with a GELU MLP's (hidden 4d) matmul FLOPs: 8d/3, nearest multiple of tp."""
    return max(tp, round(8 * d / 3 / tp) * tp)


# -- llm-foundry (MosaicML Composer, PyTorch FSDP, eager) ---------------------------------
# its yamls' MPT sizes: d_model, heads, layers
MPT = {"760m": (1536, 12, 24), "1b": (2048, 16, 24), "3b": (2560, 20, 32),
       "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
       "70b": (8192, 64, 80)}


def _mpt(size, hw, chips, micro, ckpt, tps, mfu, strategy="FULL_SHARD", mp="DEFAULT",
         precision="amp_bf16", accum=None):
    d, heads, layers = MPT[size]
    gpu = {"h100": "h100_80gb", "a100": "a100_80gb"}[hw]
    quotes = (("hardware", f"GPU {gpu}"), ("chips", f"# GPUs {chips}"),
              ("seq", "SeqLen (T) 2048"), ("batch", f"MicroBatchSize {micro}"),
              ("layout", f"Sharding Strategy {strategy}"), ("precision", f"Precision {precision}"),
              ("grad_reduce", f"MP Mode {mp}"), ("remat", f"Activation Checkpointing {ckpt}"),
              ("framework", ("composer train/train.py (submit_benchmarks.py), no compile "
                             "setting; attn_impl triton; MPT loss_fn default "
                             "fused_crossentropy")),
              ("microbatches", f"GradAccum {accum}" if accum else "GradAccum (per microbatch)"))
    return Run(f"llm-foundry MPT-{size} {chips}x{hw}", hw, chips, layers, d, heads, heads,
               d // heads, gelu_match(d), 50368, 2048, micro * chips, f"fsdp{chips}",
               "full" if ckpt else "none", 3 if strategy == "FULL_SHARD" else 2, tps, "tps",
               mfu, FOUNDRY, "composer", quotes,
               grad_reduce="f32" if mp == "DEFAULT" else "compute")


# -- MaxText (JAX / XLA) ---------------------------------------------------------------------
def maxtext_scale(scale: int) -> tuple:
    """(layers, d_model, heads, mlp) of MaxText's `global_parameter_scale` (its
    configs/types.py get_individual_scales): base.yml's 16, 2048, 16, 7168, doubling
    heads and mlp, then d_model, then layers, in turn."""
    k, rem = divmod(int(math.log2(scale)), 3)
    head = k + (rem > 0)
    emb = k + (rem > 1)
    return 16 << k, 2048 << emb, 16 << head, 7168 << head


REMAT_POLICIES = {"full": "full", "minimal": "dots", "minimal_with_context": "dots",
                  "qkv_proj_offloaded": "full"}


def _maxtext(size, hw, slices, slice_chips, dims, pdb, ici, remat, tflops, mfu, overlap,
             seq=2048, vocab=32000, kv=None, dcn="dcn_data_parallelism=-1 (base.yml)"):
    """slice_chips: a v4-N / v5p-N slice has N/2 chips (N counts TensorCores, two per
    chip); v5e-N has N; an A3 VM has 8 H100. dims: (layers, d_model, heads, mlp).
    overlap: the run's XLA flags overlap the tp collectives with compute
    (`xla_tpu_overlap_compute_collective_tc`)."""
    layers, d, heads, mlp = dims
    chips = slices * slice_chips
    layout = ici if slices == 1 else f"dp{slices}x{ici}"
    kind = "gpu/a3/llama_2_7b" if hw == "h100" else f"tpu/{hw}"
    slice_name = ("A3 (h100-80gb-8)" if hw == "h100"
                  else f"{hw}-{slice_chips * (1 if hw == 'v5e' else 2)}")
    quotes = (("hardware", f"{slices}x {slice_name}"),
              ("chips", f"{slices} slice(s) of {slice_chips} chips"),
              ("seq", f"max_target_length={seq}"), ("batch", f"per_device_batch_size={pdb}"),
              ("layout", f"{ici} over ICI, {dcn}"), ("precision", "dtype: bfloat16 (base.yml)"),
              ("remat", f"remat_policy={remat}"),
              ("framework", "MaxText, attention=" + ("cudnn_flash_te" if hw == "h100"
                                                     else "flash")))
    if overlap:
        quotes += (("tp_overlap", "--xla_tpu_overlap_compute_collective_tc=true"),)
    name = f"MaxText {size} {chips}x{hw}"
    profile = "h100-a3" if hw == "h100" else hw  # an A3 VM: the A3 High profile
    return Run(name, profile, chips, layers, d, heads, kv or heads, 128, mlp, vocab, seq,
               pdb * chips, layout, REMAT_POLICIES[remat], 3, tflops, "maxtext_tflops", mfu,
               MAXTEXT.format(kind), "maxtext", quotes, tp_overlap=overlap and "tp" in ici)


def _v5e(scale, slices, pdb, tflops, mfu):
    return _maxtext(f"{scale}B", "v5e", slices, 256, maxtext_scale(scale), pdb, "fsdp256",
                    "full", tflops, mfu, True)


def _v5p(scale, slice_n, slices, pdb, tp, remat, tflops, mfu):
    chips = slice_n // 2
    return _maxtext(f"{scale}B", "v5p", slices, chips, maxtext_scale(scale), pdb,
                    f"fsdp{chips // tp}xtp{tp}", remat, tflops, mfu, True)


def _v4_22b(slices, tflops, mfu):
    return _maxtext("22B", "v4", slices, 64, (48, 6144, 24, 24576), 13, "fsdp64", "full",
                    tflops, mfu, False)


MAXTEXT_2023 = ("https://github.com/AI-Hypercomputer/maxtext/tree/e286533d (README.md; "
                "MaxText/configs/1xv4-384.sh and base.yml at that commit)")


def _v4_52b_2023():
    """MaxText's 52B on one v4-384 as its README published it (154 TFLOP/s, 56.0 %): the
    figure came with commit e286533d (2023-03-14) beside its config, 1xv4-384.sh, whose
    last line reads "# achieves 154 TFLOP/s, 52B". pyconfig multiplied base_emb_dim,
    base_num_heads, base_mlp_dim and base_num_decoder_layers by `scale` 4: 32 layers, D
    12288, 32 heads of 256, a ReLU MLP of 49152 (two matrices: priced as a SwiGLU of the
    same FLOPs, 2/3 of it), vocab 32768, 1,024 tokens. Its train.py counted 6 x the
    parameters a token (`params6_tflops`); its embedding is tied (logits_via_embedding),
    which this engine prices untied (one more D x V matrix: memory, no FLOPs)."""
    layers, d, heads, head_dim, relu_mlp, vocab, seq, pdb = 32, 12288, 32, 256, 49152, 32768, 1024, 10
    quotes = (("hardware", "1x v4-384"), ("chips", "ici_fsdp_parallelism=192"),
              ("seq", "max_target_length: 1024 (base.yml)"),
              ("batch", f"per_device_batch_size={pdb}"),
              ("layout", "ici_fsdp_parallelism=192 ici_tensor_parallelism=1"),
              ("precision", 'dtype: "bfloat16" (base.yml)'), ("remat", "remat_policy=full"),
              ("framework", "MaxText train.py (2023-03, jax 0.4.6)"),
              ("mlp", 'mlp_activations: ["relu"] (base.yml), base_mlp_dim=12288, scale=4'))
    return Run("MaxText 52B (2023) 192xv4", "v4", 192, layers, d, heads, heads, head_dim,
               relu_mlp * 2 // 3, vocab, seq, pdb * 192, "fsdp192", "full", 3, 154,
               "params6_tflops", 56.0, MAXTEXT_2023, "maxtext", quotes)


def _a3_llama2_7b(vms, tflops):
    """MaxText's llama2-7b on A3 VMs (8 H100 each): configs/gpu/models/llama2_7b.yml,
    per_device_batch_size 4, max_target_length 4096, remat minimal_with_context,
    cudnn_flash_te attention; ici_fsdp_parallelism=8, dcn_data_parallelism=VMs."""
    return _maxtext("llama2-7b", "h100", vms, 8, (32, 4096, 32, 11008), 4, "fsdp8",
                    "minimal_with_context", tflops, None, False, seq=4096,
                    dcn=f"dcn_data_parallelism={vms}")


# -- Megatron-LM 2021 (Narayanan et al., Table 1) ------------------------------------------
def _megatron(name, layers, h, heads, tp, pp, gpus, batch, micro, tflops, mfu, layers_virtual=0):
    """micro: the run's micro-batch size (`MBS` in run_table_1.sh, whose `GBS` is the
    paper's batch). Without pp the step accumulates batch / (micro x dp) microbatches
    and all-reduces once (its DDP's `no_sync`); with pp the schedule moves them.
    layers_virtual: run_table_1.sh's --num-layers-per-virtual-pipeline-stage (the
    interleaved schedule), 0: none (1F1B)."""
    dp = gpus // (tp * pp)
    parts = [f"dp{dp}"] + ([f"pp{pp}"] if pp > 1 else []) + ([f"tp{tp}"] if tp > 1 else [])
    virtual = layers // (pp * layers_virtual) if layers_virtual else 1
    schedule = "" if pp == 1 else ("interleaved" if layers_virtual else "1f1b")
    quotes = (("hardware", "A100 80GB (Selene)"), ("chips", f"Number of GPUs {gpus}"),
              ("seq", "sequence length of 2048"), ("batch", f"Batch size {batch}; MBS={micro}"),
              ("layout", f"Tensor model-parallel size {tp}, pipeline model-parallel size {pp}"),
              ("precision", "mixed precision (fp16)"), ("remat", "--recompute-method uniform"),
              ("framework", "Megatron-LM (2021), DDP=" + ("torch" if pp == 1 else "local")),
              ("microbatches", f"GBS={batch} MBS={micro}"))
    if layers_virtual:
        quotes += (("schedule", f"--num-layers-per-virtual-pipeline-stage {layers_virtual}"),)
    return Run(f"Megatron {name} {gpus}xa100", "a100", gpus, layers, h, heads, heads,
               h // heads, gelu_match(h, tp), 51200, 2048, batch, "x".join(parts), "full", 0,
               tflops, "megatron_tflops", mfu, MEGATRON, "megatron-2021", quotes,
               microbatches=batch // (micro * dp), schedule=schedule, virtual=virtual)


# -- torchtitan (PyTorch, FSDP2) --------------------------------------------------------------
LLAMA31 = {"8B": (32, 4096, 32, 8, 14336), "70B": (80, 8192, 64, 8, 28672)}


def _titan(size, chips, batch, layout, remat, tps, source, compiled=True, async_tp=False,
           note=""):
    layers, d, heads, kv, mlp = LLAMA31[size]
    quotes = (("hardware", "Grand Teton: 8 H100, 96GB HBM2e, 2.4 TB/sec, 500W"),
              ("chips", f"{chips} GPUs"), ("batch", f"global batch size {batch}"),
              ("seq", "seq_len 8192 (the run's llama3 toml)"),
              ("layout", layout), ("precision", "bfloat16"),
              ("remat", {"alternate": "Selective activation checkpointing / per op SAC",
                         "full": "Full activation checkpointing"}[remat]),
              ("grad_reduce", 'mixed_precision_reduce = "float32"'),
              ("framework", "torchtitan" + (", torch.compile" if compiled else " (eager)")))
    if async_tp:
        quotes += (("tp_overlap", "Async TP"),)
    tag = "" if compiled else " eager"
    return Run(f"torchtitan Llama3.1-{size} {layout}{tag}{' asyncTP' if async_tp else ''} "
               f"{chips}xh100", "h100-gt", chips, layers, d, heads, kv, d // heads, mlp,
               128256, 8192, batch, layout, remat, 3, tps, "tps", None, source,
               "torchtitan-compile" if compiled else "torchtitan-eager", quotes,
               grad_reduce="f32", tp_overlap=async_tp, note=note)


# -- Llama 3 405B (Meta, the Llama 3 paper) -------------------------------------------------
def _llama3(gpus, cp, dp, seq, per_dp, tflops, mfu):
    """Section 3.3.2 states the schedule (interleaved, "V" by name) and, for the 8K
    sequences, no activation checkpointing; the 128K row's checkpointing is not stated.
    Its chunks: one layer removed from the first stage leaves that stage's first chunk
    with the embedding alone, so a chunk held one layer and V = layers per stage (126 +
    the 2 removed = 128 over 16 stages: V = 8; bench/published.py's rule)."""
    layout = f"fsdp{dp}" + (f"xcp{cp}" if cp > 1 else "") + "xpp16xtp8"
    quotes = (("hardware", "H100 GPUs, 80GB HBM3, 700W TDP"), ("chips", f"GPUs {gpus}"),
              ("seq", f"Seq. Len. {seq}"), ("batch", f"Batch size/DP {per_dp}"),
              ("layout", f"TP 8, CP {cp}, PP 16, DP {dp}"), ("precision", "BF16 MFU"),
              ("tp_comm", ("tensor parallelism (TP; Krizhevsky et al. (2012); Shoeybi et "
                           "al. (2019); Korthikanti et al. (2023))")),
              ("zero", ("FSDP ... shards the optimizer states and gradients ... we do not "
                        "reshard after forward computation")),
              ("schedule", ("we use an interleaved schedule (Narayanan et al., 2021) with V "
                            "pipeline stages on one pipeline rank")),
              ("virtual", ("we reduce one Transformer layer each from the first and the "
                           "last stages, respectively. This means that the first model "
                           "chunk on the first stage has only the embedding, and the last "
                           "model chunk on the last stage has only output projection and "
                           "loss calculation")),
              ("framework", "Meta's 4D-parallel training stack"))
    if cp > 1:
        quotes += (("cp_comm", ("an all-gather based method where we first all-gather the "
                                "key (K) and value (V) tensors, and then compute attention "
                                "output for the local query (Q) tensor chunk")),)
    remat = "full"
    if seq <= 8192:
        remat = "none"
        quotes += (("remat", ("we could pre-train Llama 3 on sequences of 8K tokens without "
                              "activation checkpointing")),)
    return Run(f"Llama 3 405B {layout} {gpus}xh100", "h100", gpus, 128, 16384, 128, 8, 128,
               53248, 128256, seq, per_dp * dp, layout, remat, 2, tflops, "engine_tflops",
               mfu, LLAMA3, "meta-llama3", quotes, schedule="interleaved",
               virtual=128 // 16, note="126 layers priced as 128 (even stages)")


TITAN_NOTE = "vanilla TP"
RUNS = (
    # llm-foundry, H100 80GB, bf16, FSDP, gradient accumulation per microbatch
    _mpt("7b", "h100", 8, 6, False, 10643, 46.44),
    _mpt("13b", "h100", 8, 2, False, 4792, 39.79),
    _mpt("1b", "h100", 8, 14, False, 45455, 41.82),
    _mpt("760m", "h100", 16, 24, False, 68551, 37.89),
    _mpt("13b", "h100", 64, 2, False, 4800, 39.86),
    _mpt("7b", "h100", 128, 6, False, 10475, 45.71),
    _mpt("13b", "h100", 128, 16, True, 5080, 42.18),
    _mpt("30b", "h100", 128, 8, True, 2199, 41.85),
    _mpt("70b", "h100", 128, 8, True, 1058, 43.36),
    _mpt("3b", "h100", 128, 8, False, 23422, 42.43, strategy="SHARD_GRAD_OP"),
    _mpt("70b", "h100", 64, 8, True, 1039, 42.57),
    _mpt("30b", "h100", 32, 14, True, 2308, 43.92),
    _mpt("13b", "h100", 32, 2, False, 4811, 39.95),
    _mpt("3b", "h100", 64, 6, False, 22525, 40.8),
    _mpt("1b", "h100", 64, 20, False, 44402, 40.85),
    _mpt("760m", "h100", 32, 24, False, 67971, 37.57),
    # llm-foundry, A100 80GB
    _mpt("7b", "a100", 8, 6, False, 4641, 64.23),
    _mpt("13b", "a100", 8, 2, False, 2262, 59.57),
    _mpt("3b", "a100", 8, 10, False, 10811, 62.11),
    _mpt("1b", "a100", 8, 14, False, 20513, 59.86),
    _mpt("70b", "a100", 64, 8, True, 410, 53.33, mp="PURE", precision="bf16"),
    _mpt("30b", "a100", 8, 3, True, 916, 55.3),
    _mpt("760m", "a100", 8, 24, False, 32434, 56.85),
    # MaxText on TPU
    _v5e(16, 1, 6, 120, 61.10),
    _v5e(32, 1, 4, 132, 66.86),
    _v5e(64, 1, 2, 118, 59.90),
    _v5e(16, 8, 6, 115, 58.27),
    _v5e(32, 8, 4, 125, 63.67),
    _v4_22b(1, 156, 56.7),
    _v4_22b(8, 146, 53.2),
    _v5p(32, 128, 1, 6, 4, "minimal", 328, 71.47),
    _v5p(64, 128, 1, 3, 4, "minimal", 323, 70.31),
    _v5p(128, 256, 1, 1, 8, "minimal", 315, 68.68),
    _v5p(256, 1024, 1, 1, 8, "minimal", 308, 67.09),
    _v5p(512, 1024, 1, 2, 8, "full", 294, 63.99),
    _v5p(1024, 2048, 1, 2, 16, "full", 254, 55.35),
    _v5p(1024, 4096, 1, 2, 16, "full", 297, 64.80),
    # MaxText on H100 (XLA on GPU)
    _a3_llama2_7b(1, 492),
    _a3_llama2_7b(16, 375),
    # Megatron-LM, A100 80GB (Selene), Table 1
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137, 44),
    _megatron("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, 138, 44),
    _megatron("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, 142, 46),
    _megatron("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, 135, 43),
    _megatron("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 4, 138, 44),
    _megatron("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 140, 45, layers_virtual=5),
    _megatron("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 148, 47, layers_virtual=5),
    _megatron("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 155, 50, layers_virtual=3),
    _megatron("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 163, 52, layers_virtual=1),
    _megatron("1T", 128, 25600, 160, 8, 64, 3072, 3072, 1, 163, 52),
    # torchtitan, Llama 3.1 8B / 70B, bf16, torch.compile
    _titan("8B", 8, 16, "fsdp8", "alternate", 6667, TITAN_2412),
    _titan("8B", 128, 256, "fsdp128", "alternate", 6514, TITAN_2412),
    _titan("8B", 64, 96, "fsdp8xtp8", "alternate", 4378, TITAN_ASYNC, note=TITAN_NOTE),
    _titan("70B", 256, 512, "fsdp32xtp8", "full", 597.3, TITAN_ASYNC, note=TITAN_NOTE),
    # Llama 3 405B pre-training, Table 4: 8K sequences, and 128K with context parallelism
    _llama3(8192, 1, 64, 8192, 32, 430, 43),
    _llama3(16384, 1, 128, 8192, 16, 400, 41),
    _llama3(16384, 16, 8, 131072, 16, 380, 38),
)

# Published runs of the same sources left out of the table, checked the same way.
HELD_OUT = (
    _mpt("70b", "h100", 32, 2, True, 882, 36.15),
    _mpt("30b", "h100", 16, 10, True, 2263, 43.07),
    _mpt("30b", "h100", 8, 3, True, 2002, 38.11),
    _mpt("13b", "h100", 16, 2, False, 4767, 39.58),
    _mpt("3b", "h100", 16, 10, False, 24142, 43.73),
    _mpt("3b", "h100", 32, 6, False, 23021, 41.7),
    _mpt("1b", "h100", 16, 20, False, 46037, 42.36),
    _mpt("1b", "h100", 32, 20, False, 45130, 41.52),
    _mpt("760m", "h100", 8, 24, False, 63147, 34.9),
    _mpt("70b", "a100", 32, 2, True, 373, 48.56, mp="PURE", precision="bf16"),
    _v5e(16, 2, 6, 117, 59.37),
    _v5e(16, 32, 6, 108, 54.65),
    _v5e(32, 32, 4, 119, 60.40),
    _v5e(64, 32, 2, 99, 50.18),
    _maxtext("128B", "v5e", 1, 256, maxtext_scale(128), 1, "fsdp16xtp16",
             "qkv_proj_offloaded", 110, 56.06, True),
    _v4_22b(4, 149, 54.3),
    _v4_52b_2023(),
    _v5p(32, 128, 2, 6, 4, "minimal", 319, 69.43),
    _v5p(128, 512, 1, 1, 8, "minimal", 316, 68.83),
    _v5p(512, 1024, 2, 2, 8, "full", 282, 61.45),
    _v5p(1024, 4096, 2, 2, 16, "full", 279, 60.83),
    _a3_llama2_7b(2, 422),
    _a3_llama2_7b(8, 409),
    _titan("8B", 8, 16, "fsdp8", "alternate", 5762, TITAN_2412, compiled=False),
    _titan("8B", 128, 256, "fsdp128", "alternate", 5605, TITAN_2412, compiled=False),
    _titan("8B", 64, 96, "fsdp8xtp8", "alternate", 4809.4, TITAN_ASYNC, async_tp=True),
    _titan("70B", 256, 512, "fsdp32xtp8", "full", 652.4, TITAN_ASYNC, async_tp=True),
)
