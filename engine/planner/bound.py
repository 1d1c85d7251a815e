"""A lower bound on a program's priced step, from the model's dims and the layout, no trace.

The planner (engine/planner/search.py) prices programs in the order of this bound and
stops once the K-th best priced step is at most the smallest bound left: no program left
can reach the top K. The bound must never exceed the step `engine.cost.pipeline.predict_step`
prices from the traced ledger of any of the program's candidates (any order of its axes);
tests/test_plan_bound.py checks it over every kind of structure. It is the sum of two
parts of that step that no overlap in engine/cost/price.py hides:

- matmuls: the step's matmul FLOPs spread evenly over the devices (no layout does less
  per device than its share: replicated work only adds), each at the profile's matmul
  rate, `Hardware.matmul_rate` (`price.compute_seconds` prices a matmul at the max of
  that and its bytes at HBM rate); on a shared host the devices' work adds up as it does there.
  FLOPs: 2 per param per token for the forward, 4 for the backward, 2 more for the
  blocks' recompute under remat `full`; the head's 6 per param per token; with experts,
  `top_k` experts a token (times the capacity factor where it drops tokens). Attention
  (`attention_seconds`): the reference kernel's dots at the larger of their FLOPs and
  their score matrices' bytes, cp's dense tiles at the larger of theirs and the score
  traffic no fusion removes, or a flash kernel's rows as priced, its forward again
  where remat reruns it.
  With a pp axis on lock-step accelerators, the blocks' matmuls take 1 / (1 - bubble)
  as long, the bubble the schedule's table idles a stage (`Plan.bubble()`).
- collectives that run between dependent computations (`price.hideable` is False for
  them: exposed in full on every profile): the grad all-reduces over the data axes each
  param is replicated on (engine/parallel/grads.py `all_reduce_grads`, its specs from
  engine/parallel/zero.py) and the global norm's scalar all-reduces; tp's and cp's
  per-layer collectives of activations and zero 3's weight gathers (`activation_rows`),
  hideable ones at the least the overlap model leaves exposed. Each is priced
  by `price.collective_seconds`, its group innermost in the mesh (the order whose link
  tier is fastest: `price.domain_share`), so the bound holds for every order.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from jax.sharding import PartitionSpec as P

from collectives.ring import TP_COMMS
from engine.cost import price
from engine.cost.ledger import Row
from engine.parallel import params as param_table, pipeline, zero as zero_levels
from engine.parallel.grads import replicated_batch_axes, spec_axes
from engine.parallel.layout import AXIS_ROLES
from layers import roles, scopes
from layers.attention import cp_kernel

F32 = 4  # bytes of a grad element (params and their grads are f32)


def matmul_flops(cfg, tcfg) -> tuple[float, float]:
    """(the blocks' matmul FLOPs, the head's) of one step over all devices: 6 per param
    per token (forward 2, backward 4), 8 for the blocks under remat `full`; with experts
    the routed experts' params count `top_k` times, times the capacity factor when it
    is below 1 (dropped assignments are not computed)."""
    tokens = tcfg.batch * tcfg.seq
    dims = param_table._dims(cfg)
    block = 0.0
    for name, (letters, _, _) in param_table.table(cfg).items():
        if not name.startswith("blocks/") or letters in ("ND",):  # the norm scales
            continue
        n = math.prod(dims[c] for c in letters)
        if "E" in letters and name != "blocks/router":
            n = n / cfg.experts * cfg.top_k * (min(1.0, cfg.capacity_factor)
                                               if cfg.capacity_factor else 1.0)
        block += n
    passes = 8 if cfg.remat == "full" else 6
    return passes * block * tokens, 6.0 * cfg.d_model * cfg.padded_vocab * tokens


def best_matmul_rate(hw) -> float:
    """FLOP/s of the profile's fastest matmul dtype as the price runs it
    (`Hardware.matmul_rate`: its efficiency, and on a GPU the sustained clock)."""
    return max(hw.matmul_rate(d) for d in ("bfloat16", "float32"))


def attention_seconds(cfg, tcfg, hw, tiles: bool = False) -> float:
    """Seconds of the step's attention on all devices together (`attention_phases`
    summed)."""
    return sum(attention_phases(cfg, tcfg, hw, tiles).values())


def dense_tiles(cfg, layout, parallel) -> bool:
    """Whether the step's attention runs as dense score tiles, jnp rows the profile
    prices as they are, not as a flash kernel: the cp ring's tiles (`--cp-comm ring`
    with any local kernel but `blocked`, layers/kernels/context.py `ring_attention`) or
    the all-gather's dense reference kernel (`--cp-comm allgather`, the kernel `auto`
    names under cp, `allgather_attention`)."""
    if layout.degree("cp") == 1:
        return False
    kernel = cp_kernel(cfg.attention)
    return kernel != "blocked" if parallel.cp_comm == "ring" else kernel == "reference"


# Bytes per visible score element of the cp ring's dense tiles (layers/kernels/context.py
# `_block_stats`, `_block_grads`) that the fusion model (engine/cost/fusion.py) charges
# whatever it fuses: a matmul reads every operand, and an operand made outside its
# fusion is written there. Forward: the bf16 probabilities written and read by the P.V
# matmul (2 + 2). Backward: the f32 P written and read by dV's matmul (4 + 4), the f32 dS
# written and read by dQ's and by dK's matmul (4 + 4 + 4). Where a matmul's product
# is not fused into its consumers (`Hardware.epilogue_fusion` off: cuBLAS on GPUs) its
# f32 product is written and read back too: the scores (forward 4 + 4; backward,
# recomputed, 4 + 4) and dP (4 + 4).
RING_TILE_BYTES = {"fwd": 4.0, "bwd": 20.0}
RING_PRODUCT_BYTES = {"fwd": 8.0, "bwd": 16.0}
RING_TILE_DOTS = {"fwd": 2, "bwd": 5}  # QK, PV; QK again, dV, dP, dQ, dK


def kernel_rerun(cfg) -> bool:
    """Whether the backward runs a custom_vjp attention kernel's forward again (the flash
    kernels', the cp ring's): under remat `full`, and under `dots` too, as the kernel's
    residuals carry no name the policy saves and its output o is not saved
    (layers/block.py `REMAT_POLICIES`)."""
    return cfg.remat in ("full", "dots")


def ring_phases(cfg, tcfg, hw) -> dict:
    """{phase: seconds} of the cp ring's dense tiles on all devices together, each phase
    at the larger of its matmuls' FLOPs at the best matmul rate and its score-shaped
    bytes (`RING_TILE_BYTES`) at the HBM rate, over the visible (causal) scores alone:
    the ring computes at least those, masked or not. The all-gather's dense reference
    kernel computes more scores (each rank's second chunk against every key) and, its
    softmax differentiated by autodiff, moves more bytes a score: a bound of its rows
    too (tests/test_plan_bound.py)."""
    visible = tcfg.batch * cfg.n_heads * tcfg.seq * (tcfg.seq + 1) / 2 * cfg.n_layers
    dot = 2.0 * cfg.head_dim * visible
    rate, bw = best_matmul_rate(hw), hw.hbm * hw.mem_eff
    out = {}
    for phase in ("fwd", "bwd"):
        moved = RING_TILE_BYTES[phase] + (0.0 if hw.epilogue_fusion
                                          else RING_PRODUCT_BYTES[phase])
        out[phase] = max(RING_TILE_DOTS[phase] * dot / rate, moved * visible / bw)
    out["recompute"] = out["fwd"] if kernel_rerun(cfg) else 0.0
    return out


def attention_phases(cfg, tcfg, hw, tiles: bool = False) -> dict:
    """{phase: seconds} of the step's attention on all devices together, by phase (fwd,
    bwd, recompute). Under cp's dense tiles (`tiles`: `dense_tiles`; an accelerator
    profile: `hw.fusion`) `ring_phases`; with the reference kernel
    (`ModelConfig.attention`, the [B, H, L, L] scores materialized) its dots as
    `price.compute_seconds` prices a matmul: per layer the forward's 2 (scores,
    values), the backward's 4, the forward's again under remat `full`, each of 2 B L L
    H K FLOPs and moving at least one bf16 score matrix (B H L L x 2 bytes) where the
    profile prices a dot's own bytes (no epilogue fusion);
    else with a flash kernel (`hw.flash`) as `price.compute_seconds` prices a
    `kind="attention"` row (`price.attention_flops` at `price.attention_rate`): the
    forward's 4 B L L H K FLOPs, the backward's 8, the forward again where the backward
    reruns it (`kernel_rerun`); else 0."""
    if tiles and hw.fusion:
        return ring_phases(cfg, tcfg, hw)
    per = 2.0 * tcfg.batch * tcfg.seq * tcfg.seq * cfg.n_heads * cfg.head_dim * cfg.n_layers
    out = {"fwd": 0.0, "bwd": 0.0, "recompute": 0.0}
    if cfg.attention == "reference":
        recompute = cfg.remat == "full"
        rate = best_matmul_rate(hw)
        moved = 0.0 if hw.fusion and hw.epilogue_fusion else (
            2.0 * tcfg.batch * tcfg.seq * tcfg.seq * cfg.n_heads * cfg.n_layers)
        one = max(per / rate, moved / (hw.hbm * hw.mem_eff))
        return {"fwd": 2 * one, "bwd": 4 * one, "recompute": 2 * one * recompute}
    if not hw.flash:
        return out
    dtype = np.dtype(cfg.compute_dtype).name
    phases = [("fwd", 2 * per), ("bwd", 4 * per)] + ([("recompute", 2 * per)]
                                                      if kernel_rerun(cfg) else [])
    for phase, flops in phases:
        row = Row(scope=scopes.ATTENTION, phase=phase, kind="attention", primitive="flash",
                  dtype=dtype, shape=(1, tcfg.seq), flops=flops, bytes=0.0, count=1)
        out[phase] = price.attention_flops(row, hw) / price.attention_rate(row, hw)
    return out


def table(pp: int, schedule: str, microbatches: int, virtual: int, uniform: bool):
    """The schedule's table of a training step (`pipeline.step_plan`; `pipeline.plan`
    builds it once per shape)."""
    return pipeline.plan(pipeline.SCHEDULES[schedule], pp, microbatches, True, virtual,
                         uniform)


@functools.lru_cache(maxsize=4096)
def _bubble(pp: int, schedule: str, microbatches: int, virtual: int, uniform: bool) -> float:
    """The idle fraction of a stage under the schedule's table (`Plan.bubble()`)."""
    return table(pp, schedule, microbatches, virtual, uniform).bubble()


