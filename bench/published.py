"""Predicted vs published MFU for public training runs (predict-only, no devices).

    python bench/published.py              # the table and the held-out set, both columns
    python bench/published.py --facts      # each row's facts in its source's words
    python bench/published.py --json out.json --only maxtext

The runs and their facts are in bench/published_runs.py (`RUNS`, the table; `HELD_OUT`,
published runs kept out of it). Each run is priced twice:
- "as the source ran it": the facts its source states, each mapped to an engine setting
  by the rules below (the same for every row); a fact the source does not state takes
  the engine's default;
- "as this engine would run it": the same model, chips, sequence, global batch and
  layout with every other setting at the engine's default (`engine.train`'s flags left
  out, so `--activations auto`, `--remat full`, `--zero 3`, the profile's own attention
  kernel, XLA's fusion).

Rules, fact -> setting:
- framework -> attention kernel, fusion and tp collectives (`FRAMEWORKS`): PyTorch
  eager (Composer; torchtitan without torch.compile) runs each elementwise op as its own
  kernel: priced unfused (`Hardware.fusion` off); torch.compile, XLA and Megatron's fused
  kernels fuse them. Attention is the kernel the framework calls: Composer's
  `attn_impl: triton` (the tables' commits, b2a43a1 and 5e85bd6, whose
  `submit_benchmarks.py` defaults `--attn_impl` to triton, which `sweep.sh` never passes)
  is the first FlashAttention's Triton port (`attention_rates.FLASH_ATTENTION_TRITON`);
  torchtitan's SDPA flash backend is FlashAttention-2 (`FLASH_ATTENTION_2`: SDPA's cuDNN
  backend is opt-in since PyTorch 2.5.1, pytorch/pytorch#138649, and torchtitan asks
  for FLASH_ATTENTION on H100, pytorch/torchtitan#1196); MaxText
  calls Pallas splash on TPU and cuDNN's fused attention through XLA on GPU
  (`attention=cudnn_flash_te`), each the profile's own kernel; Megatron 2021 predates
  FlashAttention and forms the [s, s] scores (`--attention reference`); a source that
  names no kernel gets the profile's (under cp the engine's `blocked` kernel, which
  the accelerator profiles price as their flash kernel: `auto` there is the dense
  reference). Composer's MPT loss is flash-attn's fused
  cross-entropy (its `loss_fn` default, `fused_crossentropy`), which holds the logits and
  their grad in bf16 (`attention_rates.FUSED_CROSS_ENTROPY`; memory only). torchtitan's TP plan
  is Megatron sequence parallelism (`--tp-comm sequence`), Megatron 2021's all-reduces
  (`allreduce`).
- tensor parallelism attributed to Korthikanti et al. (2023), the paper of sequence
  parallelism (the Llama 3 paper's "TP; ... Korthikanti et al. (2023)") ->
  `--tp-comm sequence` (`SEQUENCE_PARALLEL`).
- tp collectives overlapped with compute (MaxText's `xla_tpu_overlap_compute_collective_tc`,
  torchtitan's Async TP) -> `--tp-comm ring`.
- FSDP with its weights gathered per layer (zero 3) -> `--prefetch`: every source's
  FSDP issues the next layer's gather before the current layer's compute (PyTorch FSDP's
  forward / backward prefetch, XLA's latency-hiding scheduler).
- MP Mode / reduce dtype -> `--grad-reduce`: PyTorch FSDP's DEFAULT mixed precision
  and torchtitan's `mixed_precision_reduce = "float32"` reduce in f32, Composer's PURE in
  bf16; not stated -> the engine's default (the compute dtype).
- activation checkpointing -> `--remat`: none, full; a policy that saves the matmul
  outputs (MaxText's `minimal`) -> `dots`; torchtitan's per-op selective AC, which saves
  the matmul outputs but every second one (wk, wo and w3 are recomputed) and the
  attention's output -> `alternate` (layers/block.py); an offloading policy keeps
  nothing on the chip -> `full`; not stated -> `full`.
- microbatches: stated (Megatron's GBS / (MBS x dp)) -> `--microbatches`; PyTorch FSDP
  reduces grads on every microbatch, so its rows are priced per microbatch (batch =
  microbatch x ranks); not stated -> the engine's default, raised to pp on a pipelined
  layout (the fewest its 1F1B schedule accepts). Pipeline schedule: interleaved where
  the source states virtual stages, else 1F1B. Chunks per device (`--pp-virtual`): as
  stated (Megatron's `--num-layers-per-virtual-pipeline-stage` n: layers / (pp x n));
  a source that removes one layer from its first stage and says that leaves the
  stage's first chunk with the embedding alone states chunks of one layer: layers per
  stage (Llama 3: 8); neither stated: 2, the fewest.
- precision: every source runs bf16 (or fp16, the same two bytes) -> `--activations bf16`.

FLOP conventions. Every MFU here is this engine's: engine/run/mfu.py's model FLOPs per
token (6 per non-embedding parameter + 12·N·H·K·L attention, no causal halving, no remat)
x published tokens/s per chip / the chip's dense bf16 peak (989 TFLOP/s H100, 312 A100,
275 v4, 197 v5e, 459 v5p: the peaks every source used). So the published column is the
source's throughput re-expressed, not the source's own MFU (shown beside it):
llm-foundry and torchtitan report tokens/s per GPU, used as is; MaxText TFLOP/s per chip,
converted with MaxText's formula (`maxtext_flops_per_token`); Megatron hardware TFLOP/s
with full recomputation, converted with its paper's formula (`megatron_flops_per_token`);
the Llama 3 paper TFLOP/s per GPU in a convention it does not state, read as this
engine's. torchtitan's H100s are its Grand Teton hosts (the `h100-gt` profile).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.published_runs import HELD_OUT, PEAK, RUNS, Run  # noqa: E402

# framework -> (attention kernel: "" the profile's, "flash2", "triton"; --attention;
# elementwise ops fused; --tp-comm without overlap; loss: "xentropy" a fused
# cross-entropy kernel, `attention_rates.FUSED_CROSS_ENTROPY`, else the engine's f32 loss)
FRAMEWORKS = {
    "composer": dict(kernel="triton", attention="auto", fused=False, tp_comm="allreduce",
                     loss="xentropy"),
    "torchtitan-compile": dict(kernel="flash2", attention="auto", fused=True,
                               tp_comm="sequence"),
    "torchtitan-eager": dict(kernel="flash2", attention="auto", fused=False,
                             tp_comm="sequence"),
    "maxtext": dict(kernel="", attention="auto", fused=True, tp_comm="allreduce"),
    "megatron-2021": dict(kernel="", attention="reference", fused=True, tp_comm="allreduce"),
    "meta-llama3": dict(kernel="", attention="auto", fused=True, tp_comm="allreduce"),
}
ENGINE = dict(kernel="", attention="auto", fused=True, tp_comm="allreduce")
# an interleaved schedule whose chunks per device the source does not state runs the
# fewest it can: 2 (as unstated microbatches take the fewest the schedule accepts)
FEWEST_CHUNKS = 2


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a row is priced with: engine flags beyond the model and batch, the attention
    kernel the profile is given ("" its own) and whether elementwise ops fuse."""

    flags: tuple
    kernel: str = ""
    fused: bool = True
    loss: str = ""


