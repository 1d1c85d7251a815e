"""HBM fit on accelerators and the published-runs table: its conventions, facts and
rules, its rows priced as their sources ran them."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import attention_rates, hardware, memory
from engine.parallel.layout import Layout


def test_fit_and_no_fit_on_h100():
    h100 = hardware.get("h100")
    cfg = model_config("llama3-70b", dtype="bf16", remat="full")
    tcfg = TrainConfig(seq=2048, batch=8)
    peak = memory.predict(cfg, tcfg, Layout.parse("fsdp8"), platform="accelerator",
                          parallel=ParallelConfig(zero=1)).peak
    assert peak > h100.hbm_capacity  # f32 params and grads whole on each of 8 chips
    tcfg = TrainConfig(seq=2048, batch=64)
    peak = memory.predict(cfg, tcfg, Layout.parse("fsdp64"), platform="accelerator",
                          parallel=ParallelConfig(zero=3)).peak
    assert peak < h100.hbm_capacity


def test_pipelined_remat_none_is_priced_on_an_accelerator_at_any_length():
    """The pipelined memory model stashes the head's residuals with the kernel the
    accelerator runs: at a length whose `auto` kernel is the blocked one (flash on the
    target) it predicts, and each more microbatch in flight adds to the stash."""
    from layers.kernels import AUTO_BLOCKED_FROM

    cfg = dataclasses.replace(model_config("tiny"), dtype="bf16", remat="none", n_layers=4,
                              attention="auto")
    tcfg = TrainConfig(seq=AUTO_BLOCKED_FROM, batch=8)
    lay = Layout.parse("pp2xfsdp2")
    peaks = [memory.predict(cfg, tcfg, lay, platform="accelerator",
                            parallel=ParallelConfig(microbatches=m)).peak for m in (2, 4)]
    assert 0 < peaks[0] and peaks[1] != peaks[0]


def test_megatron_accumulates_its_microbatches_and_then_fits_the_a100():
    """Megatron's 18.4B run (Table 1) as its reproduction script ran it: micro-batch
    size 8 on 32 data-parallel ranks, 4 microbatches accumulated. Its peak fits the
    A100's 80 GB; the same 1024 sequences as one microbatch do not."""
    from bench.published import RUNS, argv, source_settings
    from engine.cli.args import build_parser, parse

    r = next(r for r in RUNS if r.name.startswith("Megatron 18.4B"))
    assert (r.batch, r.microbatches) == (1024, 4)
    cfg, tcfg, par, layout, _ = parse(argv(r, source_settings(r)), build_parser())
    a100 = hardware.get("a100")
    accumulated = memory.predict(cfg, tcfg, layout, "accelerator", parallel=par)
    whole = memory.predict(cfg, tcfg, layout, "accelerator",
                           parallel=dataclasses.replace(par, microbatches=1))
    assert accumulated.peak < a100.hbm_capacity < whole.peak


def test_flash_backward_buffers_follow_the_kernel_each_chip_runs():
    """The flash kernel's backward writes dq, dk, dv in the compute dtype; a GPU's
    FlashAttention adds an f32 dq accumulator in HBM [B, L, H, K], a TPU's Pallas kernel
    accumulates on chip: the two peaks differ by exactly that buffer, where the layer
    backward is the peak, and by what was read off XLA:TPU's buffer assignment
    (bench/tpu_compile.py): three [B, L, F] buffers at the MLP backward where the GPU
    items count five (g, u, dg, du, h relaid out; not checked against its compiler), and
    every layer's weight shards cast to the compute dtype before the loop."""
    assert hardware.get("v5p").memory_platform == "tpu"
    assert hardware.get("h100").memory_platform == "accelerator"
    cfg = model_config("llama3-8b", vocab=8192, dtype="bf16", activations="bf16",
                       remat="full", attention="blocked")  # run as flash on a chip
    tcfg = TrainConfig(seq=4096, batch=8)
    gpu, tpu = (memory.predict(cfg, tcfg, Layout.parse("fsdp8"), platform=p,
                               parallel=ParallelConfig()) for p in ("accelerator", "tpu"))
    assert gpu.phase == tpu.phase == "layer backward"
    B, L, H, K, F = 1, 4096, cfg.n_heads, cfg.head_dim, cfg.mlp_dim
    N, D, G = cfg.n_layers, cfg.d_model, cfg.n_kv_heads
    W = 2 * D * H * K + 2 * D * G * K + 3 * D * F  # one layer's weights
    hoisted = N * W // 8 * 2  # their fsdp8 shards, bf16
    assert gpu.peak - tpu.peak == B * L * H * K * 4 + 2 * B * L * F * 2 - hoisted
    assert sum(v for k, v in tpu.items.items() if "mlp" in k) == 3 * B * L * F * 2
    assert tpu.items["residual: every layer's weight shards cast to the compute dtype, "
                     "hoisted"] == hoisted
    dqkv = "transient: attention dq, dk, dv (compute dtype)"
    assert tpu.items[dqkv] == gpu.items[dqkv] == B * L * (H + 2 * cfg.n_kv_heads) * K * 2


