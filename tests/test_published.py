"""Accelerator pricing pieces: fusion groups, the flash-kernel rows, ring factors, HBM fit,
and the published-runs table's conventions."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import hardware, memory
from engine.cost.ledger import ledger, step_ledger
from engine.cost.price import (
    attention_flops,
    causal_tile_fraction,
    compute_seconds,
    moved_bytes,
    priced_rows,
    ring_factor,
)
from engine.parallel.layout import Layout


def _rows(f, *shapes):
    closed = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    return ledger(closed, Layout.parse("single"))


def test_fusion_group_chain_across_a_jit_reads_inputs_once_writes_output_once():
    inner = jax.jit(lambda a: jnp.exp(a) * 2.0)  # a call boundary XLA inlines

    def f(x, y):
        return inner(x + y) - y  # add -> [exp, mul] -> sub: one loop fusion

    rows = _rows(f, (128, 64), (128, 64))
    compute = [r for r in rows if r.fused_bytes >= 0]
    assert len({r.fusion for r in compute}) == 1
    # reads x and y once (y twice in the program), writes the result once
    assert sum(r.fused_bytes for r in compute) == 3 * 128 * 64 * 4
    # the CPU model stops at the call: more traffic than the fused group
    assert sum(r.bytes for r in compute) > 3 * 128 * 64 * 4


def test_a_scan_stacking_residuals_moves_one_slice_per_step_not_the_stack():
    """The forward scan writes each layer's residual into a stacked [N, ...] buffer and
    the backward reads one back per layer, and the pipeline writes a stash slot: in
    place, a slice each (XLA aliases the buffer), on every profile's byte model."""
    n, shape = 16, (64, 32)
    slice_bytes = 64 * 32 * 4

    def f(x):
        def body(c, _):
            c = jnp.tanh(c)
            return c, c
        _, stack = jax.lax.scan(body, x, None, length=n)  # [n, 64, 32]
        return jax.lax.dynamic_slice_in_dim(stack, 3, 1)

    def g(stack, upd):
        return jax.lax.dynamic_update_slice_in_dim(stack, upd, 5, axis=0)

    def h(stash, x):  # the pipeline's stash: `.at[slot].set` at a traced slot
        return stash.at[jnp.argmax(x[0, :, 0]) % n].set(x[0])

    read = next(r for r in _rows(f, shape) if r.primitive == "dynamic_slice")
    write = next(r for r in _rows(g, (n, *shape), (1, *shape))
                 if r.primitive == "dynamic_update_slice")
    scatter = next(r for r in _rows(h, (n, *shape), (1, *shape)) if r.primitive == "scatter")
    for r in (read, write, scatter):
        # read the slice (or the update) and write it, plus the int32 start indices;
        # the whole stack would be n = 16 slices
        assert r.bytes == pytest.approx(2 * slice_bytes, abs=4 * 3)
        assert r.fused_bytes == pytest.approx(2 * slice_bytes, abs=4 * 3)
        assert r.lib_bytes == r.fused_bytes


def test_matmul_epilogue_fuses_but_a_second_matmul_does_not_join():
    def f(x, w, v):
        h = jnp.tanh(x @ w)          # dot + tanh epilogue: the f32 product is not written
        return (h @ v) + (x @ w)     # x @ w again: its own group, written, then read

    rows = _rows(f, (256, 128), (128, 128), (128, 128))
    dots = [r for r in rows if r.primitive == "dot_general"]
    tanh = next(r for r in rows if r.primitive == "tanh")
    assert tanh.fusion == dots[0].fusion
    groups = {r.fusion for r in dots}
    assert len(groups) == 3  # one matmul per fusion
    x, w, h = 256 * 128 * 4, 128 * 128 * 4, 256 * 128 * 4
    first = sum(r.fused_bytes for r in rows if r.fusion == dots[0].fusion)
    assert first == x + w + h  # reads x, w; writes tanh's output only
    # a library-call matmul (GPU): the product is written, and tanh reads it back in a
    # loop fusion of its own
    assert tanh.lib_fusion != dots[0].lib_fusion
    assert dots[0].lib_bytes == x + w + h
    assert tanh.lib_bytes == 2 * h