def compute_bound(cfg, tcfg, layout, parallel, hw) -> float:
    """Seconds of the step's matmuls, their FLOPs spread evenly over the devices at the
    profile's best matmul rate, and of its flash attention (module doc); 0 when the
    profile has measured dots (`Hardware.dot_seconds`, which may run faster than its
    rate)."""
    if hw.dot_seconds:
        return 0.0
    n = layout.size
    block, head = matmul_flops(cfg, tcfg)
    rate = best_matmul_rate(hw)
    block = block / rate + attention_seconds(cfg, tcfg, hw,
                                             dense_tiles(cfg, layout, parallel))
    head = head / rate
    if layout.degree("pp") > 1 and not hw.shared_host:  # lock-step ticks: a stage idles
        block /= 1 - _bubble(layout.degree("pp"), parallel.pp_schedule,
                             parallel.microbatches, parallel.pp_virtual,
                             pipeline.uniform_units(layout, parallel))
    per_device = (block + head) / n
    return per_device * (n if hw.shared_host and not hw.concurrent_rates else 1)


def _all_reduce(axes: tuple, sizes: dict, nbytes: float, dtype: str, count: int,
                scope: str, phase: str, primitive: str = "psum") -> Row | None:
    """A collective row (`primitive` over `axes`), None over one device."""
    n = math.prod(sizes[a] for a in axes)
    if n <= 1 or nbytes <= 0 or count <= 0:
        return None
    return Row(scope=scope, phase=phase, kind="collective", primitive=primitive,
               dtype=dtype, shape=(), flops=0.0, bytes=float(nbytes), count=count,
               axes=tuple(axes), axis_size=n)