def test_published_conventions():
    from bench.published import RUNS, megatron_flops_per_token, tokens_per_chip
    from bench.published_runs import gelu_match

    assert len(RUNS) >= 15
    assert 3 * 4096 * gelu_match(4096) == pytest.approx(2 * 4096 * 4 * 4096, rel=1e-4)
    assert gelu_match(4096, 4) % 4 == 0
    r = next(r for r in RUNS if r.name.startswith("Megatron 1.7B"))
    # 137 TFLOP/s of hardware FLOPs (with recompute, 4 passes of 2 FLOPs per param)
    # is about 137e12 / (8 x 1.7e9) tokens/s
    assert tokens_per_chip(r) == pytest.approx(137e12 / megatron_flops_per_token(r))
    assert tokens_per_chip(r) == pytest.approx(137e12 / (8 * 1.7e9), rel=0.15)


def test_published_table_rows_all_price():
    from bench.published import RUNS, evaluate

    for r in RUNS[:2]:
        out = evaluate(r, engine=False)
        assert 0 < out["predicted_mfu"] < 1 and 0 < out["published_mfu"] < 1
        # the step is its compute plus the communication left exposed
        assert out["predicted_step_s"] == pytest.approx(
            out["predicted_compute_s"] + out["predicted_exposed_comm_s"])
        assert 0 <= out["predicted_exposed_comm_s"] <= out["predicted_comm_s"]


def test_rows_price_the_attention_kernel_and_chip_their_source_ran():
    from bench.published import RUNS, profile

    foundry = [r for r in RUNS if r.name.startswith("llm-foundry")]
    titan = next(r for r in RUNS if r.name.startswith("torchtitan"))
    maxtext = next(r for r in RUNS if r.name.startswith("MaxText"))
    flash2 = attention_rates.FLASH_ATTENTION_2
    # torchtitan: FlashAttention-2, slower than the h100 profile's cuDNN kernel
    hw, cudnn = profile(titan), hardware.get("h100")
    assert hw.attention_rates == flash2[titan.hardware]["attention_rates"]
    for backward in (False, True):
        assert hw.attention_fraction(titan.seq, backward) \
            < cudnn.attention_fraction(titan.seq, backward)
    # llm-foundry: the first FlashAttention's Triton port, on both chips slower than
    # FlashAttention-2 at the rows' length, both passes at its forward + backward rate
    assert {r.hardware for r in foundry} == {"h100", "a100"}
    for r in foundry:
        hw, fa2 = profile(r), dataclasses.replace(hardware.get(r.hardware), **flash2[r.hardware])
        assert hw.attention_rates == attention_rates.FLASH_ATTENTION_TRITON[r.hardware]["attention_rates"]
        fwd, bwd = (hw.attention_fraction(r.seq, b) for b in (False, True))
        assert fwd == bwd < min(fa2.attention_fraction(r.seq, b) for b in (False, True))
    a100 = profile(next(r for r in foundry if r.hardware == "a100"))
    assert a100.attention_fraction(2048, True) == pytest.approx(68 / 312)
    assert profile(foundry[0]).attention_fraction(2048, False) == pytest.approx(108 / 989)
    assert profile(maxtext) == hardware.get(maxtext.hardware)
    # torchtitan's hosts: 96 GB of HBM2e at 2.4 TB/s, a tensor-core peak strictly between
    # the NVL's and the SXM's, MFU over the SXM peak as torchtitan's own figures
    gt, sxm = hardware.get(titan.hardware), hardware.get("h100")
    assert (gt.hbm, gt.hbm_capacity) == (2.4e12, 96e9)
    for dtype in ("bfloat16", "float32"):
        assert hardware._NVL[dtype] < gt.matmul_peak(dtype) < sxm.matmul_peak(dtype)
        assert gt.mfu_peak_of(dtype) == sxm.matmul_peak(dtype)


