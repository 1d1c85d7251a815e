"""Accelerator pricing pieces: fusion groups, the flash-kernel rows and their published
speeds, ring factors, the A3 VMs' network, the pipelined backward unit's rows."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import attention_rates, hardware
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


def test_a_slice_update_is_a_loop_fusions_root_written_in_place():
    """`g.at[rows].set(g[rows] + d)` (an interleaved unit adding its chunk's grads into
    its rows of the stage's stack: engine/parallel/pipeline.py `add_own`): on an
    accelerator one in-place fusion reads the slice of g and d and writes the slice
    (engine/cost/fusion.py's module doc cites XLA:GPU's emitter); the sum is not
    written apart, nor the stack read or written whole. Nothing consumes the update
    inside a fusion: a tanh of the updated stack reads it whole in a fusion of its own."""
    n, k, shape = 8, 2, (64, 32)
    rows_b = k * 64 * 32 * 4

    def f(g, d):
        return jax.lax.dynamic_update_slice_in_dim(
            g, jax.lax.dynamic_slice_in_dim(g, 2, k) + d, 2, axis=0)

    rows = _rows(f, (n, *shape), (k, *shape))
    compute = [r for r in rows if r.fused_bytes >= 0]
    assert len({r.fusion for r in compute}) == len({r.lib_fusion for r in compute}) == 1
    for model in ("fused_bytes", "lib_bytes"):
        assert sum(getattr(r, model) for r in compute) == 3 * rows_b
    # the XLA:CPU model: the slice, the sum and the update each read and written
    assert sum(r.bytes for r in compute) >= 6 * rows_b

    def h(g, u):
        return jnp.tanh(jax.lax.dynamic_update_slice_in_dim(g, 2.0 * u, 2, axis=0))

    rows = _rows(h, (n, *shape), (k, *shape))
    update = next(r for r in rows if r.primitive == "dynamic_update_slice")
    mul, tanh = (next(r for r in rows if r.primitive == p) for p in ("mul", "tanh"))
    assert mul.fusion == update.fusion != tanh.fusion
    assert mul.fused_bytes + update.fused_bytes == 2 * rows_b
    assert tanh.fused_bytes == 2 * n * 64 * 32 * 4


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


def test_hopper_matmuls_run_at_the_clock_a_saturated_board_sustains():
    """A Hopper profile's matmuls run at its burst-measured rate (peak x matmul_eff) times
    the sustained / burst ratio measured on 8 busy Hopper GPUs (MSMF 698.6 over MAMF
    823.9 TFLOP/s); the A100 has no such measurement and keeps its rate, and a matmul's
    attention kernel neighbour keeps its published speed."""
    (row,) = [r for r in _rows(lambda a, b: a @ b, (8192, 8192), (8192, 8192))
              if r.kind == "matmul"]
    assert hardware.HOPPER_SUSTAINED == pytest.approx(698.6 / 823.9)
    for name in ("h100", "h100-gt", "h100-a3"):
        hw = hardware.get(name)
        burst = hw.matmul_peak(row.dtype) * hw.matmul_eff
        seconds, bound = compute_seconds(row, hw, 1)
        # a 8192^3 dot is compute-bound: its time is its FLOPs at the sustained rate
        assert bound == "compute"
        assert seconds == pytest.approx(row.flops / (burst * 698.6 / 823.9))
        assert hw.mfu_peak_of("bfloat16") == 989e12  # the MFU denominator stays the spec
    a100 = hardware.get("a100")
    assert compute_seconds(row, a100, 1)[0] == pytest.approx(
        row.flops / (a100.matmul_peak(row.dtype) * a100.matmul_eff))
    assert hardware.get("h100").attention_fraction(2048, False) == pytest.approx(484 / 989)


def test_flash_attention_2_causal_backward_completes_its_published_forward_backward():
    """FlashAttention-2 on H100 (torchtitan's kernel): forward with causal mask as the
    FlashAttention-3 paper measured it, backward what the causal forward + backward of
    the flash-attention repository's H100 figure leaves: at every published length one
    forward and one backward (2.5 forwards' FLOPs) take the figure's time, and the
    causal backward is slower than the non-causal one (214 ... 318 TFLOP/s) up to 8k."""
    gt = dataclasses.replace(hardware.get("h100-gt"),
                             **attention_rates.FLASH_ATTENTION_2["h100-gt"])
    peak = attention_rates.H100_SXM_BF16
    non_causal = {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318}
    for seq, fwd_bwd in ((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308),
                         (16384, 328)):
        f = gt.attention_fraction(seq, backward=False) * peak / 1e12
        b = gt.attention_fraction(seq, backward=True) * peak / 1e12
        assert 1 / f + 2.5 / b == pytest.approx(3.5 / fwd_bwd)
        assert f == pytest.approx(dict(attention_rates.H100_FA2_FWD)[seq])
        if seq in non_causal:
            assert b < non_causal[seq]


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