def stated(r: Run, fact: str) -> bool:
    return r.quote(fact) != "not stated"


def _pp_microbatches(r: Run) -> int:
    return r.pp if r.pp > 1 else 1


def _chunks(r: Run) -> int:
    """Chunks per device of an interleaved row: as its source states them (Megatron's
    layers per virtual stage in its schedule quote, Llama 3's in its "virtual" one),
    else the fewest."""
    said = stated(r, "virtual") or "virtual-pipeline-stage" in r.quote("schedule")
    return r.virtual if said and r.virtual > 1 else FEWEST_CHUNKS


# the paper of sequence parallelism: a source that names it for its tensor parallelism
# runs tp with it (Korthikanti et al., "Reducing Activation Recomputation in Large
# Transformer Models", MLSys 2023: activations sharded over tp along the sequence
# outside the tp regions, gathered again in the backward)
SEQUENCE_PARALLEL = "Korthikanti et al."


def _tp_comm(r: Run, fw: dict) -> str:
    if "tp" not in r.layout:
        return "allreduce"
    if r.tp_overlap and stated(r, "tp_overlap"):
        return "ring"
    return "sequence" if SEQUENCE_PARALLEL in r.quote("tp_comm") else fw["tp_comm"]


def _attention(r: Run, fw: dict) -> str:
    """The engine kernel that runs the framework's attention: "auto" (the profile's
    flash kernel) is, under cp, the engine's blocked kernel, its one flash-style kernel
    that takes a cp rank's global offsets (`auto` there picks the dense reference)."""
    if fw["attention"] == "auto" and "cp" in r.layout:
        return "blocked"
    return fw["attention"]