def _local(shape: tuple, spec: P, sizes: dict) -> int:
    """Elements of one device's shard of a leaf of `shape` stored as `spec`."""
    out = 1
    for i, d in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = (entry,) if isinstance(entry, str) else (entry or ())
        out *= d // math.prod(sizes[a] for a in names)
    return out


def _step_axes(layout, parallel) -> tuple:
    """(the step's role axes, {role: size}, its ZeRO level) under `parallel`."""
    axes = layout.role_axes(tp_comm=TP_COMMS[parallel.tp_comm], cp_comm=parallel.cp_comm,
                            prefetch=parallel.prefetch, grad_reduce=parallel.grad_reduce)
    return axes, {r: layout.degree(r) for r in AXIS_ROLES}, zero_levels.level(parallel.zero,
                                                                              axes.fsdp)


def exposed_rows(cfg, tcfg, layout, parallel) -> list[Row]:
    """The collectives of the step that no overlap hides (module doc), as ledger rows."""
    axes, sizes, level = _step_axes(layout, parallel)
    shard_specs = param_table.param_specs(cfg, layout)
    grad_specs = level.grad_specs(level.storage_specs(shard_specs, axes.fsdp), shard_specs)
    dims = param_table._dims(cfg)
    rows = []
    for name, (letters, _, _) in param_table.table(cfg).items():
        spec = param_table._lookup(grad_specs, name)
        local = _local(tuple(dims[c] for c in letters), spec, sizes)
        rows.append(_all_reduce(replicated_batch_axes(spec, axes), sizes, local * F32,
                                "float32", 1, scopes.REDUCE_GRADS, "update"))
        rows.append(_all_reduce(spec_axes(spec), sizes, F32, "float32", 1,
                                scopes.REDUCE_GRADS, "update"))
    rows += activation_rows(cfg, tcfg, layout, parallel, axes, level, sizes)
    return [r for r in rows if r is not None]