def test_the_tpu_loss_phase_holds_one_f32_logits_buffer():
    """At the loss's backward XLA:TPU holds one f32 [B, L, V] (read off its buffer
    assignment, bench/tpu_compile.py: 4-chip steps of D = 1024, V = 32000 and D = 2048,
    V = 65536); the GPU items keep XLA:CPU's two (dlogits and a relayout)."""
    cfg = model_config("tiny", d_model=256, vocab=32000, dtype="bf16", activations="bf16",
                       remat="full", attention="blocked")
    tcfg = TrainConfig(seq=2048, batch=32)
    gpu, tpu = (memory.predict(cfg, tcfg, Layout.parse("fsdp4"), platform=p,
                               parallel=ParallelConfig()) for p in ("accelerator", "tpu"))
    assert gpu.phase == tpu.phase == "loss"
    logits = 8 * 2048 * 32000 * 4  # B = 32 / 4 per device, f32
    assert tpu.items["transient: dlogits (XLA:TPU's one f32 [B, L, V_tp])"] == logits
    assert gpu.items["transient: dlogits and a relayout"] == 2 * logits


FACTS = ("hardware", "chips", "layout", "batch", "seq", "precision", "framework")


def test_the_published_table_states_its_facts_and_keeps_a_held_out_set_apart():
    """Each row quotes its source for every fact it is priced by; the held-out set shares
    no run with the table; the table spans pipelines and 1,000+ chips."""
    from bench.published_runs import HELD_OUT, RUNS

    for r in RUNS + HELD_OUT:
        missing = [f for f in FACTS if r.quote(f) == "not stated"]
        assert not missing, (r.name, missing)
        assert r.pp == 1 or r.quote("microbatches") != "not stated" or r.microbatches == 0
    assert len({r.name for r in RUNS + HELD_OUT}) == len(RUNS) + len(HELD_OUT)
    key = lambda r: (r.hardware, r.chips, r.layers, r.d_model, r.seq, r.batch, r.layout,
                     r.framework, r.tp_overlap)
    assert not {key(r) for r in RUNS} & {key(r) for r in HELD_OUT}
    assert len(RUNS) >= 40
    assert sum(r.pp > 1 for r in RUNS) >= 6
    assert sum(r.chips >= 1000 for r in RUNS) >= 4


def test_maxtext_parameter_scale_follows_its_rule():
    """MaxText doubles heads and mlp, then d_model, then layers (the 16B, 32B, 64B
    configs' dimensions as MaxText builds them from base.yml)."""
    from bench.published_runs import maxtext_scale

    assert maxtext_scale(1) == (16, 2048, 16, 7168)
    assert maxtext_scale(16) == (32, 4096, 64, 28672)
    assert maxtext_scale(32) == (32, 8192, 64, 28672)
    assert maxtext_scale(64) == (64, 8192, 64, 28672)
    assert maxtext_scale(128) == (64, 8192, 128, 57344)


def test_maxtext_2023_52b_row_is_its_configs_52b_parameters():
    """The 2023 MaxText 52B row (1xv4-384.sh at e286533d, scale 4 of base.yml) counts
    52B parameters by its train.py's rule, and its SwiGLU stand-in has the ReLU MLP's
    FLOPs: 2·D·49152 = 3·D·F."""
    from bench.published import params6_flops_per_token
    from bench.published_runs import HELD_OUT

    (r,) = [r for r in HELD_OUT if r.name.startswith("MaxText 52B")]
    assert 3 * r.mlp_dim == 2 * 49152 and r.head_dim * r.heads == 8192
    params = params6_flops_per_token(r) / 6
    assert 51.5e9 < params < 52.5e9, params


def _flag(settings, name):
    flags = list(settings.flags)
    return flags[flags.index(name) + 1] if name in flags else None


