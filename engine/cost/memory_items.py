"""The named parts of one layer's step that `engine.cost.memory.one_program` adds up:
the kernel priced, one device's sizes (`Dims`), and per part the buffers live at its worst
moment, each keyed by what it holds (docs/memory_model.md says what each was read off)."""
from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from collectives.ring import tp_comm
from engine.config import TrainConfig
from engine.cost.scan_rows import cpu_upcasts_bf16_stacks
from engine.parallel.layout import Layout
from layers.attention import cp_kernel, resolve_attention
from layers.config import ModelConfig
from layers.kernels.chunked import chunked_attention

F32 = 4
# from this many rows B·L_x on, XLA:CPU materializes each norm's rsqrt broadcast over D
# in the layer backward (seen at 4096 rows, not at 1024 or fewer): one f32 [B, L_x, D]
# buffer per norm live at the peak (the compiled step's live-range report, small single
# and tp2: bitcast_broadcast_fusion and .1, each a fusion of one norm's rsqrt)
NORM_BROADCAST_ROWS = 4096


class Unsupported(ValueError):
    """A configuration the memory model does not cover (the message says which part)."""


def shard_shape(shape: tuple, spec: P, sizes: dict) -> tuple:
    """One device's shard of a global `shape` stored as `spec` on a mesh of `sizes`."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            out[dim] //= sizes.get(axis, 1)
    return tuple(out)


def flat_params(shapes, specs):
    """(name "a/b", shape, spec) for every param of two trees nested alike."""
    flat_specs = dict(jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, P)))
    for path, sds in jax.tree_util.tree_leaves_with_path(shapes):
        yield "/".join(k.key for k in path), sds, flat_specs[path]


def kernel_priced(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str,
                  par) -> str:
    """The attention kernel the step runs, as this model prices it: reference, chunked,
    flash (a target's flash kernel) or ring (cp's ring); Unsupported for the others."""
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
    if cfg.remat not in ("full", "dots", "alternate", "none"):
        raise Unsupported(f"no memory model for remat={cfg.remat!r}")
    if cfg.moe:
        raise Unsupported("no memory model for a mixture of experts (its dispatch buffers "
                          "were not read off the compiler); engine.cost.liveness walks it")
    return kernel



@dataclasses.dataclass(frozen=True)
class Dims:
    """One device's sizes of one layer's step, in the letters of the module docstring.

    B, Lx: this device's residual stream [B, L_x, D]; L: its tokens (seq / cp); S: the
    keys one attention call sees; Htp, Gtp, Ftp, Vtp: one tp rank's heads, kv heads it
    uses, MLP hidden and vocab; W, W_rank: one layer's weights on a tp rank (kv whole,
    kv sliced); c, u, a: bytes of the compute dtype, of a compute-dtype operand of a mixed
    dot, of the activation dtype; cast: 1 where casts to the compute dtype are copies.
    chunks: the (T, S) score tiles the kernel forms."""

    B: int
    Lx: int
    L: int
    S: int
    D: int
    K: int
    N: int
    Htp: int
    Gtp: int
    Ftp: int
    Vtp: int
    W: int
    W_rank: int
    c: int
    u: int
    a: int
    cast: int
    cp: int
    kernel: str
    platform: str
    chunks: tuple

    @property
    def cpu(self) -> bool:
        return self.platform == "cpu"

    @property
    def x_stream(self) -> int:  # [B, L_x, D] activation dtype
        return self.B * self.Lx * self.D * self.a

    @property
    def x_full(self) -> int:  # [B, L, D] activation dtype
        return self.B * self.L * self.D * self.a

    @property
    def mlp(self) -> int:  # [B, L, F_tp] activation dtype
        return self.B * self.L * self.Ftp * self.a

    @property
    def q_c(self) -> int:  # [B, L, H_tp, K] compute dtype
        return self.B * self.L * self.Htp * self.K * self.c

    @property
    def tiles(self) -> int:  # sum of T·S
        return sum(tq * s for tq, s in self.chunks)

    @property
    def largest(self) -> int:  # one call's T·S
        return max((tq * s for tq, s in self.chunks), default=0)

    @property
    def keys(self) -> int:  # sum of S
        return sum(s for _, s in self.chunks)

    @property
    def scores(self) -> int:  # f32 scores of all tiles
        return self.B * self.Htp * self.tiles * F32



def dims(cfg: ModelConfig, tcfg: TrainConfig, layout: Layout, platform: str, par,
         kernel: str, shapes) -> Dims:
    """`Dims` read off the param and activation tables for `layout`."""
    from engine.parallel.params import PARAMS_ROLE, activation_spec, param_specs

    cp = layout.degree("cp")
    sizes = dict(layout.mesh_axes())
    B, Lx, _ = shard_shape((tcfg.batch, tcfg.seq, cfg.d_model),
                            activation_spec("residual", layout, par.tp_comm), sizes)
    # L: this rank's tokens (whole over tp; seq / cp under cp); S: the keys one attention
    # call sees (the whole sequence under cp's allgather; one rank's block in the ring)
    L, D, K = tcfg.seq // cp, cfg.d_model, cfg.head_dim
    S = tcfg.seq if kernel == "reference" else L
    # one layer's weights as gathered on a tp rank: the param table's shards with fsdp
    # whole; H_tp, F_tp, V_tp and the kv heads a rank stores read off them
    gathered = {name: shard_shape(sds.shape, spec, {**sizes, PARAMS_ROLE: 1})
                for name, sds, spec in flat_params(shapes, param_specs(cfg, layout))}
    G_stored = gathered["blocks/wk"][2]       # G / tp, or G (replicated) when tp > G
    # the attention slices a replicated kv (tp > G) to the one head its rank uses
    Gtp = G_stored if G_stored < cfg.n_kv_heads or layout.degree("tp") == 1 else 1
    W = sum(math.prod(shape[1:]) for name, shape in gathered.items()
            if name.startswith("blocks/w"))
    c = jnp.dtype(cfg.compute_dtype).itemsize
    # a: bytes of the activation dtype (matmul results, the residual stream, the norms'
    # outputs; f32 by default); cast: the norm outputs' and h's casts to the compute
    # dtype are copies only where the two dtypes differ
    # (on `cpu` 4 whatever the dtype: XLA:CPU's buffers for bf16 activations measured no
    # smaller under remat full and dots, small fsdp8 / fsdp4xtp2, L = 256: docs/memory_model.md)
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
    return Dims(B=B, Lx=Lx, L=L, S=S, D=D, K=K, N=cfg.n_layers,
                Htp=gathered["blocks/wq"][2], Gtp=Gtp, Ftp=gathered["blocks/wg"][2],
                Vtp=gathered["embed"][0], W=W, W_rank=W - 2 * D * (G_stored - Gtp) * K,
                c=c, u=F32 if platform == "cpu" else c,
                a=F32 if platform == "cpu" else jnp.dtype(cfg.act_dtype).itemsize,
                cast=int(cfg.activations != cfg.dtype), cp=cp, kernel=kernel,
                platform=platform, chunks=tuple(chunks))



def attention_items(d: Dims) -> dict:
    """What one layer's attention holds in its recompute and backward (remat `full`),
    by kernel."""
    B, L, S, K, Htp, Gtp, c, u = d.B, d.L, d.S, d.K, d.Htp, d.Gtp, d.c, d.u
    if d.kernel == "flash":
        # the kernel accumulates in f32 on chip and writes dq, dk, dv in the compute
        # dtype (jax's Pallas TPU flash / splash kernels: f32 VMEM scratch, outputs in
        # q's and k's dtypes); FlashAttention-2/3 on a GPU accumulates dq in an f32 HBM
        # buffer (`dq_accum`, flash_attn's mha_bwd) before converting it
        attn = {"attention lse, f32 (forward residual)": B * Htp * L * F32,
                "attention o (forward residual)": d.q_c,
                "attention dq, dk, dv (compute dtype)": B * L * (Htp + 2 * Gtp) * K * c,
                **({} if d.platform == "tpu" else
                   {"attention dq accumulator, f32 (FlashAttention's dq_accum)":
                        B * L * Htp * K * F32})}
    elif d.kernel == "ring":
        attn = {"attention p, dp, ds of the diagonal block, f32": 3 * d.scores,
                "attention dq, dk, dv (f32), dk, dv arriving": B * L * (Htp + 4 * Gtp) * K * F32,
                "attention k, v arriving (compute dtype)": 2 * B * L * Gtp * K * c,
                "attention causal mask [L, L]": d.tiles}
    elif d.kernel == "reference":
        attn = {"attention exp(s - max), f32 (recomputed)": d.scores,
                "attention p (compute dtype) upcast for dv's dot": d.scores // F32 * u,
                "attention q, k, v upcast for the backward's dots":
                    B * (L * Htp + 2 * S * Gtp) * K * u,
                "attention causal mask [L, S]": d.tiles}
        if d.cp > 1:
            attn["attention k, v gathered over cp (compute dtype)"] = 2 * B * S * Gtp * K * c
            attn["attention dk, dv over the whole sequence, f32 (before the reduce-scatter)"] = (
                2 * B * S * Gtp * K * F32)
    else:
        attn = {"attention E = exp(s - max) per chunk, compute dtype (forward residual)":
                    d.scores // F32 * c,
                "attention 1/rowsum per chunk, f32 (forward residual)": B * Htp * L * F32,
                "attention q relaid out heads-major, sliced per chunk (for dk)": d.q_c,
                "attention k, v relaid out heads-major, sliced to each chunk's key prefix":
                    2 * B * Gtp * K * d.keys * c,
                "attention o heads-major (f32 for delta when chunks > 1)":
                    d.q_c // c * (F32 if len(d.chunks) > 1 else c),
                "attention masks per chunk [T, S]": d.tiles}
    attn["attention o relaid out (for wo's grad)"] = d.q_c
    return attn



def mlp_items(d: Dims) -> dict:
    """The MLP's recompute and backward. Elementwise intermediates XLA:CPU keeps as
    buffers (silu's sigmoid(g)); an accelerator's XLA fuses them into their consumers."""
    if d.platform == "tpu":  # read off XLA:TPU's buffer assignment (bench/tpu_compile.py)
        return {"mlp: three [B, L, F_tp] buffers in the compute dtype (XLA:TPU's, "
                "at the MLP backward)": 3 * d.mlp // d.a * d.c}
    return {"mlp g, u, sigmoid(g) (recomputed)" if d.cpu else "mlp g, u (recomputed)":
                (3 if d.cpu else 2) * d.mlp,
            "mlp dg, du, h for wd's grad (compute dtype)": 3 * d.mlp // d.a * d.c}



def stream_items(d: Dims) -> dict:
    """The residual stream around one layer's backward; XLA:CPU keeps each norm's rsqrt
    broadcast over D as a buffer from `NORM_BROADCAST_ROWS` rows on."""
    stream = {"stream x, x + attn, 2 norm outputs, dy": 5 * d.x_stream,
              "stream dy (compute dtype, whole L), 2 norm outputs relaid out":
                  3 * d.x_full // d.a * d.c,
              "rope cos, sin [L, K/2]": d.L * d.K * F32}
    if d.cpu and d.B * d.Lx >= NORM_BROADCAST_ROWS:
        stream["stream rsqrt(mean(x^2)) broadcast over D, one per norm (f32)"] = (
            2 * d.x_stream // d.a * F32)
    return stream



def weight_grad_items(d: Dims, par) -> dict:
    """The end of the layer's backward (zero 3 over fsdp): its weight grads whole until
    their reduce-scatter (the gather's transpose), beside its gathered weights and the
    stream. XLA:CPU combines the layer's reduce-scatters into one there, run in f32 for
    bf16: all of them, in the compute dtype and an f32 concatenated copy (read off its
    buffer assignment). An accelerator's XLA issues each as its grad is ready (async
    collectives, combined only up to a byte threshold): at least the largest, one
    [D, F_tp] in the compute dtype, and its f32 cast under grad_reduce f32 (not
    checked there). On the CPU grad_reduce f32 moves no peak (measured on small,
    fsdp8 and fsdp4xtp2, zero 2 and 3: the same peaks to 0.1 MiB)."""
    if d.cpu and d.c < F32:
        return {"layer weight grads, whole before their combined reduce-scatter "
                "(compute dtype and f32)": d.W_rank * (d.c + F32)}
    if d.cpu:
        return {"layer weight grads, whole before their combined reduce-scatter":
                    d.W_rank * d.c}
    grads_whole = {"mlp weight grad [D, F_tp], whole before its reduce-scatter":
                       d.D * d.Ftp * d.c}
    if par.grad_reduce == "f32" and d.c < F32:
        grads_whole["its f32 cast, what the reduce-scatter reads (grad_reduce f32)"] = \
            d.D * d.Ftp * F32
    return grads_whole



def regathers(d: Dims, par) -> bool:
    """Whether a column-parallel matmul's backward gathers its sequence-sharded input
    again (tp_comm `sequence` outside a remat policy: `collectives.ring.SequenceComm`)
    rather than keeping it gathered."""
    return getattr(tp_comm(par.tp_comm), "regather", False) and d.Lx < d.L


def saved_by_remat(d: Dims, cfg: ModelConfig, par, trans_full: dict,
                   saves_weights: bool) -> tuple[dict, dict]:
    """(residuals the forward scan saves for N layers, the layer backward's transient)
    under the remat policy; `trans_full` is the transient of remat `full`."""
    n = d.N - 1 if saves_weights else d.N
    # prefetch: the backward is a scan of its own that gathers the weights again, one
    # layer ahead, and holds two layers' gathered weights (layers.block.
    # prefetched_full_remat under `full`, prefetched_saving under the others, which
    # save what the policy keeps but the weights). With one layer under all but `full`
    # the scan is differentiated as written: it runs layers 1..N-1 and saves each one's
    # gathered weights (its carry); the last layer follows it, not rematted.
    prefetched = ({f"prefetched weights saved by the scan ({n} layers, f32 on cpu)":
                       n * d.W * d.u} if saves_weights else {})
    without_mlp_g = {k: v for k, v in trans_full.items() if not k.startswith("mlp g")}
    if cfg.remat == "full":
        return {f"scan carry x ({n} layers)": n * d.x_stream}, trans_full
    B, L, K, Htp, Gtp, a = d.B, d.L, d.K, d.Htp, d.Gtp, d.a
    if cfg.remat == "dots":
        # x, and the attention's output saved after its tp collective: [B, L_x, D] each
        per = 2 * d.x_stream + B * L * (Htp + 2 * Gtp) * K * a + 2 * d.mlp
        res = {f"carry x, q, k, v, attention output, g, u ({n} layers)": n * per,
               **prefetched}
        return res, {**without_mlp_g,
                     **({"mlp sigmoid(g) (recomputed)": d.mlp} if d.cpu else {})}
    if cfg.remat == "alternate":
        # x, q, v, the attention kernel's output o (compute dtype) and g; where wo's sum
        # crosses tp its reduced output too (layers/scopes.py `SAVED_BY_ALTERNATE`)
        crosses_tp = cfg.n_heads // Htp > 1
        per = ((1 + crosses_tp) * d.x_stream + B * L * (Htp + Gtp) * K * a + d.q_c + d.mlp)
        what = "attention o, g" + (", wo's output reduced over tp" if crosses_tp else "")
        res = {f"carry x, q, v, {what} ({n} layers)": n * per, **prefetched}
        return res, {**without_mlp_g,
                     ("mlp u, sigmoid(g) (recomputed)" if d.cpu else "mlp u (recomputed)"):
                         (2 if d.cpu else 1) * d.mlp}
    # none: the saved dot operands, stacked: us, u unless the host's XLA:CPU slices a
    # bf16 stack as it is (jax 0.12; asked only here, where stacks are priced)
    us = d.c if d.cpu and not cpu_upcasts_bf16_stacks() else d.u
    scores = d.scores
    saved = (B * Htp * L * F32 if d.kernel in ("flash", "ring")
             else scores // F32 * us + B * Htp * L * F32 if d.kernel == "chunked"
             else scores + scores // F32 * us)
    per = {"p (f32 and compute dtype; chunked: E and 1/rowsum; f32 on cpu)": saved,
           "mlp g, u, h and h cast (f32 on cpu)": 3 * d.mlp + d.cast * d.mlp // a * us,
           "stream x into each norm": 2 * d.x_stream,
           **({"norm outputs, sequence-sharded (gathered again in the backward)":
               2 * d.x_stream} if regathers(d, par) else
              {"norm outputs (cast for q, k, v, gate, up; f32 on cpu)":
               (5 * d.x_full // a * us) if d.cast else 2 * d.x_full}),
           "q, o, k, v (compute dtype; f32 on cpu)": (2 * Htp + 2 * Gtp) * B * L * K * us,
           **({} if par.prefetch else {"gathered weights (compute dtype; f32 on cpu)": d.W * us})}
    res = {f"{k} ({n} layers)": n * v for k, v in per.items()}
    return res, {**without_mlp_g,
                 "copies of this layer's saved p and 4 stream tensors": scores + 4 * d.x_stream}



# the memory platform of a GPU whose loss is a fused softmax cross-entropy kernel
# (flash-attn's xentropy, `attention_rates.FUSED_CROSS_ENTROPY`)
XENTROPY = "accelerator-xentropy"


def loss_items(d: Dims) -> dict:
    """The loss phase: dlogits, the unembed and the embed grad. A fused cross-entropy
    kernel (`XENTROPY`) saves the logits as they come, in the compute dtype, and writes
    dlogits in that dtype beside them (flash-attn's CrossEntropyLoss backward:
    `torch.empty_like(logits)`)."""
    if d.platform == "tpu":
        dlogits = {"dlogits (XLA:TPU's one f32 [B, L, V_tp])": d.B * d.L * d.Vtp * F32}
    elif d.platform == XENTROPY:
        dlogits = {"logits saved and dlogits (compute dtype, fused cross-entropy)":
                   2 * d.B * d.L * d.Vtp * d.c}
    else:
        dlogits = {"dlogits and a relayout": 2 * d.B * d.L * d.Vtp * F32}
    return {**dlogits,
            "unembed gathered and its f32 grad": d.D * d.Vtp * (d.c + F32),
            "embed grad, whole over fsdp": d.Vtp * d.D * F32}



def last_layer_items(d: Dims, attn: dict, grad_embed: int) -> dict:
    """The loss's backward with the last (not rematted) layer's forward saved, when a
    prefetching scan under `dots` / `none` leaves the last layer out (docs/memory_model.md)."""
    return {"last layer: its input x (the scan's output)": d.x_stream,
            "last layer: its gathered weights (compute dtype)": d.W_rank * d.c,
            **{f"last layer: {k}": v for k, v in attn.items()},
            "last layer: rope cos, sin [L, K/2]": d.L * d.K * F32,
            "last layer: mlp g, u" + (", sigmoid(g), silu(g)" if d.cpu else ""):
                (4 if d.cpu else 2) * d.mlp,
            "last layer: mlp h cast (for wd's grad)": d.mlp // d.a * d.c,
            "last layer: stream 2 norm outputs, x + attn, x + attn + mlp, final "
            "norm output": 5 * d.x_stream,
            "last layer: stream 2 norm outputs cast, relaid out": 2 * d.x_full // d.a * d.c,
            "loss: dh = dlogits unembed^T and its all-reduce over tp": d.x_full + d.x_stream,
            "loss: unembed grad, f32": d.D * d.Vtp * F32,
            "embed grad, whole over fsdp (replaces its shard)":
                d.Vtp * d.D * F32 - grad_embed}
