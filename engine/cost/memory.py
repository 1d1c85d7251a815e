"""Per-device memory of one training step: an analytic prediction, and the compiler's.

`predict(cfg, tcfg, layout)` adds up bytes per device from the `Trainer`'s own specs and
the model's shapes (nothing is traced or compiled). It hands a pipelined step to
`pipelined` and an accumulated one to `accumulated`, each priced from `one_program`, which
adds the named parts of engine/cost/memory_items.py (attention, MLP, stream, weight grads,
residuals by remat policy, loss):

    arguments   params as stored (`Trainer.specs`: whole over fsdp under ZeRO-1/2, fsdp
                shards under ZeRO-3), the optimizer state (AdamW mu and nu, f32, as
                `Trainer.opt_specs`: fsdp shards under every level, plus two step
                counts) and this device's tokens [B, L+1] int32. Live for the whole step;
                the donated params and optimizer state are updated in place.
    grads       f32 as `Trainer.grad_specs`: whole over fsdp under ZeRO-1 (all-reduced,
                then sliced), fsdp shards under ZeRO-2/3. The backward scan writes each
                layer's grads into stacked [N, ...] buffers that live to the update.
    residuals   what the forward scan over layers saves for the backward, N layers.
    transient   what one layer's backward holds at its worst moment.

    peak = arguments + grads + residuals + transient       (phase "layer backward")

A second candidate is the loss phase, before the backward scan (block grads not yet
allocated): arguments + residuals + non-block grads + the loss's transient; the larger of
the two is the prediction (`phase`). Under prefetch the second candidate is "last layer"
instead (below). Under zero 3 over fsdp a third, "layer backward end": the layer's weight
grads whole until their reduce-scatter, beside its weights and the stream (weight-heavy
models peak there).

Shapes per device, read off the specs (engine/parallel/params.py): B, L_x = this device's shard of
the residual stream [B, L, D] under the activation table (B = batch / (dp·fsdp); L_x =
L / tp under a sequence-sharding tp_comm, else L); L = seq; H_tp, F_tp, V_tp = heads, MLP
hidden, vocab of one tp rank's shard of wq, wg, embed in the param table; G_tp = kv heads
a tp rank uses (its shard of wk, or 1 when the table replicates kv because tp > G); K
head dim; D d_model; N layers; W = one layer's weights on a tp rank (wq, wk, wv, wo, wg,
wu, wd as the param table shards them over tp; kv whole when tp > G), W_r the same with
kv sliced to the rank (G_tp);
c = bytes of the compute dtype; u = bytes of a compute-dtype operand of a mixed
(compute dtype x f32) dot: 4 on `cpu` (XLA:CPU upcasts it to f32), else c; under remat
none, whose saved operands are the layer scan's stacks, c where the host's XLA:CPU
keeps a bf16 stack as it is (jax 0.12; `scan_rows.cpu_upcasts_bf16_stacks`). Matmuls run
through `layers.common.einsum`, whose backward casts the f32 cotangent to the compute
dtype, so the backward's matmul operands are compute-dtype tensors; the layer's weights
are cast to the compute dtype and all-gathered as one flat buffer
(`collectives.gather_many`: 2-byte dtypes travel as uint32 pairs, u32[n, P/2], bitcast
back after), so the gathered weights live in the compute dtype (the flat buffer itself
is dead by the peak in every case read).
Each remat policy's, kernel's, cp's, pp's and accumulation's items, what each was read
off and how close the sum lands against `measure`: docs/memory_model.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from engine.config import TrainConfig
from engine.cost.memory_items import (
    F32,
    Unsupported,  # noqa: F401  (the error callers of `predict` catch)
    attention_items,
    dims,
    kernel_priced,
    last_layer_items,
    loss_items,
    mlp_items,
    saved_by_remat,
    shard_shape,
    stream_items,
    weight_grad_items,
)
from engine.parallel.layout import Layout
from layers.config import ModelConfig

MiB = 2 ** 20
@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """Bytes per device. grads: all grads as their specs; grads_live: those live at the
    peak (all in the layer backward; embed, unembed and norms in the loss phase).
    items: {"group: what": bytes} for every residual and transient term. phase: where
    the peak falls, "layer backward" or "loss"."""

    params: int
    opt_state: int
    tokens: int
    grads: int
    grads_live: int
    residuals: int
    transient: int
    items: dict
    phase: str

    @property
    def arguments(self) -> int:
        return self.params + self.opt_state + self.tokens

    @property
    def temp(self) -> int:
        return self.grads_live + self.residuals + self.transient

    @property
    def peak(self) -> int:
        return self.arguments + self.temp

    @property
    def states(self) -> int:
        """params + grads + optimizer state: what the ZeRO level decides."""
        return self.params + self.grads + self.opt_state


def _shard_bytes(sds, spec: P, sizes: dict) -> int:
    """Bytes of one device's shard of `sds` stored as `spec` on a mesh of `sizes`."""
    return math.prod(shard_shape(sds.shape, spec, sizes)) * jnp.dtype(sds.dtype).itemsize