def test_a_fact_the_source_does_not_state_takes_the_engine_default():
    from bench.published import engine_settings, source_settings
    from bench.published_runs import RUNS

    titan = next(r for r in RUNS if r.framework == "torchtitan-compile" and "tp" in r.layout)
    stated = source_settings(titan)
    assert (_flag(stated, "--remat"), _flag(stated, "--grad-reduce"),
            _flag(stated, "--tp-comm")) == ("alternate", "f32", "sequence")
    # the same row with its remat and reduce dtype unquoted: the engine's defaults
    silent = dataclasses.replace(titan, quotes=tuple(
        (k, v) for k, v in titan.quotes if k not in ("remat", "grad_reduce")))
    assert silent.quote("remat") == "not stated"
    s = source_settings(silent)
    assert (_flag(s, "--remat"), _flag(s, "--grad-reduce")) == ("full", "compute")
    # a tp overlap counts only where the source states it
    overlapped = dataclasses.replace(titan, tp_overlap=True)
    assert _flag(source_settings(overlapped), "--tp-comm") == "sequence"
    overlapped = dataclasses.replace(overlapped, quotes=titan.quotes + (("tp_overlap", "x"),))
    assert _flag(source_settings(overlapped), "--tp-comm") == "ring"
    # Llama 3 states no microbatch count (the fewest the schedule takes), an interleaved
    # schedule and its chunks by their layers (one each: 8), no activation checkpointing
    # at 8K and none stated at 128K (the default, full); without the chunks' quote, the
    # fewest (2)
    llamas = [r for r in RUNS if r.framework == "meta-llama3"]
    for llama in llamas:
        s = source_settings(llama)
        assert (_flag(s, "--microbatches"), _flag(s, "--zero"), _flag(s, "--pp-schedule"),
                _flag(s, "--pp-virtual")) == (str(llama.pp), "2", "interleaved", "8")
        no_chunks = dataclasses.replace(llama, quotes=tuple(
            (k, v) for k, v in llama.quotes if k != "virtual"))
        assert _flag(source_settings(no_chunks), "--pp-virtual") == "2"
        assert _flag(s, "--remat") == ("none" if llama.seq <= 8192 else "full")
        assert (llama.quote("remat") == "not stated") == (llama.seq > 8192)
    unstated = dataclasses.replace(llamas[0], quotes=tuple(
        (k, v) for k, v in llamas[0].quotes if k not in ("remat", "schedule")))
    s = source_settings(unstated)
    assert (_flag(s, "--remat"), _flag(s, "--pp-schedule")) == ("full", "1f1b")
    assert "--pp-virtual" not in s.flags
    # the profile's flash kernel under cp is the engine's blocked one, not `auto`'s
    # dense reference; without cp `auto`
    assert {_flag(source_settings(r), "--attention") for r in llamas} == {"auto", "blocked"}
    assert all((_flag(source_settings(r), "--attention") == "blocked") == ("cp" in r.layout)
               for r in llamas)
    # the engine's column: every setting but the model, batch and layout at its default
    e = engine_settings(titan)
    assert e.flags == ("--microbatches", "1") and e.fused and not e.kernel


def test_one_rule_per_framework_whatever_the_row():
    """Rows of one framework are priced with the same kernel and fusion; an eager
    framework unfused; every zero-3 FSDP row prefetches."""
    from bench.published import FRAMEWORKS, profile, source_settings
    from bench.published_runs import HELD_OUT, RUNS

    for r in RUNS + HELD_OUT:
        s = source_settings(r)
        fw = FRAMEWORKS[r.framework]
        assert (s.kernel, s.fused) == (fw["kernel"], fw["fused"])
        assert ("--prefetch" in s.flags) == ("fsdp" in r.layout and _flag(s, "--zero") == "3")
        assert profile(r).fusion == fw["fused"]
    assert not FRAMEWORKS["composer"]["fused"] and not FRAMEWORKS["torchtitan-eager"]["fused"]