def source_settings(r: Run) -> Settings:
    """The row's facts through the rules of the module doc."""
    fw = FRAMEWORKS[r.framework]
    zero = r.zero if r.zero else 3
    prefetch = zero == 3 and "fsdp" in r.layout
    flags = ["--remat", r.remat if stated(r, "remat") else "full", "--zero", str(zero),
             "--tp-comm", _tp_comm(r, fw),
             "--attention", _attention(r, fw), "--activations", "bf16",
             "--grad-reduce", r.grad_reduce if stated(r, "grad_reduce") else "compute",
             "--microbatches", str(r.microbatches if r.microbatches and stated(r, "microbatches")
                                   else _pp_microbatches(r))]
    if r.pp > 1:
        interleaved = r.schedule == "interleaved" and stated(r, "schedule")
        flags += ["--pp-schedule", "interleaved" if interleaved else "1f1b"]
        if interleaved:
            flags += ["--pp-virtual", str(_chunks(r))]
    return Settings(tuple(flags + (["--prefetch"] if prefetch else [])), fw["kernel"],
                    fw["fused"], fw.get("loss", ""))


def engine_settings(r: Run) -> Settings:
    """The engine's defaults for the row's model, chips, batch and layout."""
    flags = ["--microbatches", str(_pp_microbatches(r))]
    return Settings(tuple(flags), ENGINE["kernel"], ENGINE["fused"])


def argv(r: Run, s: Settings) -> list[str]:
    return ["--model", "tiny", "--layers", str(r.layers), "--d-model", str(r.d_model),
            "--heads", str(r.heads), "--kv-heads", str(r.kv_heads),
            "--head-dim", str(r.head_dim), "--mlp-dim", str(r.mlp_dim),
            "--vocab", str(r.vocab), "--seq", str(r.seq), "--batch", str(r.batch),
            "--layout", r.layout, *s.flags]


def maxtext_flops_per_token(r: Run) -> float:
    """MaxText's training FLOPs per token (maxtext_utils.calculate_tflops_training_per_device:
    6 x (MLP, QKV, out-projection, unembedding matmul params) + causal-halved attention)."""
    d, hk = r.d_model, r.heads * r.head_dim
    matmul = 2 * d * r.mlp_dim * 3 + 2 * d * (r.heads + 2 * r.kv_heads) * r.head_dim + 2 * d * hk
    attn = 4 * r.seq * hk / 2
    return 3 * (r.layers * (matmul + attn) + 2 * d * r.vocab)


