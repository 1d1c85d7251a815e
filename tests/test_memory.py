"""engine/cost/memory.py against the compiler: the predicted per-device peak of the
step is within 15% of `memory_analysis()`'s, and the prediction orders ZeRO levels and
tp_comm as the compiler does.

Compile only (no run), tiny model in bf16 with remat full on fsdp4xtp2, reference and
chunked attention, LLVM at -O0 (the optimized HLO and its buffer assignment do not
depend on it; half the compile time). The model's items were read off XLA:CPU's buffer
assignment: they add up to within 0.5% of the tensors live at its peak, and the
prediction is 5-7% under `memory_analysis()`'s peak for these six (the heap's packing,
not a tensor). 15% is the goal; what the tolerance alone
would not catch (zero 1's whole grads move tiny's peak by +21%, sequence parallelism by
-13%, chunked attention by -11%) the ordering test does: the predicted peaks must rank the six
cases as the compiler does wherever its peaks are more than 5% apart.
"""
import dataclasses
import functools

import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import memory, memory_items
from engine.parallel.layout import Layout
from engine.run.step import Trainer

CFG = model_config("tiny", dtype="bf16", remat="full", attention="reference")
TCFG = TrainConfig(batch=16, seq=64)
LAYOUT = Layout.parse("fsdp4xtp2")
CASES = {"zero1": (dict(), dict(zero=1)), "zero2": (dict(), dict(zero=2)),
         "zero3": (dict(), dict(zero=3)),
         "zero3 sequence": (dict(), dict(zero=3, tp_comm="sequence")),
         # the training CLI's default kernel below 1024 tokens (attention="auto")
         "zero3 chunked": (dict(attention="chunked"), dict(zero=3)),
         "zero3 sequence chunked": (dict(attention="chunked"), dict(zero=3, tp_comm="sequence")),
         # torchtitan's per-op selective checkpointing (layers/block.py)
         "zero3 alternate": (dict(remat="alternate"), dict(zero=3))}
FAST = {"xla_backend_optimization_level": 0}
TOLERANCE = 0.15
RESOLUTION = 0.05  # peaks closer than this are ties for the ordering test


@functools.lru_cache(maxsize=None)
def case(name: str):
    """(prediction, measured) for one case."""
    model_kw, parallel_kw = CASES[name]
    cfg = dataclasses.replace(CFG, **model_kw)
    trainer = Trainer(cfg, TCFG, LAYOUT, LAYOUT.mesh(), ParallelConfig(**parallel_kw))
    measured = memory.measure(memory.compile_step(trainer, FAST))
    return memory.predict(cfg, TCFG, LAYOUT, "cpu", trainer=trainer), measured


@pytest.mark.parametrize("name", list(CASES))
def test_peak_within_tolerance(name):
    pred, measured = case(name)
    # the arguments are the specs' shard sizes: exact
    assert pred.arguments == measured["argument"]
    assert abs(memory.error(pred, measured)) < TOLERANCE, (
        f"{name}: predicted {pred.peak / memory.MiB:.2f} MiB "
        f"({pred.phase}: {pred.items}), measured {measured}")


def test_orders_configs_as_measured():
    preds = {name: case(name)[0] for name in CASES}
    meas = {name: case(name)[1] for name in CASES}
    # what the ZeRO level decides (params + grads + optimizer state): 1 > 2 > 3
    assert preds["zero1"].states > preds["zero2"].states > preds["zero3"].states
    # and the peaks, in the compiler's order wherever its peaks differ by more than
    # RESOLUTION (jax 0.12's XLA:CPU puts "zero3 chunked" 1.5% under "zero3 sequence",
    # jax 0.10's 2.0% over: closer than the items' own accuracy)
    for a in CASES:
        for b in CASES:
            if meas[a]["peak"] > (1 + RESOLUTION) * meas[b]["peak"]:
                assert preds[a].peak > preds[b].peak, (a, b, preds[a].peak, preds[b].peak)
    assert meas["zero1"]["peak"] > meas["zero2"]["peak"] > meas["zero3"]["peak"] \
        > meas["zero3 sequence"]["peak"]
    # chunked attention (flash backward: no softmax grad, no f32 upcasts) below reference
    for ref in ("zero3", "zero3 sequence"):
        assert meas[ref]["peak"] > meas[f"{ref} chunked"]["peak"]
        assert preds[ref].peak > preds[f"{ref} chunked"].peak


def test_refuses_what_it_does_not_model():
    with pytest.raises(memory.Unsupported, match="blocked"):
        memory.predict(dataclasses.replace(CFG, attention="blocked"), TCFG, LAYOUT)
    with pytest.raises(memory.Unsupported, match="pallas"):
        memory.predict(dataclasses.replace(CFG, attention="pallas"), TCFG, LAYOUT)
    # auto is blocked from 1024 tokens on
    with pytest.raises(memory.Unsupported, match="blocked"):
        memory.predict(dataclasses.replace(CFG, attention="auto"),
                       TrainConfig(batch=16, seq=1024), LAYOUT)


@pytest.mark.slow
def test_microbatches_peak_falls_as_the_compiler_s():
    """Gradient accumulation (no pp): one microbatch's step plus the grads accumulator;
    within the tolerance of the compiler's peak at M = 2 and 4, and falling with M as
    it does."""
    peaks = []
    for m in (1, 2, 4):
        par = ParallelConfig(microbatches=m)
        trainer = Trainer(CFG, TCFG, LAYOUT, LAYOUT.mesh(), par)
        measured = memory.measure(memory.compile_step(trainer, FAST))
        pred = memory.predict(CFG, TCFG, LAYOUT, "cpu", trainer=trainer)
        assert pred.arguments == measured["argument"]
        assert abs(memory.error(pred, measured)) < TOLERANCE, (m, pred.peak, measured)
        peaks.append((pred.peak, measured["peak"]))
    assert peaks[0][0] > peaks[1][0] > peaks[2][0]
    assert peaks[0][1] > peaks[1][1] > peaks[2][1]


