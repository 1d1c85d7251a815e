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
import inspect
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from engine.config import TrainConfig
from engine.cost.scan_rows import cpu_upcasts_bf16_stacks
from engine.parallel.layout import Layout
from layers.attention import cp_kernel, resolve_attention
from layers.config import ModelConfig
from layers.kernels.chunked import chunked_attention

MiB = 2 ** 20
F32 = 4
# from this many rows B·L_x on, XLA:CPU materializes each norm's rsqrt broadcast over D
# in the layer backward (seen at 4096 rows, not at 1024 or fewer): one f32 [B, L_x, D]
# buffer per norm live at the peak (the compiled step's live-range report, small single
# and tp2: bitcast_broadcast_fusion and .1, each a fusion of one norm's rsqrt)
NORM_BROADCAST_ROWS = 4096


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


def _shard_shape(shape: tuple, spec: P, sizes: dict) -> tuple:
    """One device's shard of a global `shape` stored as `spec` on a mesh of `sizes`."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            out[dim] //= sizes.get(axis, 1)
    return tuple(out)


def _shard_bytes(sds, spec: P, sizes: dict) -> int:
    """Bytes of one device's shard of `sds` stored as `spec` on a mesh of `sizes`."""
    return math.prod(_shard_shape(sds.shape, spec, sizes)) * jnp.dtype(sds.dtype).itemsize


def _flat(shapes, specs):
    """(name "a/b", shape, spec) for every param of two trees nested alike."""
    flat_specs = dict(jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P)))
    for path, sds in jax.tree_util.tree_leaves_with_path(shapes):
        yield "/".join(k.key for k in path), sds, flat_specs[path]


def _tree_bytes(shapes, specs, sizes: dict, keep=lambda path: True) -> int:
    total = 0
    for path, n in jax.tree_util.tree_leaves_with_path(jax.tree.map(
            lambda s, p: _shard_bytes(s, p, sizes), shapes, specs,
            is_leaf=lambda x: isinstance(x, P))):
        total += n if keep(jax.tree_util.keystr(path)) else 0
    return int(total)