def test_gpu_profiles_price_matmul_products_written_tpu_fused():

    rows = _rows(lambda x, w: jnp.tanh(x @ w), (256, 128), (128, 128))
    tanh = next(r for r in rows if r.primitive == "tanh")
    assert moved_bytes(tanh, hardware.get("h100")) == 2 * 256 * 128 * 4
    assert moved_bytes(tanh, hardware.get("v5p")) == tanh.fused_bytes


@pytest.mark.parametrize("keys,tile,expected", [(2048, 128, 17 / 32), (128, 128, 1.0),
                                                (8192, 128, 65 / 128), (200, 128, 3 / 4)])
def test_causal_tile_fraction(keys, tile, expected):
    assert causal_tile_fraction(keys, tile) == pytest.approx(expected)


def test_flash_kernel_rows_replace_the_scan_on_accelerators_only():
    cfg = model_config("small", dtype="bf16", remat="full", attention="blocked")
    tcfg = TrainConfig(seq=512, batch=8)
    layout = Layout.parse("fsdp8")
    rows = step_ledger(cfg, tcfg, layout)
    kernels = [r for r in rows if r.kind == "attention"]
    # forward, remat recompute, backward of the layer scan, N layers each
    assert {r.phase for r in kernels} == {"bwd", "fwd", "recompute"}
    B, L, H, K, N = 8 // 8, 512, cfg.n_heads, cfg.head_dim, cfg.n_layers
    fwd = next(r for r in kernels if r.phase == "fwd")
    assert fwd.count == N
    assert fwd.flops == 4 * B * L * L * H * K  # every [L, T] tile: QK^T and PV
    bwd = next(r for r in kernels if r.phase == "bwd")
    assert bwd.flops == 10 * B * L * L * H * K  # S, dP, dV, dK, dQ
    a100, h100 = hardware.get("a100"), hardware.get("h100")
    assert attention_flops(fwd, a100) == fwd.flops * (4 + 1) / (2 * 4)  # 512 / 128 tiles
    # H100: the FlashAttention-3 paper's cuDNN figures at 512 keys, over half the FLOPs
    assert attention_flops(fwd, h100) == fwd.flops / 2
    for row, tflops in ((fwd, 315), (bwd, 305)):
        memory_s = moved_bytes(row, h100) / (h100.hbm * h100.mem_eff)
        assert compute_seconds(row, h100, 1)[0] == pytest.approx(
            max(row.flops / 2 / (tflops * 1e12), memory_s))
    on_h100, on_cpu = priced_rows(rows, h100), priced_rows(rows, hardware.get("cpu"))
    assert not any(r.kernel for r in on_h100) and any(r.kind == "attention" for r in on_h100)
    assert any(r.kernel for r in on_cpu) and not any(r.kind == "attention" for r in on_cpu)


def test_attention_fraction_interpolates_the_published_speeds_by_sequence():
    h100, gt = hardware.get("h100"), hardware.get("h100-gt")
    fwd = lambda keys, hw=h100: hw.attention_fraction(keys, backward=False)
    assert fwd(2048) == pytest.approx(484 / 989)
    assert h100.attention_fraction(2048, backward=True) == pytest.approx(465 / 989)
    assert fwd(round(2 ** 11.5)) == pytest.approx((484 + 518) / 2 / 989, rel=1e-4)
    assert (fwd(64), fwd(1 << 20)) == (pytest.approx(315 / 989), pytest.approx(539 / 989))
    # the same fraction of a lower peak (torchtitan's 500 W hosts)
    assert fwd(8192, gt) == fwd(8192) and gt.matmul_peak("bfloat16") < 989e12
    # no table: attention_eff whatever the length
    a100 = hardware.get("a100")
    assert a100.attention_fraction(512, True) == a100.attention_fraction(8192, False) == 0.55
    assert hardware.get("cpu").flash is False and h100.flash and a100.flash