def _tree_bytes(shapes, specs, sizes: dict, keep=lambda path: True) -> int:
    total = 0
    for path, n in jax.tree_util.tree_leaves_with_path(jax.tree.map(
            lambda s, p: _shard_bytes(s, p, sizes), shapes, specs,
            is_leaf=lambda x: isinstance(x, P))):
        total += n if keep(jax.tree_util.keystr(path)) else 0
    return int(total)


def predict(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str = "cpu",
            trainer=None, parallel=None) -> MemoryPrediction:
    """The step's predicted per-device peak (docs/memory_model.md). `platform`: "cpu" (XLA:CPU,
    what the item list was read from: compute-dtype operands of mixed dots are upcast to
    f32), anything else keeps them in the compute dtype and runs a flash kernel:
    "accelerator" a GPU's (FlashAttention), "tpu" Pallas's. `trainer`: a `Trainer` for (cfg,
    tcfg, layout) to take the specs from; by default the specs one would take
    (`engine.run.step.state_specs`).
    A pipelined step (`pipelined`) and an accumulated one (`accumulated`) are priced as
    one stage's or one microbatch's step (`one_program`) plus what their scan carries."""
    from engine.config import ParallelConfig

    par = trainer.parallel if trainer is not None else parallel or ParallelConfig()
    if layout.degree("pp") > 1:
        return pipelined(cfg, tcfg, layout, platform, par)
    if par.microbatches > 1:
        return accumulated(cfg, tcfg, layout, platform, par)
    return one_program(cfg, tcfg, layout, platform, par, trainer)