def test_a_fused_cross_entropy_holds_the_logits_and_their_grad_in_the_compute_dtype():
    """llm-foundry's MPT loss (flash-attn's xentropy kernel) saves the bf16 logits and
    writes bf16 dlogits; the engine's loss on a GPU holds two f32 [B, L, V]. Only
    Composer's rows are priced with it."""
    from bench.published import RUNS, profile
    from engine.cost.memory_items import XENTROPY

    cfg = model_config("tiny", d_model=256, vocab=32000, dtype="bf16", activations="bf16",
                       remat="full", attention="blocked")
    tcfg = TrainConfig(seq=2048, batch=32)
    gpu, xent = (memory.predict(cfg, tcfg, Layout.parse("fsdp4"), platform=p,
                                parallel=ParallelConfig()) for p in ("accelerator", XENTROPY))
    logits = 8 * 2048 * 32000  # B = 32 / 4 per device
    assert xent.items["transient: logits saved and dlogits (compute dtype, fused "
                      "cross-entropy)"] \
        == 2 * logits * 2
    assert "transient: dlogits and a relayout" in gpu.items
    assert not any("relayout" in k for k in xent.items)
    assert gpu.phase == xent.phase == "loss"
    assert gpu.peak - xent.peak == 2 * logits * 4 - 2 * logits * 2
    for r in RUNS:
        assert (profile(r).memory_platform == XENTROPY) == (r.framework == "composer"), r.name


def test_interleaved_chunks_are_what_each_source_states():
    """--pp-virtual by the module rule: Megatron's layers per virtual stage n gives
    layers / (pp x n); Llama 3's first chunk left with the embedding alone once one layer
    leaves the first stage gives chunks of one layer (V = layers per stage, 8)."""
    from bench.published import source_settings
    from bench.published_runs import RUNS

    def virtual(r):
        flags = source_settings(r).flags
        return int(flags[flags.index("--pp-virtual") + 1]) if "--pp-virtual" in flags else 1

    llama = [r for r in RUNS if r.framework == "meta-llama3"]
    assert llama and all("only the embedding" in r.quote("virtual") for r in llama)
    assert {virtual(r) for r in llama} == {r.layers // r.pp for r in llama} == {8}
    megatron = {r.name.split()[1]: virtual(r) for r in RUNS if r.framework == "megatron-2021"}
    assert megatron["76.1B"] == 60 // (4 * 5) and megatron["310.1B"] == 96 // (16 * 3)
    assert megatron["529.6B"] == 105 // 35 and megatron["1T"] == 1


def test_a_row_without_a_pipeline_breaks_down_into_its_step():
    """`published_mechanisms --breakdown` on a row without pp: its parts (matmuls, the
    attention kernel by phase, elementwise work, each collective's exposed time) add up
    to the priced step, and the matmuls ran at the profile's sustained matmul rate."""
    from bench import published_mechanisms as pm
    from bench.published_runs import RUNS
    from engine.cost.pipeline import predict_step
    from engine.cost.price import predict

    r = next(r for r in RUNS if r.name == "MaxText llama2-7b 8xh100")
    *_, parallel, layout, hw, rows, _ = pm.traced(r)
    step, _ = predict_step(rows, hw, layout, parallel)
    parts = pm.rates(predict(rows, hw, layout.mesh_axes(), parallel.prefetch), hw)
    assert sum(t for _, t, _ in parts) == pytest.approx(step.step_s)
    by_name = {k: tf for k, _, tf in parts}
    assert {"matmul", "elementwise", "attention fwd", "attention bwd"} <= set(by_name)
    assert by_name["matmul"] <= hw.matmul_rate("bfloat16") / 1e12
    assert by_name["matmul"] > 0.95 * hw.matmul_rate("bfloat16") / 1e12  # 7B's big dots
    # the kernel's forward at 4096 keys, in its benchmarks' convention (FA3 paper: 518)
    assert by_name["attention fwd"] == pytest.approx(518, rel=1e-3)
    assert pm.flat_breakdown(r)[0].startswith(r.name)


def test_tp_attributed_to_sequence_parallelism_runs_sequence():
    """A row whose source attributes its tensor parallelism to Korthikanti et al. (the
    paper of sequence parallelism; the Llama 3 paper does) is priced with
    `--tp-comm sequence`; the rule reads that quote alone, not the framework."""
    from bench.published import HELD_OUT, RUNS, argv, source_settings

    def comm(r):
        flags = argv(r, source_settings(r))
        return flags[flags.index("--tp-comm") + 1]

    cited = [r for r in (*RUNS, *HELD_OUT) if "Korthikanti" in r.quote("tp_comm")]
    assert cited and all(r.framework == "meta-llama3" for r in cited)
    assert all(comm(r) == "sequence" for r in cited if "tp" in r.layout)
    uncited = dataclasses.replace(cited[0], quotes=tuple(
        (k, v) for k, v in cited[0].quotes if k != "tp_comm"))
    assert comm(uncited) == "allreduce"