def _accumulated(cfg, tcfg, layout, platform, par) -> MemoryPrediction:
    """Gradient accumulation without pp (`Trainer._accumulate`): the peak falls in one
    microbatch's step (the global batch / M, as a step of its own) plus the scan
    carry's grads accumulator (f32 as differentiated), held twice as the pipeline's
    carry is (engine/cost/pipeline.py); the tokens argument is the whole batch."""
    m = par.microbatches
    one = predict(cfg, dataclasses.replace(tcfg, batch=tcfg.batch // m), layout, platform,
                  parallel=dataclasses.replace(par, microbatches=1))
    item = {f"microbatches: grads accumulated over the {m} microbatches (f32), held "
            f"twice": 2 * one.grads}
    return dataclasses.replace(one, tokens=one.tokens * m,
                               residuals=one.residuals + 2 * one.grads,
                               items={**item, **one.items},
                               phase=f"{one.phase} (one microbatch of {m})")


def predict(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str = "cpu",
            trainer=None, parallel=None) -> MemoryPrediction:
    """The step's predicted per-device peak (docs/memory_model.md). `platform`: "cpu" (XLA:CPU,
    what the item list was read from: compute-dtype operands of mixed dots are upcast to
    f32), anything else keeps them in the compute dtype and runs a flash kernel:
    "accelerator" a GPU's (FlashAttention), "tpu" Pallas's. `trainer`: a `Trainer` for (cfg,
    tcfg, layout) to take the specs from; by default one on the layout's abstract mesh."""
    from engine.config import ParallelConfig
    from engine.parallel.params import PARAMS_ROLE, activation_spec, param_shapes, param_specs

    par = trainer.parallel if trainer is not None else parallel or ParallelConfig()
    if layout.degree("pp") > 1:  # one stage's backward unit and the pipeline's buffers
        from engine.cost.pipeline import predict_memory

        return predict_memory(cfg, tcfg, layout, platform, par)
    if par.microbatches > 1:
        return _accumulated(cfg, tcfg, layout, platform, par)
    cp = layout.degree("cp")
    kernel = cp_kernel(cfg.attention) if cp > 1 else resolve_attention(cfg.attention, tcfg.seq)
    if cp > 1 and par.cp_comm == "ring":
        kernel = "ring"  # the ring's own blocks (layers/kernels/context.py)
    if platform != "cpu" and kernel in ("blocked", "pallas"):
        kernel = "flash"  # the target's flash kernel (engine/cost/price.py)
    if cp > 1 and kernel == "chunked":
        raise Unsupported("no memory model for the 'chunked' kernel under cp (only "
                          "'reference' and the ring were checked against the compiler)")
    if kernel not in ("reference", "chunked", "flash", "ring"):
        raise Unsupported(f"no memory model for the {kernel!r} attention kernel (only "
                          f"'reference' and 'chunked' were checked against the compiler; "
                          f"engine.cost.liveness walks any traced step)")
    if cfg.remat not in ("full", "dots", "none"):
        raise Unsupported(f"no memory model for remat={cfg.remat!r}")
    if cfg.moe:
        raise Unsupported("no memory model for a mixture of experts (its dispatch buffers "
                          "were not read off the compiler); engine.cost.liveness walks it")
    if trainer is None:
        from engine.run.step import Trainer

        trainer = Trainer(cfg, tcfg, layout, layout.abstract_mesh(), par)
    t = trainer
    sizes = dict(layout.mesh_axes())
    shapes = param_shapes(cfg)
    params = _tree_bytes(shapes, t.specs, sizes)
    opt_state = _tree_bytes(jax.eval_shape(t.tx.init, shapes), t.opt_specs, sizes)
    grads = _tree_bytes(shapes, t.grad_specs, sizes)
    grads_not_blocks = _tree_bytes(shapes, t.grad_specs, sizes,
                                   keep=lambda path: not path.startswith("['blocks']"))
    grad_embed = _tree_bytes(shapes, t.grad_specs, sizes,
                             keep=lambda path: path.startswith("['embed']"))
    # this device's tokens [B, L+1] int32 and residual stream [B, L_x, D] (f32), as the
    # activation table shards them
    tokens = _shard_bytes(jax.ShapeDtypeStruct((tcfg.batch, tcfg.seq + 1), jnp.int32),
                          activation_spec("tokens", layout), sizes)
    B, Lx, _ = _shard_shape((tcfg.batch, tcfg.seq, cfg.d_model),
                            activation_spec("residual", layout, par.tp_comm), sizes)

    # L: this rank's tokens (whole over tp; seq / cp under cp); S: the keys one attention
    # call sees (the whole sequence under cp's allgather; one rank's block in the ring)
    L, D, K, N = tcfg.seq // cp, cfg.d_model, cfg.head_dim, cfg.n_layers
    S = tcfg.seq if kernel == "reference" else L
    # one layer's weights as gathered on a tp rank: the param table's shards with fsdp
    # whole; H_tp, F_tp, V_tp and the kv heads a rank stores read off them
    gathered = {name: _shard_shape(sds.shape, spec, {**sizes, PARAMS_ROLE: 1})
                for name, sds, spec in _flat(shapes, param_specs(cfg, layout))}
    Htp, Ftp, Vtp = (gathered["blocks/wq"][2], gathered["blocks/wg"][2],
                     gathered["embed"][0])
    G_stored = gathered["blocks/wk"][2]       # G / tp, or G (replicated) when tp > G
    # the attention slices a replicated kv (tp > G) to the one head its rank uses
    Gtp = G_stored if G_stored < cfg.n_kv_heads or layout.degree("tp") == 1 else 1
    W = sum(math.prod(shape[1:]) for name, shape in gathered.items()
            if name.startswith("blocks/w"))
    W_rank = W - 2 * D * (G_stored - Gtp) * K  # kv sliced to this rank
    c = jnp.dtype(cfg.compute_dtype).itemsize
    u = F32 if platform == "cpu" else c  # a compute-dtype operand of a mixed dot

    # a: bytes of the activation dtype (matmul results, the residual stream, the norms'
    # outputs; f32 by default); cast: the norm outputs' and h's casts to the compute
    # dtype are copies only where the two dtypes differ
    # (on `cpu` 4 whatever the dtype: XLA:CPU's buffers for bf16 activations measured no
    # smaller under remat full and dots, small fsdp8 / fsdp4xtp2, L = 256: docs/memory_model.md)
    a = F32 if platform == "cpu" else jnp.dtype(cfg.act_dtype).itemsize
    cast = int(cfg.activations != cfg.dtype)
    x_stream, x_full = B * Lx * D * a, B * L * D * a  # [B, L_x, D], [B, L, D]
    mlp = B * L * Ftp * a                              # [B, L, F_tp]
    q_c = B * L * Htp * K * c                               # [B, L, H_tp, K] compute dtype
    # the score tiles the kernel forms: [L, L] (reference) or, per 64-query chunk of T
    # queries, [T, S] against its causal key prefix S (chunked)
    if kernel == "flash":
        chunks = []
    elif kernel == "ring":  # the diagonal block: the ring's largest tile
        chunks = [(L, L)]
    elif cp > 1:  # cp's allgather: the first chunk against the first half of the keys,
        chunks = [(L // 2, S // 2), (L // 2, S)]  # the second against all of them
    elif kernel == "chunked":
        T = min(inspect.signature(chunked_attention).parameters["blocks"].default.block_q, L)
        chunks = [(min(s + T, L) - s, min(s + T, L)) for s in range(0, L, T)]
    else:
        chunks = [(L, L)]
    tiles = sum(tq * s for tq, s in chunks)                 # sum of T·S
    largest = max((tq * s for tq, s in chunks), default=0)  # one call's T·S
    keys = sum(s for _, s in chunks)                        # sum of S
    scores = B * Htp * tiles * F32                          # f32 scores of all tiles

    # the layer's recompute and backward (remat `full`), live where the MLP's backward
    # starts (docs/memory_model.md)
    if kernel == "flash":
        # the kernel accumulates in f32 on chip and writes dq, dk, dv in the compute
        # dtype (jax's Pallas TPU flash / splash kernels: f32 VMEM scratch, outputs in
        # q's and k's dtypes); FlashAttention-2/3 on a GPU accumulates dq in an f32 HBM
        # buffer (`dq_accum`, flash_attn's mha_bwd) before converting it
        attn = {"attention lse, f32 (forward residual)": B * Htp * L * F32,
                "attention o (forward residual)": q_c,
                "attention dq, dk, dv (compute dtype)": B * L * (Htp + 2 * Gtp) * K * c,
                **({} if platform == "tpu" else
                   {"attention dq accumulator, f32 (FlashAttention's dq_accum)":
                        B * L * Htp * K * F32})}
    elif kernel == "ring":
        attn = {"attention p, dp, ds of the diagonal block, f32": 3 * scores,
                "attention dq, dk, dv (f32), dk, dv arriving": B * L * (Htp + 4 * Gtp) * K * F32,
                "attention k, v arriving (compute dtype)": 2 * B * L * Gtp * K * c,
                "attention causal mask [L, L]": tiles}
    elif kernel == "reference":
        attn = {"attention exp(s - max), f32 (recomputed)": scores,
                "attention p (compute dtype) upcast for dv's dot": scores // F32 * u,
                "attention q, k, v upcast for the backward's dots":
                    B * (L * Htp + 2 * S * Gtp) * K * u,
                "attention causal mask [L, S]": tiles}
        if cp > 1:
            attn["attention k, v gathered over cp (compute dtype)"] = 2 * B * S * Gtp * K * c
            attn["attention dk, dv over the whole sequence, f32 (before the reduce-scatter)"] = (
                2 * B * S * Gtp * K * F32)
    else:
        attn = {"attention E = exp(s - max) per chunk, compute dtype (forward residual)":
                    scores // F32 * c,
                "attention 1/rowsum per chunk, f32 (forward residual)": B * Htp * L * F32,
                "attention q relaid out heads-major, sliced per chunk (for dk)": q_c,
                "attention k, v relaid out heads-major, sliced to each chunk's key prefix":
                    2 * B * Gtp * K * keys * c,
                "attention o heads-major (f32 for delta when chunks > 1)":
                    q_c // c * (F32 if len(chunks) > 1 else c),
                "attention masks per chunk [T, S]": tiles}
    attn["attention o relaid out (for wo's grad)"] = q_c
    # elementwise intermediates XLA:CPU keeps as buffers (silu's sigmoid(g), each norm's
    # rsqrt broadcast over D); an accelerator's XLA fuses them into their consumers
    cpu = platform == "cpu"
    if platform == "tpu":  # read off XLA:TPU's buffer assignment (bench/tpu_compile.py)
        mlp_items = {"mlp: three [B, L, F_tp] buffers in the compute dtype (XLA:TPU's, "
                     "at the MLP backward)": 3 * mlp // a * c}
    else:
        mlp_items = {"mlp g, u, sigmoid(g) (recomputed)" if cpu else "mlp g, u (recomputed)":
                         (3 if cpu else 2) * mlp,
                     "mlp dg, du, h for wd's grad (compute dtype)":
                         3 * mlp // a * c}
    stream = {"stream x, x + attn, 2 norm outputs, dy": 5 * x_stream,
              "stream dy (compute dtype, whole L), 2 norm outputs relaid out":
                  3 * x_full // a * c,
              "rope cos, sin [L, K/2]": L * K * F32}
    if cpu and B * Lx >= NORM_BROADCAST_ROWS:
        stream["stream rsqrt(mean(x^2)) broadcast over D, one per norm (f32)"] = (
            2 * x_stream // a * F32)
    weights = {"layer weights but wd (compute dtype)": (W_rank - D * Ftp) * c}
    embed = {"embed grad, whole over fsdp (replaces its shard)": Vtp * D * F32 - grad_embed}
    # the end of the layer's backward (zero 3 over fsdp): its weight grads whole until
    # their reduce-scatter (the gather's transpose), beside its gathered weights and the
    # stream. XLA:CPU combines the layer's reduce-scatters into one there, run in f32 for
    # bf16: all of them, in the compute dtype and an f32 concatenated copy (read off its
    # buffer assignment). An accelerator's XLA issues each as its grad is ready (async
    # collectives, combined only up to a byte threshold): at least the largest, one
    # [D, F_tp] in the compute dtype, and its f32 cast under grad_reduce f32 (not
    # checked there). On the CPU grad_reduce f32 moves no peak (measured on small,
    # fsdp8 and fsdp4xtp2, zero 2 and 3: the same peaks to 0.1 MiB).
    if cpu and c < F32:
        grads_whole = {"layer weight grads, whole before their combined reduce-scatter "
                       "(compute dtype and f32)": W_rank * (c + F32)}
    elif cpu:
        grads_whole = {"layer weight grads, whole before their combined reduce-scatter":
                           W_rank * c}
    else:
        grads_whole = {"mlp weight grad [D, F_tp], whole before its reduce-scatter":
                           D * Ftp * c}
        if par.grad_reduce == "f32" and c < F32:
            grads_whole["its f32 cast, what the reduce-scatter reads (grad_reduce f32)"] = \
                D * Ftp * F32
    layer_weights = {"layer weights (compute dtype)": W_rank * c}
    trans_full = {**attn, **mlp_items, **stream, **weights, **embed}
    # prefetch: the backward is a scan of its own that gathers the weights again, one
    # layer ahead, and holds two layers' gathered weights (layers.block.
    # prefetched_full_remat under `full`, prefetched_saving under `dots` / `none`, which
    # save what the policy keeps but the weights). With one layer under `dots` / `none`
    # the scan is differentiated as written: it runs layers 1..N-1 and saves each one's
    # gathered weights (its carry); the last layer follows it, not rematted.
    saves_weights = par.prefetch and cfg.remat != "full" and N < 2
    n = N - 1 if saves_weights else N
    prefetched = ({f"prefetched weights saved by the scan ({n} layers, f32 on cpu)":
                       n * W * u} if saves_weights else {})
    if cfg.remat == "full":
        res = {f"scan carry x ({n} layers)": n * x_stream}
        trans = trans_full
    elif cfg.remat == "dots":
        # x, and the attention's output saved after its tp collective: [B, L_x, D] each
        per = 2 * x_stream + B * L * (Htp + 2 * Gtp) * K * a + 2 * mlp
        res = {f"carry x, q, k, v, attention output, g, u ({n} layers)": n * per,
               **prefetched}
        trans = {**{k: v for k, v in trans_full.items() if not k.startswith("mlp g")},
                 **({"mlp sigmoid(g) (recomputed)": mlp} if cpu else {})}
    else:  # none: the saved dot operands, stacked: us, u unless the host's XLA:CPU
        # slices a bf16 stack as it is (jax 0.12; asked only here, where stacks are priced)
        us = c if cpu and not cpu_upcasts_bf16_stacks() else u
        saved = (B * Htp * L * F32 if kernel in ("flash", "ring")
                 else scores // F32 * us + B * Htp * L * F32 if kernel == "chunked"
                 else scores + scores // F32 * us)
        per = {"p (f32 and compute dtype; chunked: E and 1/rowsum; f32 on cpu)": saved,
               "mlp g, u, h and h cast (f32 on cpu)": 3 * mlp + cast * mlp // a * us,
               "stream x into each norm": 2 * x_stream,
               "norm outputs (cast for q, k, v, gate, up; f32 on cpu)":
                   (5 * x_full // a * us) if cast else 2 * x_full,
               "q, o, k, v (compute dtype; f32 on cpu)": (2 * Htp + 2 * Gtp) * B * L * K * us,
               **({} if par.prefetch else {"gathered weights (compute dtype; f32 on cpu)": W * us})}
        res = {f"{k} ({n} layers)": n * v for k, v in per.items()}
        trans = {**{k: v for k, v in trans_full.items() if not k.startswith("mlp g")},
                 "copies of this layer's saved p and 4 stream tensors":
                     scores + 4 * x_stream}
    gathers = par.zero == 3 and layout.degree("fsdp") > 1  # ZeRO-3 gathers weights
    if platform == "tpu" and gathers:
        # XLA:TPU casts every layer's stored weight shards to the compute dtype once,
        # before the layer loop, and keeps the copy through both loops (read off its
        # buffer assignment: bench/tpu_compile.py)
        res["every layer's weight shards cast to the compute dtype, hoisted"] = (
            N * W // layout.degree("fsdp") * c)
    if par.prefetch and not saves_weights:  # this layer's whole weights and the next's
        carried = {"this layer's and the next layer's weights, carried (compute dtype)":
                       2 * W * c}
        trans = {**{k: v for k, v in trans.items() if not k.startswith("layer weights")},
                 **carried}
        layer_weights = carried
    grads_end = {**stream, **embed, **layer_weights, **grads_whole} if gathers else {}
    dlogits = ({"dlogits (XLA:TPU's one f32 [B, L, V_tp])": B * L * Vtp * F32}
               if platform == "tpu" else {"dlogits and a relayout": 2 * B * L * Vtp * F32})
    loss = {**dlogits,
            "unembed gathered and its f32 grad": D * Vtp * (c + F32),
            "embed grad, whole over fsdp": Vtp * D * F32}
    if saves_weights:
        # the loss's backward with the last (not rematted) layer's forward saved
        # (docs/memory_model.md); the scanned layers' stacked grads are already allocated
        last = {"last layer: its input x (the scan's output)": x_stream,
                "last layer: its gathered weights (compute dtype)": W_rank * c,
                **{f"last layer: {k}": v for k, v in attn.items()},
                "last layer: rope cos, sin [L, K/2]": L * K * F32,
                "last layer: mlp g, u" + (", sigmoid(g), silu(g)" if cpu else ""):
                    (4 if cpu else 2) * mlp,
                "last layer: mlp h cast (for wd's grad)": mlp // a * c,
                "last layer: stream 2 norm outputs, x + attn, x + attn + mlp, final "
                "norm output": 5 * x_stream,
                "last layer: stream 2 norm outputs cast, relaid out": 2 * x_full // a * c,
                "loss: dh = dlogits unembed^T and its all-reduce over tp":
                    x_full + x_stream,
                "loss: unembed grad, f32": D * Vtp * F32,
                "embed grad, whole over fsdp (replaces its shard)":
                    Vtp * D * F32 - grad_embed}
        grads_loss = grads_not_blocks + (grads - grads_not_blocks) * n // N
        phase_loss = "last layer"
    else:
        last, grads_loss, phase_loss = loss, grads_not_blocks, "loss"

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
                        (2 if kernel == "reference" else 1) * B * Htp * largest * F32}
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

    params, opt_state, tokens = _shape_dtype_specs(trainer.cfg, trainer.tcfg, trainer)
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