def accumulated(cfg, tcfg, layout, platform, par) -> MemoryPrediction:
    """Gradient accumulation without pp (`Trainer._accumulate`): the peak falls in one
    microbatch's step (the global batch / M, as a step of its own) plus the scan
    carry's grads accumulator (f32 as differentiated), held twice as the pipeline's
    carry is (`pipelined`); the tokens argument is the whole batch."""
    m = par.microbatches
    one = predict(cfg, dataclasses.replace(tcfg, batch=tcfg.batch // m), layout, platform,
                  parallel=dataclasses.replace(par, microbatches=1))
    item = {f"microbatches: grads accumulated over the {m} microbatches (f32), held "
            f"twice": 2 * one.grads}
    return dataclasses.replace(one, tokens=one.tokens * m,
                               residuals=one.residuals + 2 * one.grads,
                               items={**item, **one.items},
                               phase=f"{one.phase} (one microbatch of {m})")


def stage_problem(cfg, tcfg, layout, parallel):
    """(the model one device holds, as a step without pp: N/pp layers, the global batch
    / M, the layout without its pp axis; and the parallel config with one microbatch
    and no pipeline)."""
    pp = layout.degree("pp")
    return (dataclasses.replace(cfg, n_layers=cfg.n_layers // pp),
            dataclasses.replace(tcfg, batch=tcfg.batch // parallel.microbatches),
            Layout(tuple(a for a in layout.axes if a[0] != "pp")),
            dataclasses.replace(parallel, microbatches=1, pp_schedule="1f1b", pp_virtual=1))


def loss_residuals(cfg, tcfg, layout, par, x_micro: int, platform: str = "cpu") -> int:
    """What the vjp of the head and loss leaves for its backward, one microbatch (the
    pipeline keeps it in the last stage's head slots, `Plan.head_slots`; zb1 in
    every stash slot): the final norm's input and output, the logits' softmax
    [B, L, V_tp] f32, and the unembedding in the compute dtype as the head's matmul
    reads it: gathered over fsdp under ZeRO-3, else cast from the f32 param inside the
    head, except under ZeRO-2 over fsdp, where the step casts it before the units (a
    primal, not stashed, as when the compute dtype is f32; traced: pp2xtp2 holds a bf16
    [D, V_tp] a slot, pp2xfsdp2 under ZeRO-2 none). `platform` as `predict`'s (the
    attention kernel it resolves does not enter these items)."""
    from engine.parallel.params import param_shapes

    d = dims(cfg, tcfg, layout, platform, par,
             kernel_priced(cfg, tcfg, layout, platform, par), param_shapes(cfg))
    fsdp = layout.degree("fsdp") > 1
    gathered, cast_before = par.zero == 3 and fsdp, par.zero == 2 and fsdp
    unembed = d.D * d.Vtp * d.c if gathered or (d.c < F32 and not cast_before) else 0
    return 2 * x_micro + d.B * d.L * d.Vtp * F32 + unembed


def whole_head_grads(cfg, tcfg, layout, par) -> int:
    """Bytes a pipelined step's grads accumulator holds beyond the stage's grads: under
    ZeRO-2 the units sum the embedding's and unembedding's grads over the microbatches
    whole over fsdp (f32, as the model sees the params) and reduce-scatter them once
    after the ticks, where the stage's grads hold their fsdp shards (traced: the
    accumulator's leaves, tests/test_pp_spend.py). `cfg` and `layout` are the stage's
    (`stage_problem`); 0 under the other levels (their transposes run in the units)."""
    from engine.parallel.params import param_shapes
    from engine.run.step import state_specs

    fsdp = layout.degree("fsdp")
    if par.zero != 2 or fsdp <= 1:
        return 0
    t = state_specs(cfg, tcfg, layout, par)
    whole = _tree_bytes(param_shapes(cfg), t.specs, dict(layout.mesh_axes()),
                        keep=lambda path: path in ("['embed']", "['unembed']"))
    return whole - whole // fsdp


def pipelined(cfg, tcfg, layout, platform: str = "cpu", parallel=None) -> MemoryPrediction:
    """The pipelined step's per-device peak: the peak falls in a backward unit, the vjp of
    one stage on one microbatch, whose items are `one_program`'s for the stage as a step
    of its own (`stage_problem`: N/pp layers, one microbatch, its params, optimizer state
    and grads as a stage stores them), plus what the pipeline's scan carries:

        stash          stash_slots x what a unit leaves its backward (the most units
                       a stage holds at once, `Plan.stash_slot_PI`), held once
                       (XLA:CPU, pp4xfsdp2 tiny, M = 8: gpipe's peak exceeds 1f1b's by
                       its one more slot to 1 %): the unit's residuals (the stage's
                       `residuals` under the remat policy, which then leave the unit's
                       own items, but the weights as the unit uses them (cast, gathered:
                       made of the params alone, rebuilt by the backward unit, one
                       unit's held there); the peak grows 0.78 MiB a slot against 0.77
                       predicted under none), and apart from them the head's
                       `loss_residuals` in `Plan.head_slots` slots (zb1: in every
                       stash slot); an interleaved unit's chunk of
                       the stage's weights is sliced outside its vjp, a primal, not
                       stashed); under a cp ring the units' inputs B_m·L_x·D·a
        shift buffers  2 x (x_slots + ct_slots) x B_m·L_x·D·a   arrived activations and
                       cotangents, held the same way
        grads          the scan carry's grads accumulator, f32 as differentiated (one
                       more copy of the stage's grads beside the unit's); under ZeRO-2
                       its embedding and unembedding whole over fsdp (`whole_head_grads`)
        W slots        zb1 only: w_slots x what a unit's W reads of its B, per layer
                       B_m·L_x·a·(9D + 2(H_tp + G_tp)K + 4F_tp) under `full`: the
                       weight matmuls' inputs and output cotangents, the norms'
                       (B recomputes the inputs; tiny, 8 layers, pp2, M = 4: 23
                       D-sized tensors a layer, traced); under `dots` and `none` the
                       matmuls' inputs W reads stay in the stash slot, held to W's tick,
                       so less (2D + H_tp·K + F_tp): B_m·L_x·a·(7D + (H_tp + 2G_tp)K +
                       3F_tp); under the traced slot on pp2xfsdp2 / pp2xtp2 by 7 / 16 %
                       (none), 17 / 24 % (dots), 13 / 17 % (full)

    B_m = this device's rows of one microbatch; a = bytes of the activation dtype."""
    from engine.parallel import pipeline
    from engine.parallel.params import activation_spec, param_shapes

    the_plan = pipeline.step_plan(layout, parallel)
    scfg, stcfg, slayout, spar = stage_problem(cfg, tcfg, layout, parallel)
    stage = predict(scfg, stcfg, slayout, platform, parallel=spar)
    B, Lx, D = shard_shape((stcfg.batch, tcfg.seq, cfg.d_model),
                            activation_spec("residual", slayout, spar.tp_comm),
                            dict(slayout.mesh_axes()))
    x_micro = B * Lx * D * jnp.dtype(cfg.act_dtype).itemsize  # the activation dtype
    V = parallel.pp_virtual
    if V > 1:  # a unit runs one chunk: N/(pp·V) layers' residuals (every item is per layer)
        stage = dataclasses.replace(stage, residuals=stage.residuals // V, items={
            k: v // V if k.startswith("residual") else v for k, v in stage.items.items()})
    K = the_plan.stash_slots
    if pipeline.stash_residuals(layout, parallel):  # a unit's residuals per slot, not its input
        head = loss_residuals(scfg, stcfg, slayout, spar, x_micro, platform)
        # the weights as the unit uses them are made of the params alone: its backward
        # rebuilds them (`pipeline_stash.params_only`), one unit's at a time, not stashed
        weights = {k: v for k, v in stage.items.items() if k.startswith("residual: gathered")}
        stash = {f"pipeline: stash, {K} units' vjp residuals":
                 K * (stage.residuals - sum(weights.values())
                      + (head if the_plan.split else 0))}
        if weights:
            stash["pipeline: the backward unit's weights as it uses them, rebuilt "
                  "(compute dtype; f32 on cpu)"] = sum(weights.values())
        if not the_plan.split:
            H = the_plan.head_slots
            stash[f"pipeline: stash, the head's residuals, {H} slots"] = H * head
        stage = dataclasses.replace(stage, residuals=0, items={
            k: v for k, v in stage.items.items() if not k.startswith("residual")})
    else:
        stash = {f"pipeline: stash, {K} units' inputs": K * x_micro}
    if the_plan.split:  # zb1: what W reads of B, per unit (docstring)
        d = dims(scfg, stcfg, slayout, platform, spar,
                 kernel_priced(scfg, stcfg, slayout, platform, spar), param_shapes(scfg))
        per_layer = d.B * d.Lx * d.a * (
            9 * d.D + 2 * (d.Htp + d.Gtp) * d.K + 4 * d.Ftp if scfg.remat == "full"
            else 7 * d.D + (d.Htp + 2 * d.Gtp) * d.K + 3 * d.Ftp)
        stash[f"pipeline: W slots, {the_plan.w_slots} units' weight-gradient inputs"] = (
            the_plan.w_slots * scfg.n_layers * per_layer)
    items = {**stash,
             f"pipeline: shift buffers, {the_plan.x_slots} + {the_plan.ct_slots} "
             f"microbatches, held twice": 2 * (the_plan.x_slots + the_plan.ct_slots) * x_micro,
             "pipeline: grads accumulated over the microbatches (f32)": stage.grads}
    if head := whole_head_grads(scfg, stcfg, slayout, spar):
        items["pipeline: embedding and unembedding grads whole over fsdp until the "
              "step's reduce-scatter (f32)"] = head
    extra = sum(items.values())
    return dataclasses.replace(stage, residuals=stage.residuals + extra,
                               items={**items, **stage.items},
                               phase=f"{stage.phase} (one microbatch on one stage)")


def one_program(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str, par,
                trainer=None) -> MemoryPrediction:
    """The peak of a step without pp or accumulation: the arguments and grads from the
    `Trainer`'s specs, the named parts above for one layer, and the phase where they
    add up to the most. Without a `trainer`, once per set of arguments (a pipelined
    step's stage is the same program under every schedule, and the planner asks for
    each)."""
    if trainer is None:
        return _one_program_once(cfg, tcfg, layout, platform, par)
    return _one_program(cfg, tcfg, layout, platform, par, trainer)


@functools.lru_cache(maxsize=4096)
def _one_program_once(cfg, tcfg, layout, platform, par) -> MemoryPrediction:
    return _one_program(cfg, tcfg, layout, platform, par, None)


def _one_program(cfg, tcfg, layout, platform, par, trainer) -> MemoryPrediction:
    from engine.parallel.params import activation_spec, param_shapes
    from engine.run import optim

    kernel = kernel_priced(cfg, tcfg, layout, platform, par)
    if trainer is None:
        from engine.run.step import state_specs

        t = state_specs(cfg, tcfg, layout, par)  # the specs a Trainer would take
    else:
        t = trainer
    sizes = dict(layout.mesh_axes())
    shapes = param_shapes(cfg)
    params = _tree_bytes(shapes, t.specs, sizes)
    opt_state = _tree_bytes(optim.state_shapes(tcfg, cfg), t.opt_specs, sizes)
    grads = _tree_bytes(shapes, t.grad_specs, sizes)
    grads_not_blocks = _tree_bytes(shapes, t.grad_specs, sizes,
                                   keep=lambda path: not path.startswith("['blocks']"))
    grad_embed = _tree_bytes(shapes, t.grad_specs, sizes,
                             keep=lambda path: path.startswith("['embed']"))
    # this device's tokens [B, L+1] int32, as the activation table shards them
    tokens = _shard_bytes(jax.ShapeDtypeStruct((tcfg.batch, tcfg.seq + 1), jnp.int32),
                          activation_spec("tokens", layout), sizes)
    d = dims(cfg, tcfg, layout, platform, par, kernel, shapes)

    attn, stream = attention_items(d), stream_items(d)
    weights = {"layer weights but wd (compute dtype)": (d.W_rank - d.D * d.Ftp) * d.c}
    embed = {"embed grad, whole over fsdp (replaces its shard)":
                 d.Vtp * d.D * F32 - grad_embed}
    trans_full = {**attn, **mlp_items(d), **stream, **weights, **embed}
    saves_weights = par.prefetch and cfg.remat != "full" and d.N < 2
    res, trans = saved_by_remat(d, cfg, par, trans_full, saves_weights)
    layer_weights = {"layer weights (compute dtype)": d.W_rank * d.c}
    gathers = par.zero == 3 and layout.degree("fsdp") > 1  # ZeRO-3 gathers weights
    if platform == "tpu" and gathers:
        # XLA:TPU casts every layer's stored weight shards to the compute dtype once,
        # before the layer loop, and keeps the copy through both loops (read off its
        # buffer assignment: bench/tpu_compile.py)
        res["every layer's weight shards cast to the compute dtype, hoisted"] = (
            d.N * d.W // layout.degree("fsdp") * d.c)
    if par.prefetch and not saves_weights:  # this layer's whole weights and the next's
        carried = {"this layer's and the next layer's weights, carried (compute dtype)":
                       2 * d.W * d.c}
        trans = {**{k: v for k, v in trans.items() if not k.startswith("layer weights")},
                 **carried}
        layer_weights = carried
    grads_end = ({**stream, **embed, **layer_weights, **weight_grad_items(d, par)}
                 if gathers else {})
    if saves_weights:
        # the scanned layers' stacked grads are already allocated
        n = d.N - 1
        last = last_layer_items(d, attn, grad_embed)
        grads_loss = grads_not_blocks + (grads - grads_not_blocks) * n // d.N
        phase_loss = "last layer"
    else:
        last, grads_loss, phase_loss = loss_items(d), grads_not_blocks, "loss"

    residuals = sum(res.values())
    layer_peak = grads + residuals + sum(trans.values())
    loss_peak = grads_loss + residuals + sum(last.values())
    phase, transient, live = (("layer backward", trans, grads) if layer_peak >= loss_peak
                              else (phase_loss, last, grads_loss))
    if grads_end and grads + residuals + sum(grads_end.values()) > max(layer_peak, loss_peak):
        phase, transient, live = "layer backward end", grads_end, grads
    if kernel in ("reference", "ring") and cfg.remat == "full":
        # long sequences: the softmax's backward, the MLP's done (docs/memory_model.md)
        attn_bwd = {**{k: v for k, v in trans.items() if not k.startswith("mlp ")},
                    "attention dp, ds of the largest tile (f32)" if kernel == "reference"
                    else "attention s of the diagonal block (f32)":
                        (2 if kernel == "reference" else 1) * d.B * d.Htp * d.largest * F32}
        if grads + residuals + sum(attn_bwd.values()) > grads + residuals + sum(
                transient.values()) and live == grads:
            phase, transient = "attention backward", attn_bwd
    items = {**{f"residual: {k}": v for k, v in res.items()},
             **{f"transient: {k}": v for k, v in transient.items()}}
    return MemoryPrediction(params, opt_state, tokens, grads, live, residuals,
                            sum(transient.values()), items, phase)


# -- the compiler's figures ---------------------------------------------------------------
def compile_step(trainer, compiler_options: dict | None = None):
    """`trainer.train_step` compiled for its (concrete) mesh from shapes only, no run
    (`compiler_options={"xla_backend_optimization_level": 0}` halves compile time; the
    optimized HLO and its buffer assignment are the same)."""
    from jax.sharding import NamedSharding

    from engine.cost.ledger import _shape_dtype_specs

    def place(sds, spec):
        return jax.ShapeDtypeStruct(sds.shape, sds.dtype,
                                    sharding=NamedSharding(trainer.mesh, spec))

    params, opt_state, tokens = _shape_dtype_specs(trainer.cfg, trainer.tcfg)
    args = (jax.tree.map(place, params, trainer.specs),
            jax.tree.map(place, opt_state, trainer.opt_specs),
            place(tokens, trainer.batch_spec))
    return trainer.train_step.lower(*args).compile(compiler_options=compiler_options)


def measure(compiled) -> dict:
    """The compiled step's per-device bytes from `memory_analysis()`: argument, output,
    alias, temp and peak (docs/memory_model.md)."""
    m = compiled.memory_analysis()
    out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
    out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
    return out


def error(pred: MemoryPrediction, measured: dict) -> float:
    """(predicted - measured) / measured peak."""
    return (pred.peak - measured["peak"]) / measured["peak"]