def activation_rows(cfg, tcfg, layout, parallel, axes, level, sizes) -> list:
    """The step's collectives of activations and gathered weights, each as few and as
    small as the step's own (module doc), on one device: with pp, of its stage's N / pp
    layers for each of the M microbatches (a pipelined step's ticks sum at least one
    stage's units: engine/cost/pipeline.py) and the ticks' stage shifts (2 M of the
    microbatch's residual, its 1/tp), and nothing of the loss or zero 3.
    Without pp: the loss's scalar all-reduce over the data axes the model sees; tp's
    per layer, forward and backward, by `tp_comm`: 2
    all-reduces of the residual (allreduce), 2 all-gathers and 2 reduce-scatters of it
    (sequence), 4 (tp - 1) ring shifts of its 1/tp chunks (ring, hideable), and those
    of the forward's that the backward runs again (`_tp_rerun`); cp's per
    layer: K and V all-gathered in the forward and their grads reduce-scattered in the
    backward (allgather), or shifted cp - 1 times each way (ring, hideable); zero 3's
    per layer: its block weights all-gathered in the forward (hideable with prefetch),
    again in the backward where it does not keep them (`_regathers`), and their grads
    reduce-scattered in the backward (hideable), in the compute dtype."""
    m, pp = parallel.microbatches, sizes["pp"]
    n_layers = cfg.n_layers // pp * m  # per step, every layer of every microbatch
    rows = []
    seen = level.model_axes(axes)
    data = tuple(a for a in (getattr(seen, r) for r in roles.data_roles()) if a is not None)
    if pp == 1:
        rows.append(_all_reduce(data, sizes, F32, "float32", 1, scopes.LOSS, "fwd"))
    compute = np.dtype(cfg.compute_dtype)
    act = np.dtype(cfg.act_dtype)
    batch = tcfg.batch // m // math.prod(sizes[a] for a in roles.roles_sharding("batch"))
    seq = tcfg.seq // math.prod(sizes[a] for a in roles.roles_sharding("sequence"))
    residual = batch * seq * cfg.d_model * act.itemsize  # the tp group's whole residual
    tp = sizes["tp"]
    rows += _by_comm("tp", parallel.tp_comm, residual, act.name, 4 * n_layers, sizes)
    if pp == 1:
        rows += _tp_rerun(cfg, parallel.tp_comm, residual, act.name, n_layers, sizes)
    # a pipeline's stage shifts: each tick one forward and one backward, M ticks at least
    rows.append(_all_reduce(("pp",), sizes, residual // tp, act.name, 2 * m,
                            scopes.scope_of(()), "fwd", "ppermute"))
    kv_heads = cfg.n_kv_heads // tp if tp <= cfg.n_kv_heads else 1
    kv = batch * tcfg.seq * kv_heads * cfg.head_dim * compute.itemsize  # K or V, whole L
    rows += _by_comm("cp", parallel.cp_comm, kv, compute.name, 2 * n_layers, sizes)
    if axes.fsdp is not None and level.level == 3 and pp == 1:
        again = _regathers(cfg, parallel.prefetch) and (
            "bwd" if parallel.prefetch else "recompute")  # prefetched, or in the recompute
        rows += _fsdp_rows(cfg, layout, sizes, compute, n_layers, again or None)
    return rows


