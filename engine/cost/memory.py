"""Per-device memory of one training step: an analytic prediction, and the compiler's.

`predict(cfg, tcfg, layout)` adds up bytes per device from the `Trainer`'s own specs and
the model's shapes (nothing is traced or compiled):

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
the two is the prediction (`phase`).

Shapes per device: B = batch / (dp·fsdp); L = seq; L_x = L / tp under tp_comm sequence
and ring (the residual stream between blocks is sharded along L), else L; H_tp, F_tp,
V_tp = heads, MLP hidden, vocab / tp; G_tp = kv heads a tp rank uses (G / tp, or 1 when
tp > G); K head dim; D d_model; N layers; W = one layer's weights on a tp rank (wq, wk,
wv, wo, wg, wu, wd; kv whole when tp > G); c = bytes of the compute dtype; w = bytes of a
live gathered weight or saved compute-dtype activation: c, except on `cpu` with bf16,
where it is 4 (the CPU runtime runs bf16 all-gathers in f32, the audit's
`cpu_bf16_collectives_in_f32`, and XLA:CPU upcasts the bf16 operands of the backward's
dots, converting whole saved stacks to f32 ahead of the backward loop).

remat `full` (the scan saves only its carry):
    residuals  N · B·L_x·D·4                 the carry x before each layer, f32
               prefetch: the carry also holds the next layer's gathered weights and the
               scan runs over layers 1..N-1 (the last layer follows it, not rematted):
               (N-1) · (B·L_x·D·4 + W·w)
    transient  the layer recomputed plus its backward, live together where XLA
               schedules the MLP's backward to meet the start of the attention's
               backward (the weight-grad dots are deferred). Read off XLA:CPU's buffer
               assignment at the peak for tiny, small and medium; every item is a tensor
               of the program:
      MLP        7 · B·L·F_tp·4    gate g and up u (recomputed), sigmoid(g), dh = dy·wd^T,
                                   dg, du, and a relayout of dg for its weight-grad dot
                 + B·L·F_tp·c      h = silu(g)·u in the compute dtype (for wd's grad)
      attention  2 · B·H_tp·L·L·4  softmax p (recomputed) and its grad dp (reference
                                   kernel)
                 + B·L·(2·H_tp + 2·G_tp)·K·4   q, k, v (recomputed), do = dy·wo^T
      stream     5 · B·L_x·D·4     the layer's input x (sliced from the saved stack),
                                   x + attn, both norm outputs, the incoming grad dy
                 + 3 · B·L·D·4     dy relaid out (sequence / ring: gathered along L) for
                                   the weight-grad dots; the two dx partial sums before
                                   their tp all-reduce / reduce-scatter
      weights    W·w               this layer's gathered weights
remat `dots` (also saves the outputs of matmuls without batch dims; of those the
    backward uses q, k, v, g, u and the out projection, which it needs to recompute
    x + attn for the MLP's norm; down's output is saveable but unused):
    residuals  N · (B·L_x·D·4 + B·L·(H_tp + 2·G_tp)·K·4 + B·L·D·4 + 2·B·L·F_tp·4)
               (+ prefetch's weights as above)
    transient  `full`'s, less g, u, q, k, v (read from the saved stacks, not recomputed)
remat `none` (everything saved, nothing recomputed), per layer, N times:
    residuals  2·B·H_tp·L·L (p in f32 and, at w bytes, in the compute dtype)
               + 5·B·L·F_tp·4 (g, u, sigmoid, silu, h) + B·L·F_tp·w (h cast)
               + 6·B·L_x·D·4 (x, normalized x, norm output, for both norms)
               + 5·B·L·D·w (the norm outputs cast once per column-parallel matmul: q, k,
               v, gate, up) + B·L·(2·H_tp + 2·G_tp)·K·w (q, o, k, v) + W·w (the
               gathered weights)
    transient  the backward items of `full` (dh, dg, du, relayout, dp, do, dy, its
               relayout, the dx partials, the weights) + this layer's copies of the saved
               p and of four stream tensors (B·H_tp·L·L·4 + 4·B·L_x·D·4)
loss phase: 2·B·L·V_tp·4 (dlogits and a relayout) + D·V_tp·(w + 4) (the gathered
    unembed and its f32 grad) + V_tp·D·4 (the embedding's grad, whole over fsdp before
    its reduce-scatter).

`none`, `dots` and the loss phase were each checked on fewer shapes than `full` (see
tests/test_memory.py and bench/switches.py). Only the `reference` attention kernel is
modelled: `blocked` / `pallas` (and `auto` from 1024 tokens) raise `Unsupported`.

`measure(compiled)` reads the compiled step's `memory_analysis()` and defines the
measured peak as

    peak = argument_size_in_bytes + temp_size_in_bytes
           + output_size_in_bytes - alias_size_in_bytes

every argument (params, optimizer state, tokens, live throughout), plus XLA's one
preallocated temp buffer (its size is the heap simulation's maximum over the step of
all live intermediates, while-loop carries included, as laid out: packing adds about
1 MiB at medium), plus the outputs that alias no argument (loss, grad norm and the
output tuple's index table, a few hundred bytes; the new params and optimizer state
alias the donated ones). On the CPU backend, jax 0.10's `peak_memory_in_bytes` is
arguments + outputs - aliases without the temp buffer, so it is not the step's peak and
is not used.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from engine.config import TrainConfig
from engine.layout import Layout
from layers.attention import resolve_attention
from layers.config import ModelConfig

MiB = 2 ** 20
F32 = 4


class Unsupported(ValueError):
    """A configuration the memory model does not cover (the message says which part)."""


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
    n = math.prod(sds.shape)
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            n //= sizes.get(axis, 1)
    return n * jnp.dtype(sds.dtype).itemsize


def _tree_bytes(shapes, specs, sizes: dict, keep=lambda path: True) -> int:
    total = 0
    for path, n in jax.tree_util.tree_leaves_with_path(jax.tree.map(
            lambda s, p: _shard_bytes(s, p, sizes), shapes, specs,
            is_leaf=lambda x: isinstance(x, P))):
        total += n if keep(jax.tree_util.keystr(path)) else 0
    return int(total)


def predict(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str = "cpu",
            trainer=None) -> MemoryPrediction:
    """The step's predicted per-device peak (module doc). `platform`: "cpu" (XLA:CPU,
    what the item list was read from: bf16 weights and saved activations live as f32),
    anything else keeps them in the compute dtype. `trainer`: a `Trainer` for (cfg, tcfg,
    layout) to take the specs from; by default one on the layout's abstract mesh."""
    from engine.params import param_shapes

    kernel = resolve_attention(cfg.attention, tcfg.seq)
    if kernel != "reference":
        raise Unsupported(f"no memory model for the {kernel!r} attention kernel (only "
                          f"'reference' was checked against the compiler)")
    if cfg.remat not in ("full", "dots", "none"):
        raise Unsupported(f"no memory model for remat={cfg.remat!r}")
    if trainer is None:
        from engine.step import Trainer

        trainer = Trainer(cfg, tcfg, layout, layout.abstract_mesh())
    t = trainer
    sizes = dict(layout.mesh_axes())
    shapes = param_shapes(cfg)
    params = _tree_bytes(shapes, t.specs, sizes)
    opt_state = _tree_bytes(jax.eval_shape(t.tx.init, shapes), t.opt_specs, sizes)
    grads = _tree_bytes(shapes, t.grad_specs, sizes)
    grads_not_blocks = _tree_bytes(shapes, t.grad_specs, sizes,
                                   keep=lambda path: not path.startswith("['blocks']"))
    B = tcfg.batch // t.axes.batch_size
    tokens = B * (tcfg.seq + 1) * 4

    tp = layout.degree("tp")
    L, D, K, N = tcfg.seq, cfg.d_model, cfg.head_dim, cfg.n_layers
    Lx = L // tp if cfg.tp_comm != "allreduce" else L
    Htp, Ftp, Vtp = cfg.n_heads // tp, cfg.mlp_dim // tp, cfg.vocab // tp
    kv_split = tp <= cfg.n_kv_heads
    Gtp = cfg.n_kv_heads // tp if kv_split else 1
    W = 2 * D * Htp * K + 2 * D * (Gtp if kv_split else cfg.n_kv_heads) * K + 3 * D * Ftp
    c = jnp.dtype(cfg.compute_dtype).itemsize
    w = F32 if platform == "cpu" else c

    x_stream, x_full = B * Lx * D * F32, B * L * D * F32  # [B, L_x, D], [B, L, D] f32
    mlp = B * L * Ftp * F32                                 # [B, L, F_tp] f32
    scores = B * Htp * L * L * F32                          # [B, H_tp, L, L] f32
    q_heads, kv_heads = B * L * Htp * K * F32, B * L * Gtp * K * F32

    # the layer as remat `full` recomputes it, and its backward (module doc)
    fwd = {"mlp g, u, sigmoid(g)": 3 * mlp, "mlp h (compute dtype)": B * L * Ftp * c,
           "attention p": scores, "attention q, k, v": q_heads + 2 * kv_heads,
           "stream x, x + attn, 2 norm outputs": 4 * x_stream}
    bwd = {"mlp dh, dg, du, relayout": 4 * mlp, "attention dp": scores,
           "attention do": q_heads, "stream dy": x_stream,
           "stream dy relayout, 2 dx partials": 3 * x_full, "layer weights": W * w}
    prefetched = {f"prefetched weights ({N - 1} layers)": (N - 1) * W * w} if cfg.prefetch else {}
    if cfg.remat == "full":
        n = N - 1 if cfg.prefetch else N
        res = {f"scan carry x ({n} layers)": n * x_stream, **prefetched}
        trans = {**fwd, **bwd}
    elif cfg.remat == "dots":
        per = x_stream + q_heads + 2 * kv_heads + x_full + 2 * mlp
        res = {f"carry x, q, k, v, out projection, g, u ({N} layers)": N * per, **prefetched}
        trans = {**fwd, **bwd, "mlp g, u, sigmoid(g)": mlp, "attention q, k, v": 0}
    else:  # none
        per = {"p (f32 and compute dtype)": scores + scores // F32 * w,
               "mlp g, u, sigmoid, silu, h (f32) and h cast": 5 * mlp + mlp // F32 * w,
               "stream x, normalized, norm output (both norms)": 6 * x_stream,
               "norm outputs cast for q, k, v, gate, up": 5 * x_full // F32 * w,
               "q, o, k, v (compute dtype)": (2 * Htp + 2 * Gtp) * B * L * K * w,
               "gathered weights": W * w}
        res = {f"{k} ({N} layers)": N * v for k, v in per.items()}
        trans = {**bwd, "copies of this layer's saved p and 4 stream tensors":
                 scores + 4 * x_stream}
    loss = {"dlogits and a relayout": 2 * B * L * Vtp * F32,
            "unembed gathered and its f32 grad": D * Vtp * (w + F32),
            "embed grad, whole over fsdp": Vtp * D * F32}

    residuals = sum(res.values())
    layer_peak = grads + residuals + sum(trans.values())
    loss_peak = grads_not_blocks + residuals + sum(loss.values())
    phase, transient, live = (("layer backward", trans, grads) if layer_peak >= loss_peak
                              else ("loss", loss, grads_not_blocks))
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

    params, opt_state, tokens = _shape_dtype_specs(trainer.cfg, trainer.tcfg, trainer)
    args = (jax.tree.map(place, params, trainer.specs),
            jax.tree.map(place, opt_state, trainer.opt_specs),
            place(tokens, trainer.batch_spec))
    return trainer.train_step.lower(*args).compile(compiler_options=compiler_options)


def measure(compiled) -> dict:
    """The compiled step's per-device bytes from `memory_analysis()`: argument, output,
    alias, temp and peak (module doc)."""
    m = compiled.memory_analysis()
    out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
    out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
    return out


def error(pred: MemoryPrediction, measured: dict) -> float:
    """(predicted - measured) / measured peak."""
    return (pred.peak - measured["peak"]) / measured["peak"]
