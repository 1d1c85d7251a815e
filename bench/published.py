"""Predicted vs published MFU for public training runs (predict-only, no devices).

    python bench/published.py            # table, median and max |error| (MFU points)
    python bench/published.py --json out.json

Each `Run` is one row of a public benchmark table: chip and count, model dimensions,
sequence, global batch, layout in this engine's grammar, activation checkpointing, the
reported throughput, the peak the source used and where it is. Rows with pipeline
parallelism are left out (this engine has no pipeline axis yet), as are float8 rows
(no fp8 peak in the profiles) and layouts this grammar cannot state (context
parallelism).

FLOP conventions. Every MFU here is this engine's: engine/run/mfu.py's model FLOPs per token
(6 per non-embedding parameter + 12·N·H·K·L attention, no causal halving, no remat) x
published tokens/s per chip / the chip's dense bf16 peak (989 TFLOP/s H100, 312 A100,
275 v4, 197 v5e, 459 v5p: the peaks every source used). So the published column is the
source's throughput re-expressed, not the source's own MFU (shown beside it):
- llm-foundry and torchtitan report tokens/s per GPU: used as is.
- MaxText reports TFLOP/s per chip: converted to tokens/s with MaxText's own formula
  (maxtext_utils.calculate_tflops_training_per_device: 6 x (MLP, QKV, out-projection,
  unembedding matmul params) + causal-halved attention 6·N·H·K·L per token).
- Megatron (Narayanan et al. 2021, Table 1) reports hardware TFLOP/s per GPU with full
  recomputation, 96·B·s·l·h²·(1 + s/6h + V/16lh) per batch: converted with that formula.
Model differences are matched on FLOPs, never by changing the model: MPT and GPT
(Megatron) use a two-matrix GELU MLP with hidden 4D, whose matmul FLOPs equal a SwiGLU
with hidden 8D/3 (2·D·4D = 3·D·F), rounded to a multiple of tp; MPT's ALiBi and GPT's
learned positions cost no matmul FLOPs (RoPE here costs a few elementwise ones).
Attention is priced as the kernel the source ran (`Run.kernel`): a flash kernel for
every row but Megatron's. llm-foundry's tables were made by the commits that last
changed them (b2a43a1, October 2023: the 8- to 64-GPU rows and A100's; 5e85bd6, January
2024: the 128-GPU rows), whose `submit_benchmarks.py` sets `attn_impl` from its
`--attn_impl` flag, default `triton`, which `sweep.sh` does not pass (the default became
`flash` in March 2024, 7f0fdae): the first FlashAttention's Triton port
(llmfoundry/models/layers/flash_attn_triton.py, "Copied from" the flash-attention
repository's flash_attn_triton.py, on the `triton-pre-mlir` fork), priced at that
kernel's published rate (engine/cost/hardware.py `FLASH_ATTENTION_TRITON`). torchtitan
(PyTorch's `scaled_dot_product_attention`, whose flash backend is FlashAttention-2) is
priced at FlashAttention-2's (`FLASH_ATTENTION_2`: on H100 its published forward and
backward speed at the row's sequence length); MaxText calls the Pallas splash kernel
(the TPU profiles' rate).
torchtitan's H100s are its Grand Teton hosts (96 GB of HBM2e at 2.4 TB/s, 500 W, a
tensor-core peak "between SXM and NVL" in its page's words): the `h100-gt` profile.
Megatron-LM in 2021 predates FlashAttention (Dao et al. 2022): it formed the [s, s]
scores in memory (QK^T GEMM, its fused scale-mask-softmax kernel, then the PV GEMM),
which is what this engine's `reference` kernel does, so those rows run `--attention reference`.
torchtitan's selective activation checkpointing (`selective_ac_option = 'op'`,
`_apply_ac_to_transformer_block` at both benchmark pages' torchtitan commits, 9dec370
and 820504e) saves the outputs of matmuls, SDPA and the tp reduce-scatters but
recomputes every second matmul of a block: wk, wo and w3 of Llama's seven (wq, wk, wv,
wo, w1, w3, w2). Those rows run `--remat dots`, which saves q, k, v, gate, up and the
attention's output instead and recomputes the attention kernel's forward. The two
recomputes are priced within 1% of the step of each other: wk + wo + w3 against the
attention forward, 0.122 against 0.115 s of the 8B fsdp8 row's 1.93 s step, 0.100
against 0.086 s of the fsdp8xtp8 row's 2.28 s (the rows' ledgers, `predict`'s seconds
per row).
Activations are bf16 (`--activations bf16`) on every row, as every source ran them:
MaxText's `dtype: bfloat16`, PyTorch autocast / FSDP mixed precision in bf16
(llm-foundry, torchtitan), Megatron's fp16 (the same two bytes).
Fusion is priced as the source's framework runs: XLA (MaxText) and torch.compile
(torchtitan) fuse elementwise chains (the profiles' `fusion`); llm-foundry's benchmark
runs are PyTorch eager (`submit_benchmarks.py` launches `composer train/train.py` on a
`mosaicml/pytorch` image with no compile setting; only its flash attention and
`low_precision_layernorm` are fused kernels), so every other elementwise op is a kernel
of its own that reads and writes HBM: those rows are priced unfused (`Run.fused`), each
op moving its own bytes as on the CPU. Megatron's 2021 runs used its fused kernels
(bias-GeLU, scale-mask-softmax, layernorm), priced as fused.
Grads are reduce-scattered as the source reduced them: in f32 (`--grad-reduce f32`) for
PyTorch FSDP, whose mixed precision both PyTorch sources run with reduce_dtype float32
(llm-foundry's table: "MP Mode DEFAULT", Composer's `get_mixed_precision`: param_dtype
bf16, reduce_dtype float32; torchtitan: `mixed_precision_reduce = "float32"`, its only
choice); MaxText's dtype is not stated (left in the compute dtype); Megatron's rows have
no fsdp axis (dp all-reduces grads in f32 here either way).
Gradient accumulation is modelled per microbatch (batch = microbatch x data-parallel
ranks) where the source's grads are reduced on every microbatch (PyTorch FSDP) or its
count is not given: the optimizer step, amortized over the microbatches in the source,
is < 1% of a step here. Megatron's rows run the accumulation itself (`--microbatches`,
from the micro-batch sizes of the paper's reproduction script), as its schedule
all-reduces the grads once per step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/"
           "README.md")
TITAN_2412 = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
              "llama3_h100_202412_torchtitan.md")
TITAN_ASYNC = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
               "asyncTP_llama3_h100_2025-06_torchtitan.md")
MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/main/src/maxtext/configs/tpu/{}/README.md"
MEGATRON = ("https://arxiv.org/abs/2104.04473 (Table 1); micro-batch sizes from "
            "https://github.com/NVIDIA/Megatron-LM/blob/main/examples/sc21/run_table_1.sh")
PEAK = {"h100": 989e12, "h100-gt": 989e12, "a100": 312e12, "v4": 275e12, "v5e": 197e12,
        "v5p": 459e12}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run. throughput: tokens/s per chip ("tps"), model TFLOP/s per chip
    in MaxText's convention ("maxtext_tflops") or hardware TFLOP/s per GPU in Megatron's
    ("megatron_tflops"). source_mfu: the source's own MFU figure (its convention)."""

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
    note: str = ""
    tp_comm: str = "allreduce"
    attention: str = "auto"
    # the flash kernel the source called, where it is not the profile's own
    # (engine/cost/hardware.py KERNELS): "flash2" = FlashAttention-2, "triton" = the
    # first FlashAttention's Triton port
    kernel: str = ""
    # False: the source ran eagerly (PyTorch without torch.compile), each elementwise
    # op its own kernel with its own HBM round trip: priced unfused (Row.bytes)
    fused: bool = True
    # gradient accumulation the step runs itself (--microbatches), its grads reduced once
    microbatches: int = 1
    # the dtype fsdp reduce-scatters grads in (--grad-reduce)
    grad_reduce: str = "compute"

    def argv(self) -> list[str]:
        # every source's FSDP issues the next layer's weight gather before the current
        # layer's compute (PyTorch FSDP: the CPU enqueues layer i+1's all-gather while
        # the GPU runs layer i, plus BACKWARD_PRE prefetch; MaxText: XLA's latency hiding
        # scheduler with the async collective fusion flags in its scripts): --prefetch
        prefetch = ["--prefetch"] if self.zero == 3 and "fsdp" in self.layout else []
        return prefetch + ["--model", "tiny", "--layers", str(self.layers), "--d-model", str(self.d_model),
                "--heads", str(self.heads), "--kv-heads", str(self.kv_heads),
                "--head-dim", str(self.head_dim), "--mlp-dim", str(self.mlp_dim),
                "--vocab", str(self.vocab), "--seq", str(self.seq), "--batch", str(self.batch),
                "--layout", self.layout, "--remat", self.remat, "--zero", str(self.zero),
                "--tp-comm", self.tp_comm, "--attention", self.attention,
                "--activations", "bf16", "--microbatches", str(self.microbatches),
                "--grad-reduce", self.grad_reduce]