def test_a3_vms_share_their_network_and_maxtexts_gpu_rows_ran_on_them():
    """MaxText's A3 rows run on A3 High VMs: inside a VM the H100 board's NVLink, across
    VMs the VM's 1,000 Gb/s shared by its 8 GPUs. A dp all-reduce with one rank per VM
    takes the NIC ratio longer than on 400 Gb/s-per-GPU nodes; one inside a VM the same."""
    from bench.published_runs import HELD_OUT, RUNS
    from engine.cost.ledger import Row
    from engine.cost.price import collective_seconds

    h100, a3 = hardware.get("h100"), hardware.get("h100-a3")
    assert a3.nccl.nic == pytest.approx(1000e9 / 64) and a3.nccl.nic < h100.nccl.nic
    assert (a3.peak_flops, a3.hbm, a3.nccl.nvlink) == (h100.peak_flops, h100.hbm,
                                                      h100.nccl.nvlink)
    grads = Row("reduce_grads", "bwd", "collective", "psum", "float32", (), 0.0, 3e9, 1,
                axes=("dp",), axis_size=16)
    across = (("dp", 16), ("fsdp", 8))
    slow, fast = (collective_seconds(grads, hw, across) for hw in (a3, h100))
    assert slow / fast == pytest.approx(h100.nccl.nic / a3.nccl.nic, rel=0.05)
    inside = dataclasses.replace(grads, axes=("fsdp",), axis_size=8)
    assert collective_seconds(inside, a3, across) == collective_seconds(inside, h100, across)
    maxtext_gpu = [r for r in RUNS + HELD_OUT
                   if r.framework == "maxtext" and "A3" in r.quote("hardware")]
    assert maxtext_gpu and {r.hardware for r in maxtext_gpu} == {"h100-a3"}


def test_the_pipelined_backward_unit_runs_no_forward():
    """Under every remat policy the pipelined backward unit applies the residuals its
    forward unit stashed: it has no "fwd" rows (with the stage's input stashed instead,
    its `jax.vjp` ran the stage's forward again: 3.75 forwards' worth with the backward
    on 4 layers under full), its transpose is twice the forward's matmul FLOPs, and it
    recomputes what the policy recomputes: under full each layer but the last, whose
    residuals the scan's vjp keeps, as without pp (2.75 forwards' worth in all on 4
    layers); under dots the matmuls it does not save; under none nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_pp import PP_CFG, TCFG

    from engine.cost.pipeline import BACKWARD, FORWARD, _once, unit_rows
    from layers import scopes

    def flops(rows, phase=None):
        return sum(r.flops * r.count for r in rows
                   if r.kind == "matmul" and phase in (None, r.phase))

    recomputed = {}
    for remat in ("full", "dots", "none"):
        cfg = dataclasses.replace(PP_CFG, remat=remat)
        rows = step_ledger(cfg, TCFG, Layout.parse("pp2xfsdp4"), ParallelConfig(microbatches=2))
        ticks = _once([r for r in rows if scopes.PP_TICK in r.pp])
        body = [r for r in ticks if not {scopes.PP_FIRST, scopes.PP_LAST} & set(r.pp)]
        fwd, bwd = (unit_rows(body, k, 0, 2) for k in (FORWARD, BACKWARD))
        assert flops(bwd, "fwd") == 0 < flops(fwd), remat
        assert flops(bwd, "bwd") == pytest.approx(2 * flops(fwd)), remat
        recomputed[remat] = flops(bwd, "recompute")
        if remat == "full":
            layers = PP_CFG.n_layers // 2
            assert recomputed[remat] == pytest.approx(flops(fwd) * (layers - 1) / layers)
    assert recomputed["full"] > recomputed["dots"] > recomputed["none"] == 0


def test_ring_factor():
    assert ring_factor("all-gather", 8) == (7 / 8, 7)
    assert ring_factor("all-reduce", 4) == (2 * 3 / 4, 6)
    assert ring_factor("collective-permute", 8) == (1.0, 7)


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
    flash2 = hardware.FLASH_ATTENTION_2
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
        assert hw.attention_rates == hardware.FLASH_ATTENTION_TRITON[r.hardware]["attention_rates"]
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