def unit_rows(cfg, tcfg, layout, parallel, phase: str) -> list:
    """The collectives one pipeline unit (one microbatch through one chunk of N / (pp V)
    layers) runs in `phase` ("fwd" or "bwd"), each as few and as small as the step's
    own, on one device: tp's per layer by `tp_comm`, half of `activation_rows`' (each
    phase has 2 of the 4 all-reduces, gathers and reduce-scatters, ring shifts); cp's:
    K and V all-gathered in the forward, their grads reduce-scattered in the backward
    (allgather), cp - 1 shifts of each in either (ring); zero 3's: the chunk's weight
    gathers in the forward, its grads' reduce-scatters in the backward."""
    axes, sizes, level = _step_axes(layout, parallel)
    layers = cfg.n_layers // (sizes["pp"] * parallel.pp_virtual)
    compute, act = np.dtype(cfg.compute_dtype), np.dtype(cfg.act_dtype)
    batch = (tcfg.batch // parallel.microbatches
             // math.prod(sizes[a] for a in roles.roles_sharding("batch")))
    seq = tcfg.seq // math.prod(sizes[a] for a in roles.roles_sharding("sequence"))
    residual = batch * seq * cfg.d_model * act.itemsize
    tp = sizes["tp"]
    kv_heads = cfg.n_kv_heads // tp if tp <= cfg.n_kv_heads else 1
    kv = batch * tcfg.seq * kv_heads * cfg.head_dim * compute.itemsize
    rows = _by_comm("tp", parallel.tp_comm, residual, act.name, 2 * layers, sizes)
    if parallel.cp_comm == "ring":
        rows += _by_comm("cp", "ring", kv, compute.name, layers, sizes)
    else:
        mine = "all_gather" if phase == "fwd" else "reduce_scatter"
        rows += [r for r in _by_comm("cp", parallel.cp_comm, kv, compute.name, 2 * layers,
                                     sizes) if r is not None and r.primitive == mine]
    if axes.fsdp is not None and level.level == 3:
        rows += [r for r in _fsdp_rows(cfg, layout, sizes, compute, layers)
                 if r is not None and r.phase == phase]
    return [r for r in rows if r is not None]


def _by_comm(axis: str, comm: str, nbytes: int, dtype: str, times: int, sizes) -> list:
    """The rows of `times` collectives of a buffer of `nbytes` over `axis` by `comm`:
    all-reduces (allreduce); all-gathers and reduce-scatters (sequence, allgather); or
    as a ring, each of them size - 1 shifts of 1/size of it, twice (ring)."""
    if comm == "allreduce":
        return [_all_reduce((axis,), sizes, nbytes, dtype, times, scopes.ATTENTION, "fwd")]
    if comm != "ring":
        return [_all_reduce((axis,), sizes, nbytes, dtype, times, scopes.ATTENTION, "fwd", p)
                for p in ("all_gather", "reduce_scatter")]
    n = sizes[axis]
    return [_all_reduce((axis,), sizes, nbytes // n, dtype, 2 * times * (n - 1),
                        scopes.ATTENTION, "fwd", "ppermute")]


def _tp_rerun(cfg, comm: str, nbytes: int, dtype: str, n_layers: int, sizes) -> list:
    """The forward's tp collectives the backward runs again, `n_layers` layers of them
    (layers/block.py: a column's gathered input is recomputed, not kept, and under remat
    `full` a row's reduction too; read off traced steps, tests/test_plan_bound.py):
    `sequence` 2 all-gathers a layer under every policy and 1 reduce-scatter more under
    `full`; `allreduce` 1 all-reduce a layer under `full`; `ring` the shifts of 2 ring
    gathers a layer under `dots`, of 3 under `full`."""
    n = sizes["tp"]
    if n <= 1:
        return []
    full = cfg.remat == "full"
    if comm == "sequence":
        out = [_all_reduce(("tp",), sizes, nbytes, dtype, 2 * n_layers, scopes.ATTENTION,
                           "recompute", "all_gather")]
        if full:
            out.append(_all_reduce(("tp",), sizes, nbytes, dtype, n_layers, scopes.ATTENTION,
                                   "recompute", "reduce_scatter"))
        return out
    if comm == "allreduce":
        return [_all_reduce(("tp",), sizes, nbytes, dtype, n_layers, scopes.ATTENTION,
                            "recompute")] if full else []
    passes = {"dots": 2, "full": 3}.get(cfg.remat, 0)
    return [_all_reduce(("tp",), sizes, nbytes // n, dtype, passes * (n - 1) * n_layers,
                        scopes.ATTENTION, "recompute", "ppermute")] if passes else []


def _regathers(cfg, prefetch: bool) -> bool:
    """Whether zero 3's backward gathers each layer's weights again (layers/block.py
    `blocks`): they are saved only without remat and without prefetch, or where the
    prefetched weights are carried as the scan differentiates it (a model with experts;
    one layer under `dots` or `none`)."""
    if not prefetch:
        return cfg.remat != "none"
    return not cfg.moe and (cfg.remat == "full" or cfg.n_layers > 1)


def _fsdp_rows(cfg, layout, sizes, compute, n_layers, again: str | None = None) -> list:
    """Zero 3's per-layer gathers of the block weights it shards (forward), the
    reduce-scatters of their grads (backward), and with `again` (a phase) their gathers
    again in that phase, each of the layer's fsdp-whole shards."""
    dims = param_table._dims(cfg)
    specs = param_table.param_specs(cfg, layout)
    whole = 0
    for name, (letters, _, _) in param_table.table(cfg).items():
        spec = param_table._lookup(specs, name)
        if not name.startswith("blocks/") or "fsdp" not in spec_axes(spec):
            continue
        kept = P(*(None if e in ("fsdp", "pp") else e for e in spec))  # one whole layer
        whole += _local(tuple(dims[c] for c in letters), kept, sizes) // cfg.n_layers
    nbytes = whole * np.dtype(compute).itemsize
    dtype = np.dtype(compute).name
    rows = [_all_reduce(("fsdp",), sizes, nbytes, dtype, n_layers, scopes.GATHER_PARAMS,
                        "fwd", "all_gather"),
            _all_reduce(("fsdp",), sizes, nbytes, dtype, n_layers, scopes.GATHER_PARAMS,
                        "bwd", "reduce_scatter")]
    if again:
        rows.append(_all_reduce(("fsdp",), sizes, nbytes, dtype, n_layers,
                                scopes.GATHER_PARAMS, again, "all_gather"))
    return rows


_SECONDS: dict = {}


def _seconds(row: Row, hw) -> float:
    """`price.collective_seconds` of one execution of `row`, its group innermost in the
    mesh (one axis of the group's size: the fastest link tier any order gives it)."""
    memo = _SECONDS.setdefault(id(hw), (hw, {}))[1]  # hw kept: its id stays its own
    key = (row.primitive, row.axis_size, row.bytes, row.dtype)
    if key not in memo:
        one = dataclasses.replace(row, axes=("group",))
        memo[key] = price.collective_seconds(one, hw, (("group", row.axis_size),))
    return memo[key]


def comm_bound(cfg, tcfg, layout, parallel, hw, rows: list | None = None) -> float:
    """Seconds of `exposed_rows` (`rows`, when given), each priced at its fastest link
    tier; a row the overlap model may hide (`price.hideable`) counts what it leaves
    exposed at the least: `hidden_comm_share` of it with overlap, else 1 + `beside_cost`
    times it."""
    rows = exposed_rows(cfg, tcfg, layout, parallel) if rows is None else rows
    return _exposed(rows, hw, parallel.prefetch, lambda r: _seconds(r, hw))


def _exposed(rows: list, hw, prefetch: bool, seconds) -> float:
    """Seconds of `rows`, each execution `seconds(row)`, a row the overlap model may
    hide counted at what it leaves exposed at the least (`comm_bound`)."""
    hidden = hw.hidden_comm_share if hw.overlap else 1 + hw.beside_cost
    return sum(seconds(r) * r.count * (hidden if price.hideable(r, prefetch) else 1.0)
               for r in rows)


def _seconds_at(row: Row, hw, mesh_axes, memo: dict) -> float:
    """`price.collective_seconds` of one execution of `row` on the mesh `mesh_axes` (one
    order of the axes), memoised by what it reads of the order: which of the group's
    devices share a fast domain (`price.domain_share`)."""
    if (mesh_axes, row.axes) not in memo:
        memo[mesh_axes, row.axes] = price.domain_share(hw, mesh_axes, row.axes)
    key = (row.primitive, row.axis_size, row.bytes, row.dtype, memo[mesh_axes, row.axes])
    if key not in memo:
        memo[key] = price.collective_seconds(row, hw, mesh_axes)
    return memo[key]


def order_bound(group: list, tcfg, hw) -> float:
    """`lower_bound` of a program's candidates `group` (its axes in every order the plan
    has), with the collectives of `exposed_rows` priced on each order's mesh and the
    least sum taken, where `lower_bound` gives each collective its own fastest order
    (two groups of a node's size cannot both sit inside a node). Tighter, and a bound
    still: every candidate's step is at least its own order's sum."""
    from engine.planner.pp_bound import pipeline_bound

    c = group[0]
    args = c.cfg, tcfg, c.layout, c.parallel, hw
    rows = exposed_rows(*args[:4])
    memo: dict = {}

    def on(axes):  # one execution of a row on the mesh `axes`
        return lambda r: _seconds_at(r, hw, axes, memo)

    comm = min(_exposed(rows, hw, c.parallel.prefetch, on(g.layout.mesh_axes()))
               for g in group)
    return max(compute_bound(*args) + comm, pipeline_bound(*args, rows))


def lower_bound(cand, tcfg, hw) -> float:
    """A lower bound on the priced step of `cand` (a planner Candidate) and of every
    candidate of its program (module doc); with a pp axis, the larger of that and the
    bound along the schedule's table (engine/planner/pp_bound.py)."""
    from engine.planner.pp_bound import pipeline_bound

    args = cand.cfg, tcfg, cand.layout, cand.parallel, hw
    rows = exposed_rows(*args[:4])
    return max(compute_bound(*args) + comm_bound(*args, rows), pipeline_bound(*args, rows))