def gelu_match(d: int, tp: int = 1) -> int:
    """SwiGLU hidden with a GELU MLP's (hidden 4d) matmul FLOPs: 8d/3, nearest multiple of tp."""
    return max(tp, round(8 * d / 3 / tp) * tp)


def _mpt(name, hw, chips, d, heads, layers, micro, remat, tps, mfu, zero=3, note=""):
    return Run(f"llm-foundry MPT-{name} {chips}x{hw}", hw, chips, layers, d, heads, heads,
               d // heads, gelu_match(d), 50368, 2048, micro * chips, f"fsdp{chips}", remat,
               zero, tps, "tps", mfu, FOUNDRY, note, kernel="triton", fused=False,
               grad_reduce="f32")


def _maxtext(name, hw, chips, scale_dims, micro, layout, remat, tflops, mfu, seq=2048,
             tp_comm="allreduce"):
    """chips: a v4-N / v5p-N slice has N/2 chips (N counts TensorCores, two per chip);
    v5e-N has N. tp_comm: MaxText's v5p scripts set XLA:TPU's asynchronous collective
    fusion and `xla_tpu_overlap_compute_collective_tc`, which run the tensor-parallel
    collectives under compute: the engine's overlapped form is `--tp-comm ring`."""
    layers, d, heads, mlp = scale_dims
    return Run(f"MaxText {name} {chips}x{hw}", hw, chips, layers, d, heads, heads, 128, mlp,
               32000, seq, micro * chips, layout, remat, 3, tflops, "maxtext_tflops", mfu,
               MAXTEXT.format(hw), tp_comm=tp_comm)