def megatron_flops_per_token(r: Run) -> float:
    """Megatron's hardware FLOPs per token with full recomputation (Narayanan et al. 2021,
    96·B·s·l·h²·(1 + s/6h + V/16lh) per batch)."""
    h, s, l = r.d_model, r.seq, r.layers
    return 96 * l * h * h * (1 + s / (6 * h) + r.vocab / (16 * l * h))


def params6_flops_per_token(r: Run) -> float:
    """6 x the parameters, MaxText's 2023 count (train.py: `6 * num_model_parameters`),
    its embedding tied (counted once): per layer the four attention projections, the MLP
    (its FLOPs as this engine's SwiGLU of `mlp_dim`) and two norms."""
    d, hd = r.d_model, r.head_dim
    layer = 2 * d * hd * (r.heads + r.kv_heads) + 3 * d * r.mlp_dim + 2 * d
    return 6 * (r.layers * layer + r.vocab * d + d)


def tokens_per_chip(r: Run, engine_flops_per_token: float | None = None) -> float:
    """Published tokens/s per chip; "engine_tflops" needs the engine's FLOPs per token."""
    if r.unit == "tps":
        return r.throughput
    per_token = {"maxtext_tflops": maxtext_flops_per_token,
                 "params6_tflops": params6_flops_per_token,
                 "megatron_tflops": megatron_flops_per_token}.get(r.unit)
    per_token = per_token(r) if per_token else engine_flops_per_token
    return r.throughput * 1e12 / per_token


def profile(r: Run, s: Settings | None = None):
    """The hardware profile `r` ran on, with the attention kernel and fusion of `s`
    (default: as its source ran it)."""
    from engine.cost import attention_rates, hardware

    s = s or source_settings(r)
    hw = hardware.get(r.hardware)
    if s.kernel:
        hw = dataclasses.replace(hw, **attention_rates.KERNELS[s.kernel][r.hardware])
    if s.loss:
        hw = dataclasses.replace(hw, **attention_rates.FUSED_CROSS_ENTROPY)
    return hw if s.fused else dataclasses.replace(hw, fusion=False)


def _plans_once() -> None:
    """Build each pipeline schedule table once per process: the ledger's trace, the
    pricing and the memory model each ask for the same plan, and the table of a long
    schedule (Megatron's 529.6B row: pp 35, 3 chunks, 280 microbatches) takes minutes."""
    from engine.parallel import pipeline

    if not hasattr(pipeline.step_plan, "cache_info"):
        pipeline.step_plan = functools.lru_cache(maxsize=None)(pipeline.step_plan)


def price(r: Run, s: Settings) -> dict:
    """Predicted MFU (this engine's convention), step seconds, peak HBM and fit of `r`
    under `s`."""
    _plans_once()
    from engine.cli.args import build_parser, parse_or_exit
    from engine.cost.fit import memory_fit
    from engine.cost.ledger import step_ledger
    from engine.cost.pipeline import predict_step
    from engine.cost.price import predicted_mfu

    cfg, tcfg, parallel, layout, _ = parse_or_exit(argv(r, s), build_parser())
    hw = profile(r, s)
    rows = step_ledger(cfg, tcfg, layout, parallel, hw.bf16_collectives_in_f32)
    pred, _ = predict_step(rows, hw, layout, parallel)
    peak_bytes, fits = memory_fit(cfg, tcfg, parallel, layout, hw)
    return dict(mfu=predicted_mfu(pred, cfg, tcfg, hw, layout.size), step_s=pred.step_s,
                compute_s=pred.compute_s, comm_s=pred.comm_s,
                exposed_comm_s=pred.exposed_comm_s, peak_bytes=peak_bytes, fits=fits,
                cfg=cfg, tcfg=tcfg)