@pytest.mark.parametrize("remat", ["full", "none"])
def test_weight_heavy_peak_holds_the_layer_grads_before_their_reduce_scatter(remat):
    """Where one layer's weights outweigh its activations (D = 1024, F = 4096, 64 tokens
    per device on fsdp8), the peak is the layer's weight grads, whole until the
    reduce-scatter ends its backward (in bf16 and XLA:CPU's f32 copy for the collective):
    without that item the prediction was 0.62x of the compiler's peak under remat full.
    Under none every layer's gathered weights are saved, as XLA:CPU keeps them: in f32
    for the backward's dots (0.75x with them in bf16)."""
    cfg = model_config("tiny", dtype="bf16", remat=remat, attention="chunked", d_model=1024,
                       mlp_dim=4096, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=128)
    tcfg, layout = TrainConfig(batch=8, seq=64), Layout.parse("fsdp8")
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), ParallelConfig())
    measured = memory.measure(memory.compile_step(trainer, FAST))
    pred = memory.predict(cfg, tcfg, layout, "cpu", trainer=trainer)
    grads = [v for k, v in pred.items.items() if "weight grads" in k]
    assert grads and (remat != "full" or grads[0] > pred.peak / 3)  # full: its largest term
    assert abs(memory.error(pred, measured)) < TOLERANCE, (pred.peak, pred.items, measured)


def test_remat_none_prices_its_saved_dot_operands_as_the_host_compiler_stacks_them():
    """Under remat none the forward saves q, k, v, o, the chunked kernel's E, the norm
    outputs and h in the compute dtype, and jax 0.10's XLA:CPU converts each saved
    [N, ...] stack to f32 for the backward's dots (a convert hoisted out of the loop):
    priced in the compute dtype there these put small fsdp8 (bf16, L = 256) at 0.83x of
    the compiler's peak. jax 0.12's keeps the stacks in bf16
    (`scan_rows.cpu_upcasts_bf16_stacks`), and priced in f32 there they come out 1.48x."""
    cfg = model_config("small", dtype="bf16", remat="none", attention="chunked")
    tcfg, layout = TrainConfig(batch=16, seq=256), Layout.parse("fsdp8")
    trainer = Trainer(cfg, tcfg, layout, layout.mesh(), ParallelConfig())
    measured = memory.measure(memory.compile_step(trainer, FAST))
    pred = memory.predict(cfg, tcfg, layout, "cpu", trainer=trainer)
    assert abs(memory.error(pred, measured)) < TOLERANCE, (pred.peak, pred.items, measured)


@pytest.mark.parametrize("layout", ["single", "tp8"])
def test_peak_within_tolerance_from_4096_rows_a_device(layout):
    """From `memory_items.NORM_BROADCAST_ROWS` rows of the residual stream a device, XLA:CPU
    keeps each norm's rsqrt broadcast over D as an f32 buffer in the layer backward, one
    per norm at the peak. `small` at L = 256, batch 16, has 4096 rows on a device with no
    batch axis: counting two per norm put tp8's peak 21% over the compiler's (30% on jax
    0.12), one per norm 8.7% (16.8% on jax 0.12, whose XLA:CPU keeps 52.8 MiB of
    temporaries there against jax 0.10's 57.3, not read off yet): hence 20%, not 15%."""
    cfg = model_config("small", dtype="bf16", remat="full", attention="chunked")
    tcfg = TrainConfig(batch=16, seq=256)
    lay = Layout.parse(layout)
    trainer = Trainer(cfg, tcfg, lay, lay.mesh(), ParallelConfig())
    assert tcfg.batch * tcfg.seq >= memory_items.NORM_BROADCAST_ROWS
    measured = memory.measure(memory.compile_step(trainer, FAST))
    pred = memory.predict(cfg, tcfg, lay, "cpu", trainer=trainer)
    assert pred.arguments == measured["argument"]
    assert abs(memory.error(pred, measured)) < 0.20, (
        f"{layout}: predicted {pred.peak / memory.MiB:.2f} MiB ({pred.items}), "
        f"measured {measured}")


def test_sequence_parallel_keeps_its_norm_outputs_sharded_under_remat_none(monkeypatch):
    """Under remat none the sequence-parallel columns keep their inputs (the norm
    outputs) sharded over tp and gather them again in the backward
    (`collectives.ring.SequenceComm`): tiny on fsdp2xtp4, L = 256, the compiler's peak
    is under 0.95 of the same strategy gathering once and keeping the gathered inputs
    (`TpComm.once`; measured 0.69 on jax 0.10, 0.92 on 0.12), and the prediction within
    the tolerance of it."""
    import collectives

    cfg = model_config("tiny", dtype="bf16", remat="none", attention="chunked")
    tcfg, layout = TrainConfig(batch=16, seq=256), Layout.parse("fsdp2xtp4")
    par = ParallelConfig(zero=3, tp_comm="sequence")

    def compiled():
        trainer = Trainer(cfg, tcfg, layout, layout.mesh(), par)
        return trainer, memory.measure(memory.compile_step(trainer, FAST))

    trainer, measured = compiled()
    pred = memory.predict(cfg, tcfg, layout, "cpu", trainer=trainer)
    assert abs(memory.error(pred, measured)) < TOLERANCE, (pred.peak, measured)
    monkeypatch.setitem(collectives.TP_COMMS, "sequence",
                        collectives.TP_COMMS["sequence"].once())
    _, once = compiled()
    assert measured["peak"] < 0.95 * once["peak"], (measured, once)