def _megatron(name, layers, h, heads, tp, gpus, batch, micro, tflops, mfu):
    """micro: the run's micro-batch size (`MBS` in the paper's reproduction script
    run_table_1.sh; its `GBS` is the paper's batch). With more than one microbatch per
    data-parallel rank the step accumulates their grads (`--microbatches`) and
    all-reduces them once, as Megatron's no-pipelining schedule does (its DDP's
    `no_sync` for all but the last microbatch)."""
    dp = gpus // tp
    return Run(f"Megatron {name} {gpus}xa100", "a100", gpus, layers, h, heads, heads,
               h // heads, gelu_match(h, tp), 51200, 2048, batch,
               f"dp{dp}xtp{tp}" if tp > 1 else f"dp{gpus}", "full", 3, tflops,
               "megatron_tflops", mfu, MEGATRON,
               "plain data parallel (no ZeRO), full recomputation, unfused attention",
               attention="reference", microbatches=batch // (micro * dp))


def _titan(name, chips, layers, d, heads, kv, mlp, batch, layout, remat, tps, source, note):
    """torchtitan's TP plan is Megatron sequence parallelism (norms and the residual
    stream sharded along the sequence, all-gather / reduce-scatter): --tp-comm sequence."""
    return Run(f"torchtitan {name} {chips}xh100", "h100-gt", chips, layers, d, heads, kv,
               d // heads, mlp, 128256, 8192, batch, layout, remat, 3, tps, "tps", None,
               source, note, tp_comm="sequence" if "tp" in layout else "allreduce",
               kernel="flash2", grad_reduce="f32")


TITAN_NOTE = ("Grand Teton H100 at 500 W with 96 GB HBM2e (2.4 TB/s), below the SXM5 profile; "
              "selective AC mapped to remat dots")
RUNS = (
    # llm-foundry, H100 80GB, bf16, FSDP FULL_SHARD (zero 3), gradient accumulation 1
    _mpt("7b", "h100", 8, 4096, 32, 32, 6, "none", 10643, 46.44),
    _mpt("13b", "h100", 8, 5120, 40, 40, 2, "none", 4792, 39.79),
    _mpt("1b", "h100", 8, 2048, 16, 24, 14, "none", 45455, 41.82),
    _mpt("760m", "h100", 16, 1536, 12, 24, 24, "none", 68551, 37.89),
    _mpt("13b", "h100", 64, 5120, 40, 40, 2, "none", 4800, 39.86),
    _mpt("7b", "h100", 128, 4096, 32, 32, 6, "none", 10475, 45.71),
    _mpt("13b", "h100", 128, 5120, 40, 40, 16, "full", 5080, 42.18),
    _mpt("30b", "h100", 128, 7168, 56, 48, 8, "full", 2199, 41.85),
    _mpt("70b", "h100", 128, 8192, 64, 80, 8, "full", 1058, 43.36),
    _mpt("3b", "h100", 128, 2560, 20, 32, 8, "none", 23422, 42.43, zero=2,
         note="SHARD_GRAD_OP = zero 2"),
    # llm-foundry, A100 80GB, per microbatch (gradient accumulation 2-4 in the source)
    _mpt("7b", "a100", 8, 4096, 32, 32, 6, "none", 4641, 64.23),
    _mpt("13b", "a100", 8, 5120, 40, 40, 2, "none", 2262, 59.57),
    _mpt("3b", "a100", 8, 2560, 20, 32, 10, "none", 10811, 62.11),
    _mpt("1b", "a100", 8, 2048, 16, 24, 14, "none", 20513, 59.86),
    # MaxText TPU configs (global_parameter_scale s: layers, d_model, heads, mlp from
    # base.yml's 16, 2048, 16, 7168 doubled in turn: heads and mlp, d_model, layers)
    _maxtext("16B", "v5e", 256, (32, 4096, 64, 28672), 6, "fsdp256", "full", 120, 61.10),
    _maxtext("32B", "v5e", 256, (32, 8192, 64, 28672), 4, "fsdp256", "full", 132, 66.86),
    _maxtext("64B", "v5e", 256, (64, 8192, 64, 28672), 2, "fsdp256", "full", 118, 59.90),
    _maxtext("22B", "v4", 64, (48, 6144, 24, 24576), 13, "fsdp64", "full", 156, 56.7),
    _maxtext("32B", "v5p", 64, (32, 8192, 64, 28672), 6, "fsdp16xtp4", "dots", 328, 71.47,
             tp_comm="ring"),
    # Megatron-LM, A100 80GB (Selene), Table 1 rows without pipeline parallelism: 32
    # data-parallel ranks at micro-batch size 16, 16, 16, 8, so 1, 1, 1, 4 microbatches
    _megatron("1.7B", 24, 2304, 24, 1, 32, 512, 16, 137, 44),
    _megatron("3.6B", 30, 3072, 32, 2, 64, 512, 16, 138, 44),
    _megatron("7.5B", 36, 4096, 32, 4, 128, 512, 16, 142, 46),
    _megatron("18.4B", 40, 6144, 48, 8, 256, 1024, 8, 135, 43),
    # torchtitan, Llama 3.1 8B / 70B, bf16, torch.compile
    _titan("Llama3.1-8B fsdp8", 8, 32, 4096, 32, 8, 14336, 16, "fsdp8", "dots", 6667,
           TITAN_2412, TITAN_NOTE),
    _titan("Llama3.1-8B fsdp128", 128, 32, 4096, 32, 8, 14336, 256, "fsdp128", "dots", 6514,
           TITAN_2412, TITAN_NOTE),
    _titan("Llama3.1-8B fsdp8xtp8", 64, 32, 4096, 32, 8, 14336, 96, "fsdp8xtp8", "dots", 4378,
           TITAN_ASYNC, TITAN_NOTE + "; vanilla TP"),
    _titan("Llama3.1-70B fsdp32xtp8", 256, 80, 8192, 64, 8, 28672, 512, "fsdp32xtp8", "full",
           597.3, TITAN_ASYNC, TITAN_NOTE + "; vanilla TP"),
)


def maxtext_flops_per_token(r: Run) -> float:
    """MaxText's training FLOPs per token (module doc)."""
    d, hk = r.d_model, r.heads * r.head_dim
    matmul = 2 * d * r.mlp_dim * 3 + 2 * d * (r.heads + 2 * r.kv_heads) * r.head_dim + 2 * d * hk
    attn = 4 * r.seq * hk / 2
    return 3 * (r.layers * (matmul + attn) + 2 * d * r.vocab)


def megatron_flops_per_token(r: Run) -> float:
    """Megatron's hardware FLOPs per token with full recomputation (module doc)."""
    h, s, l = r.d_model, r.seq, r.layers
    return 96 * l * h * h * (1 + s / (6 * h) + r.vocab / (16 * l * h))


def tokens_per_chip(r: Run) -> float:
    if r.unit == "tps":
        return r.throughput
    per_token = maxtext_flops_per_token(r) if r.unit == "maxtext_tflops" \
        else megatron_flops_per_token(r)
    return r.throughput * 1e12 / per_token


def profile(r: Run):
    """The hardware profile `r` ran on, with the attention kernel its source called and,
    for an eager source, no fusion."""
    from engine.cost import hardware

    hw = hardware.get(r.hardware)
    if r.kernel:
        hw = dataclasses.replace(hw, **hardware.KERNELS[r.kernel][r.hardware])
    return hw if r.fused else dataclasses.replace(hw, fusion=False)


def evaluate(r: Run) -> dict:
    """Predicted and published MFU (this engine's convention), peak HBM and fit."""
    from engine.cli.args import build_parser, parse_or_exit
    from engine.cost.fit import memory_fit
    from engine.cost.ledger import step_ledger
    from engine.cost.price import predict, predicted_mfu
    from engine.run.mfu import flops_per_token

    cfg, tcfg, parallel, layout, _ = parse_or_exit(r.argv(), build_parser())
    hw = profile(r)
    rows = step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)
    pred = predict(rows, hw, layout.mesh_axes(), prefetch=parallel.prefetch)
    mfu = predicted_mfu(pred, cfg, tcfg, hw, layout.size)
    published = tokens_per_chip(r) * flops_per_token(cfg, tcfg.seq) / PEAK[r.hardware]
    peak_bytes, fits = memory_fit(cfg, tcfg, parallel, layout, hw)
    return dict(name=r.name, predicted_mfu=mfu, published_mfu=published,
                error=mfu - published, source_mfu=r.source_mfu, predicted_step_s=pred.step_s,
                predicted_compute_s=pred.compute_s, predicted_comm_s=pred.comm_s,
                predicted_exposed_comm_s=pred.exposed_comm_s,
                predicted_peak_bytes=peak_bytes, fits=fits, layout=r.layout, remat=r.remat,
                source=r.source, note=r.note)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows and summary as JSON")
    p.add_argument("--only", default=None, help="rows whose name contains this text")
    args = p.parse_args(argv)
    from tabulate import tabulate

    runs = [r for r in RUNS if args.only is None or args.only.lower() in r.name.lower()]
    if not runs:
        print(f"error: no run matches {args.only!r}", file=sys.stderr)
        return 2
    out = [evaluate(r) for r in runs]
    print(tabulate([[o["name"], o["layout"], o["remat"], 100 * o["predicted_mfu"],
                     100 * o["published_mfu"], 100 * o["error"], o["source_mfu"],
                     None if o["predicted_peak_bytes"] is None
                     else o["predicted_peak_bytes"] / 2**30, o["fits"]] for o in out],
                   ["run", "layout", "remat", "pred MFU %", "published MFU %", "error pts",
                    "source's MFU %", "peak GiB", "fits"], floatfmt=".1f"))
    errs = [abs(100 * o["error"]) for o in out]
    summary = dict(rows=len(out), median_abs_error_pts=statistics.median(errs),
                   max_abs_error_pts=max(errs))
    print(f"{len(out)} runs: median |error| {summary['median_abs_error_pts']:.1f} MFU points, "
          f"max {summary['max_abs_error_pts']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=out, **summary), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
