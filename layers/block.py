"""The decoder block and the scan over stacked blocks, with FSDP gathers and remat."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

import collectives
from layers import scopes
from layers.attention import LayerCache, attention
from layers.axes import Axes
from layers.config import ModelConfig
from layers.documents import Documents
from layers.mlp import mlp
from layers.moe import moe
from layers.norm import rms_norm

# What each remat mode keeps for the backward pass; everything else is recomputed.
# `full`: only the scan carry (the residual stream between blocks), so the backward
# re-gathers each layer's weights over fsdp instead of holding them (ZeRO-3; with
# prefetch the gathered weights are in the carry, so they are held, see `blocks`).
# `dots`: also the projections' outputs (q, k, v, gate, up, the router's logits) and
# the attention's output after its tp collective (`scopes.SAVED_BY_DOTS`), so only
# attention scores, norms and activations are recomputed, and no tp collective of the
# forward runs again in the backward. Under every policy (and `none`) the norms and
# SwiGLU keep only their inputs (layers/norm.py).
# `alternate`: torchtitan's per-op selective activation checkpointing (mode "selective",
# option "op": `SelectiveAC._wrap_block` in torchtitan/distributed/activation_checkpoint.py;
# in Dec 2024 `_apply_ac_to_transformer_block` in torchtitan/parallelisms/
# parallelize_llama.py, the same rule). Its policy saves the outputs of the ops in its
# save list (mm, SDPA, reduce-scatter, ...) but every second mm: it counts a block's mms
# from 1, afresh per block, and recomputes those whose count is even. A Llama block runs
# seven, wq wk wv wo w1 w3 w2, so it saves wq, wv, w1 (gate) and w2, recomputes wk, wo and
# w3 (up), and saves the SDPA's output. Here that is q, v, gate and the attention
# kernel's output o (`scopes.SAVED_BY_ALTERNATE`); w2's output is read by no backward, so
# nothing is lost by not naming it. The backward runs wk, wo and wu again, and the
# attention's score matmul as under `dots` (with `reference`, not its o = p v; the flash
# kernels' custom_vjp residuals carry no name, so their forward runs again whole, as
# under `dots`). Where the out projection's sum crosses tp, its reduced output is saved
# too, as torchtitan saves its reduce-scatter's output, and wo does not run again. The
# MoE router's logits are recomputed, as torchtitan forces its router matmul to
# (`force_recompute_mm_shapes_by_fqns`, "moe.router.gate"); the experts' matmuls are
# recomputed as under `dots`.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_only_these_names(*scopes.SAVED_BY_DOTS),
    "alternate": jax.checkpoint_policies.save_only_these_names(*scopes.SAVED_BY_ALTERNATE),
}
REMAT_MODES = ("none", *REMAT_POLICIES)  # `ModelConfig.remat` values
# The modes the planner searches (engine/planner/space.py): not `alternate`, which is
# there to price published runs that used torchtitan's policy.
REMAT = ("none", "full", "dots")


def gather_weights(p: dict, fsdp_dims: Mapping[str, int | None], axes: Axes, dtype) -> dict:
    """A layer's weights made whole over fsdp, each along the dim the param table shards,
    as `axes.weights` says: ZeRO-3 all-gathers them in one collective, cast to `dtype`
    first (`layers.axes.GatherWeights`); ZeRO-2's weights are already whole
    (`engine.parallel.zero.ResidentWeights`). Weights not sharded over fsdp pass through in f32."""
    return axes.gather_weights(p, fsdp_dims, dtype)


def block(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes,
          cache: LayerCache | None = None, docs: Documents | None = None):
    """Pre-norm decoder block; p gathered over fsdp. x: [B, L, D] -> [B, L, D] replicated
    over tp (axes.tp_comm allreduce) or [B, L_tp, D] -> [B, L_tp, D] (sequence, ring).
    cache (decoding): the attention reads and writes this layer's KV cache, and the block
    returns (x, cache). docs: packed documents attention keeps apart (layers/documents.py)."""
    x_BLD, cache, _ = block_stats(x_BLD, p, cfg, axes, cache, docs)
    return x_BLD if cache is None else (x_BLD, cache)


def block_stats(x_BLD: jax.Array, p: dict, cfg: ModelConfig, axes: Axes,
                cache: LayerCache | None = None, docs: Documents | None = None):
    """`block` returning (x, cache, the MLP's router sums): `layers.moe.moe`'s local sums
    with experts, {} for the dense MLP."""
    # sequence, ring: the norms run on x's sequence shard, so their scales' grads are
    # partial sums over tp, all-reduced by the broadcast's bwd
    seq_tp = axes.seq_tp
    with jax.named_scope(scopes.ATTENTION):
        scale_D = collectives.broadcast(p["attn_norm"], seq_tp)
        h_BLD = rms_norm(x_BLD, scale_D, cfg.norm_eps)
        if cache is None:
            x_BLD = x_BLD + attention(h_BLD, p, cfg, axes, docs=docs)
        else:
            y_BLD, cache = attention(h_BLD, p, cfg, axes, cache)
            x_BLD = x_BLD + y_BLD
    with jax.named_scope(scopes.MLP):
        scale_D = collectives.broadcast(p["mlp_norm"], seq_tp)
        h_BLD = rms_norm(x_BLD, scale_D, cfg.norm_eps)
        if cfg.moe:
            y_BLD, stats = moe(h_BLD, p, cfg, axes)
        else:
            y_BLD, stats = mlp(h_BLD, p, cfg, axes), {}
        x_BLD = x_BLD + y_BLD
    return x_BLD, cache, stats


def blocks(x_BLD: jax.Array, stacked: dict, fsdp_dims: Mapping[str, int | None],
           cfg: ModelConfig, axes: Axes, docs: Documents | None = None) -> tuple[jax.Array, dict]:
    """`lax.scan` over N stacked blocks. stacked: {name: [N, ...local shard...]}; docs:
    the packed documents every layer's attention keeps apart (None: no document mask).
    Returns (x, the blocks' router sums stacked over layers: {name: [N, ...]}, {} dense).

    axes.prefetch: layer i+1's gather is issued in the scan body before layer i's compute,
    which does not wait for it, so the two can overlap. Layer 0 is gathered before the
    scan, the carry holds the gathered weights of the layer the body computes, the scan
    runs over layers 1..N-1 (gathering each for the next iteration) and the last layer
    is computed after it: each weight is gathered exactly N times in the forward, as
    without prefetch. Under remat `full` (dense MLP) the backward is a scan of its own that
    prefetches too (`prefetched_full_remat`): only each layer's input is saved, and
    the weights are gathered again, one layer ahead, as the backward walks down. Under
    `dots` and `none` (dense MLP, N > 1) the backward is hand-written too
    (`prefetched_saving`): the forward saves what the policy keeps of each layer but its
    weights, and the backward gathers them again, one layer ahead. With experts the
    scan is differentiated as written: the carried weights are saved for the backward
    (N layers' whole weights in the compute dtype), and the last layer is not rematted
    (its backward follows its forward at once, and XLA would merge the recompute into
    the forward, dropping its collectives)."""

    # a column's gathered input is kept, not gathered again in the backward
    # (`collectives.ring.TpComm.once`), under every remat policy (which recomputes it) and
    # in a last layer run after the scan (its forward and backward in one straight
    # program, where XLA merges the second gather into the first)
    once = dataclasses.replace(axes, tp_comm=collectives.tp_comm(axes.tp_comm).once())
    if cfg.remat != "none":
        axes = once

    def gather(p_layer):
        with jax.named_scope(scopes.GATHER_PARAMS):
            return gather_weights(p_layer, fsdp_dims, axes, cfg.compute_dtype)

    def remat(f):
        if cfg.remat == "none":
            return f
        return jax.checkpoint(f, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)

    def one(x_BLD, p, axes=axes):
        x_BLD, _, stats = block_stats(x_BLD, p, cfg, axes, docs=docs)
        return x_BLD, stats

    if not axes.prefetch:
        body = remat(lambda x_BLD, p_layer: one(x_BLD, gather(p_layer)))
        return lax.scan(body, x_BLD, stacked)

    n = jax.tree.leaves(stacked)[0].shape[0]
    if not cfg.moe:  # the hand-written backwards have no router sums
        dense = lambda x_BLD, p, axes=axes: block(x_BLD, p, cfg, axes, docs=docs)  # noqa: E731
        if cfg.remat == "full":
            return prefetched_full_remat(dense, gather)(x_BLD, stacked), {}
        if n > 1:
            last = remat(lambda x_BLD, p: dense(x_BLD, p, once))
            return prefetched_saving(remat(dense), gather, last)(x_BLD, stacked), {}

    layer = remat(one)

    def prefetch_body(carry, p_next):
        x_BLD, p = carry
        p_next = gather(p_next)  # layer i+1's weights, for the next iteration
        x_BLD, stats = layer(x_BLD, p)
        return (x_BLD, p_next), stats

    first = jax.tree.map(lambda w: w[0], stacked)
    rest = jax.tree.map(lambda w: w[1:], stacked)
    (x_BLD, p_last), stats = lax.scan(prefetch_body, (x_BLD, gather(first)), rest)
    x_BLD, last = one(x_BLD, p_last, once)
    return x_BLD, jax.tree.map(lambda s, l: jnp.concatenate([s, l[None]]), stats, last)


def prefetched_saving(layer, gather, last=None):
    """(x [B, L, D], stacked shards {name: [N, ...]}) -> x after N >= 2 layers, with a
    hand-written backward that keeps each layer's residuals but not its weights.

    `layer` (x, whole weights) -> x is the block as its remat policy (`none`, `dots`)
    differentiates it; `last` the same for the last layer (default `layer`). Forward:
    layer 0's weights gathered before a scan over layers 0..N-2 whose body gathers layer
    i+1 while it runs `jax.vjp` of layer i, stacking the residuals that vjp keeps except
    the weights themselves ([N-1, ...] each); the last layer after the scan. Backward, layers N-1 down to 0: the weights gathered again,
    one layer ahead, put back into each layer's vjp, whose weight grads are
    reduce-scattered (the gather's transpose) into the carried [N, ...] grads. So the
    backward holds two layers' gathered weights, not N (ZeRO-3 as PyTorch FSDP reshards
    after the forward), at the price of N more gathers; what the policy recomputes is
    recomputed in the backward body."""
    layers = {"layer": layer, "last": layer if last is None else last}
    vjp_shape = {}  # per kind: the vjp's treedef, which of its leaves are weights (traced)

    def saved_of(x_BLD, p, kind="layer"):
        """(the layer's output, the leaves of its vjp that are not its weights)."""
        y_BLD, vjp = jax.vjp(layers[kind], x_BLD, p)
        leaves, treedef = jax.tree.flatten(vjp)
        weights = jax.tree.leaves(p)
        where = tuple(next((k for k, w in enumerate(weights) if leaf is w), None)
                      for leaf in leaves)
        vjp_shape[kind] = treedef, where
        return y_BLD, [leaf for leaf, k in zip(leaves, where) if k is None]

    def vjp_of(saved, p, kind="layer"):
        """The layer's vjp from its saved leaves and its weights gathered again."""
        treedef, where = vjp_shape[kind]
        weights, rest = jax.tree.leaves(p), iter(saved)
        leaves = [next(rest) if k is None else weights[k] for k in where]
        return jax.tree.unflatten(treedef, leaves)

    def forward(x_BLD, stacked):
        n = jax.tree.leaves(stacked)[0].shape[0]

        def body(carry, i):
            x_BLD, p = carry
            p_next = gather(_layer(stacked, i + 1))  # for the next iteration
            x_BLD, saved = saved_of(x_BLD, p)
            return (x_BLD, p_next), saved

        (x_BLD, p_last), saved_N = lax.scan(body, (x_BLD, gather(_layer(stacked, 0))),
                                            jnp.arange(n - 1))
        y_BLD, saved_last = saved_of(x_BLD, p_last, "last")
        return y_BLD, (saved_N, saved_last, stacked)

    def backward(res, dy_BLD):
        saved_N, saved_last, stacked = res
        n = jax.tree.leaves(stacked)[0].shape[0]
        last_vjp = lambda i, p: vjp_of(saved_last, p, "last")  # noqa: E731
        layer_vjp = lambda i, p: vjp_of([_row(s, i) for s in saved_N], p)  # noqa: E731
        p_last = gather(_layer(stacked, n - 1))
        p_prev = gather(_layer(stacked, n - 2))  # for the scan's first iteration
        dy_BLD, dstacked = _layer_grads(last_vjp, gather, stacked, n - 1, p_last, dy_BLD,
                                        jax.tree.map(jnp.zeros_like, stacked))
        return _backward_from(n - 2, p_prev, dy_BLD, dstacked, layer_vjp, gather, stacked)

    f = jax.custom_vjp(lambda x_BLD, stacked: forward(x_BLD, stacked)[0])
    f.defvjp(forward, backward)
    return f


def _layer_grads(layer_vjp, gather, stacked, i, p, dy_BLD, dstacked):
    """Layer i's backward: (dx [B, L, D], `dstacked` with layer i's weight grads
    reduce-scattered into row i). layer_vjp(i, whole weights) -> layer i's vjp; p:
    layer i's whole weights."""
    dx_BLD, dp = layer_vjp(i, p)(dy_BLD)
    _, gather_vjp = jax.vjp(gather, _layer(stacked, i))
    return dx_BLD, jax.tree.map(lambda d, g: lax.dynamic_update_index_in_dim(d, g, i, 0),
                                dstacked, gather_vjp(dp)[0])


def _backward_from(top, p_top, dy_BLD, dstacked, layer_vjp, gather, stacked):
    """Layers `top` down to 0 of a prefetching backward: a reverse scan whose body
    gathers layer i-1's weights for the next iteration while it runs layer i's backward
    (`_layer_grads`), then layer 0 after it. p_top: layer top's whole weights. Returns
    (dx [B, L, D], the stacked shards' grads)."""

    def body(carry, i):
        dy_BLD, p, dstacked = carry
        p_prev = gather(_layer(stacked, i - 1))  # for the next iteration
        dy_BLD, dstacked = _layer_grads(layer_vjp, gather, stacked, i, p, dy_BLD, dstacked)
        return (dy_BLD, p_prev, dstacked), None

    (dy_BLD, p0, dstacked), _ = lax.scan(body, (dy_BLD, p_top, dstacked),
                                         jnp.arange(1, top + 1), reverse=True)
    return _layer_grads(layer_vjp, gather, stacked, 0, p0, dy_BLD, dstacked)


def _row(stacked_N, i):
    """Row i of a stacked array: a static slice for a Python int (layer 0 after the
    backward scan), a dynamic one for a traced index (inside it)."""
    return stacked_N[i] if isinstance(i, int) else lax.dynamic_index_in_dim(
        stacked_N, i, keepdims=False)


def _layer(stacked: dict, i) -> dict:
    """Layer i's shards of the stacked params (i may be traced)."""
    return jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, i, keepdims=False), stacked)


def _prefetched_forward(layer, gather, x_BLD, stacked, save: bool = False):
    """Scan layers 0..N-2 with layer i+1 gathered in the body that computes layer i
    (`layer`: (x, whole weights) -> x): (x after layer N-2, layer N-1 gathered, and with
    `save` the [N, B, L, D] inputs of every layer, the last one written last). The scan walks indices into the stacked
    params and writes into one carried buffer, so nothing is sliced or concatenated
    (a copy on XLA:CPU)."""
    n = jax.tree.leaves(stacked)[0].shape[0]

    def body(carry, i):
        x_BLD, p, xs_NBLD = carry
        if save:
            xs_NBLD = lax.dynamic_update_index_in_dim(xs_NBLD, x_BLD, i, 0)
        p_next = gather(_layer(stacked, i + 1))  # for the next iteration
        return (layer(x_BLD, p), p_next, xs_NBLD), None

    # zeros_like keeps x's varying axes (a scan carry's type includes them)
    xs_NBLD = jnp.broadcast_to(jnp.zeros_like(x_BLD), (n, *x_BLD.shape)) if save else None
    (x_BLD, p_last, xs_NBLD), _ = lax.scan(
        body, (x_BLD, gather(_layer(stacked, 0)), xs_NBLD), jnp.arange(n - 1))
    if save:
        xs_NBLD = lax.dynamic_update_index_in_dim(xs_NBLD, x_BLD, n - 1, 0)
    return x_BLD, p_last, xs_NBLD


def prefetched_full_remat(layer, gather):
    """(x [B, L, D], stacked shards {name: [N, ...]}) -> x after N layers, with a
    hand-written backward so both directions prefetch and only layer inputs are saved.

    Forward: the prefetching scan, saving each layer's input x_i ([N, B, L, D]).
    Backward, layers N-1 down to 0: the body that differentiates layer i (its forward
    recomputed from x_i and the carried whole weights) gathers layer i-1's weights for
    the next iteration, then reduce-scatters layer i's weight grads (the gather's
    transpose; the forward `jax.vjp` traces for it is dead code, removed by XLA and
    by the cost ledger's DCE) into the carried [N, ...] grads. Each weight is gathered
    N times in each direction, as remat without prefetch does, but never waited on.
    With N = 2 both scans run once, XLA inlines them and merges each backward gather
    with the forward's gather of the same layer (one fewer gather per layer than the
    ledger counts)."""

    def forward(x_BLD, stacked):
        x_BLD, p_last, xs_NBLD = _prefetched_forward(layer, gather, x_BLD, stacked, True)
        return layer(x_BLD, p_last), (xs_NBLD, stacked)

    def backward(res, dy_BLD):
        xs_NBLD, stacked = res
        n = xs_NBLD.shape[0]
        layer_vjp = lambda i, p: jax.vjp(layer, xs_NBLD[i], p)[1]  # noqa: E731
        return _backward_from(n - 1, gather(_layer(stacked, n - 1)), dy_BLD,
                              jax.tree.map(jnp.zeros_like, stacked), layer_vjp, gather,
                              stacked)

    f = jax.custom_vjp(lambda x_BLD, stacked: forward(x_BLD, stacked)[0])
    f.defvjp(forward, backward)
    return f