def evaluate(r: Run, engine: bool = True) -> dict:
    """Both columns of `r` against its published MFU (engine=False: the source's only)."""
    from engine.run.mfu import flops_per_token

    src = price(r, source_settings(r))
    per_token = flops_per_token(src["cfg"], src["tcfg"].seq)
    published = tokens_per_chip(r, per_token) * per_token / PEAK[r.hardware]
    out = dict(name=r.name, layout=r.layout, published_mfu=published, source_mfu=r.source_mfu,
               predicted_mfu=src["mfu"], error=src["mfu"] - published,
               predicted_step_s=src["step_s"], predicted_compute_s=src["compute_s"],
               predicted_comm_s=src["comm_s"], predicted_exposed_comm_s=src["exposed_comm_s"],
               predicted_peak_bytes=src["peak_bytes"], fits=src["fits"], source=r.source,
               note=r.note, flags=" ".join(source_settings(r).flags))
    if engine:
        eng = price(r, engine_settings(r))
        out.update(engine_mfu=eng["mfu"], engine_error=eng["mfu"] - published,
                   engine_peak_bytes=eng["peak_bytes"], engine_fits=eng["fits"])
    return out


def summary(out: list[dict]) -> dict:
    """Median and max |error| (MFU points) of both columns, and how many fit."""
    res = dict(rows=len(out), fit=sum(bool(o["fits"]) for o in out))
    for key, col in (("error", "source"), ("engine_error", "engine")):
        errs = [abs(100 * o[key]) for o in out if key in o]
        if errs:
            res[f"{col}_median_abs_error_pts"] = statistics.median(errs)
            res[f"{col}_max_abs_error_pts"] = max(errs)
    return res


def _gib(b):
    return None if b is None else b / 2**30


def show(title: str, out: list[dict]) -> dict:
    from tabulate import tabulate

    print(f"\n{title}")
    print(tabulate([[o["name"], 100 * o["published_mfu"], 100 * o["predicted_mfu"],
                     100 * o["error"], 100 * o["engine_mfu"], 100 * o["engine_error"],
                     o["source_mfu"], _gib(o["predicted_peak_bytes"]), o["fits"]]
                    for o in out],
                   ["run", "published MFU %", "as the source ran it %", "error pts",
                    "as this engine would run it %", "error pts", "source's MFU %",
                    "peak GiB", "fits"], floatfmt=".1f"))
    s = summary(out)
    print(f"{s['rows']} runs: as the source ran them, median |error| "
          f"{s['source_median_abs_error_pts']:.1f} MFU points, max "
          f"{s['source_max_abs_error_pts']:.1f}; as this engine would run them, median "
          f"{s['engine_median_abs_error_pts']:.1f}, max {s['engine_max_abs_error_pts']:.1f}; "
          f"{s['fit']} of {s['rows']} predicted to fit")
    return s


def main(argv_=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows and summaries as JSON")
    p.add_argument("--only", default=None, help="rows whose name contains this text")
    p.add_argument("--facts", action="store_true",
                   help="print each row's facts as its source states them, and exit")
    p.add_argument("--table-only", action="store_true", help="leave out the held-out set")
    args = p.parse_args(argv_)
    pick = lambda runs: [r for r in runs if args.only is None
                         or args.only.lower() in r.name.lower()]
    sets = [("table", pick(RUNS))] + ([] if args.table_only else [("held out", pick(HELD_OUT))])
    if not any(runs for _, runs in sets):
        print(f"error: no run matches {args.only!r}", file=sys.stderr)
        return 2
    if args.facts:
        facts = ("hardware", "chips", "layout", "batch", "seq", "precision", "remat",
                 "framework")
        for title, runs in sets:
            for r in runs:
                print(f"{r.name} [{title}] ({r.source})")
                for f in facts + tuple(k for k, _ in r.quotes if k not in facts):
                    print(f"  {f}: {r.quote(f)}")
                print(f"  priced with: {' '.join(source_settings(r).flags)}")
        return 0
    result = {}
    for title, runs in sets:
        if runs:
            out = [evaluate(r) for r in runs]
            result[title] = dict(runs=out, **show(title, out))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
