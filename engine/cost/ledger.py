"""The plan: trace the real training step on an AbstractMesh and walk its jaxpr into rows.

`trace_step` builds `Trainer(cfg, tcfg, layout, layout.abstract_mesh())` and runs
`jax.make_jaxpr(trainer.train_step)` on `ShapeDtypeStruct`s, so any mesh size traces on
one CPU. `ledger` walks the jaxpr, recursing into pjit / shard_map / scan / remat /
custom_vjp / while / cond bodies and multiplying by scan trip counts, and emits one `Row`
per equation (per operand for multi-operand collectives). Inside shard_map every shape is
already per device, so every figure in a row is per device.

Phase comes from the equation's name stack: `rematted_computation` -> "recompute"
(remat re-running the forward inside the backward), a `transpose` transform -> "bwd",
the `reduce_grads` / `optimizer` scopes -> "update", anything else -> "fwd".

XLA:CPU hands a dot to its library with operands laid out [batch, M, K] x [batch, K, N]
(`relayout_order`); an operand whose dimensions are in another order is copied into
that layout first, a `copy` fusion of its own in the compiled step (medium tp8: the
[B·L, D] activations transposed for the weight grads, 0.43 s of a 5.9 s step in a
profiler trace). Each such operand and layout is a row of its own (`Row.relayout`),
once per fusion scope however many dots read it, as the compiled step shares one copy.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import math

import jax
import jax.numpy as jnp
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from engine.cost.fusion import (  # noqa: F401  (the op sets, as the ledger's)
    FREE,
    FUSIBLE,
    IN_PLACE_ROOTS,
    INLINED,
    MARKS,
    REDUCTIONS,
    SLICE_FUSIBLE,
    Domain,
    canon,
    io_bytes,
    loop_fusion_bytes,
    loop_fusion_sets,
    nbytes,
)
from engine.cost.rows import Row, dtype_name  # noqa: F401  (Row, as the ledger's)
from engine.cost.scan_rows import (  # noqa: F401  (scan_counts, as the ledger's)
    carry_copy_rows,
    scan_copy_rows,
    scan_counts,
    stack_slot_bytes,
    sub_jaxprs,
)
from layers.scopes import (  # the named scopes, outermost first
    PP_BACKWARD,
    PP_FORWARD,
    PP_SCOPES,
    PP_TICK,
    PP_WEIGHT,
    SCOPES,
)

PP_UNITS = (PP_FORWARD, PP_BACKWARD, PP_WEIGHT)  # the tick's units (engine/cost/pipeline.py)

# jaxpr primitive -> HLO collective kind. pvary moves nothing (it only marks a value as
# per-device for check_vma) and lowers to no HLO op: its rows carry 0 bytes.
COLLECTIVES = {
    "all_gather": "all-gather", "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce",
    "pmin": "all-reduce",
    "ppermute": "collective-permute",
    "all_to_all": "all-to-all",
    "pvary": None,
}
# Collectives XLA's common-subexpression elimination merges when one fusion scope holds
# two alike (same params, same operands): under remat the cp ring's recomputed forward
# and its backward shift the same K/V blocks in one loop body, and the compiled step
# sends them once (tests/test_audit.py `test_audit_clean_cp_ring`, remat full)
MERGED_COLLECTIVES = ("ppermute",)
# The kinds XLA:CPU runs in f32 when they are bf16 (its float normalization wraps them in
# converts): the audit's `cpu_bf16_collectives_in_f32` rule and the ledger's cast rows
# (`Row.widen`). A collective-permute or all-to-all moves bf16 as it is, except a permute
# whose received value is used in f32 alone: XLA moves that upcast ahead of it (the
# audit's `cpu_permute_sent_in_f32`; priced here as bf16).
WIDENED_KINDS = frozenset({"all-gather", "reduce-scatter", "all-reduce"})
# Elementwise / reduction ops costing one FLOP per element (of the larger side).
ARITH = {"add", "add_any", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log",
         "log1p", "logistic", "rsqrt", "sqrt", "tanh", "pow", "integer_pow", "square", "abs",
         "sign", "select_n", "reduce_sum", "reduce_max", "reduce_min", "cumsum", "erf",
         "sin", "cos", "eq", "ne", "ge", "gt", "le", "lt", "and", "or", "not", "clamp"}


def _shape_dtype_specs(cfg, tcfg):
    from engine.parallel.params import param_shapes
    from engine.run import optim

    params = param_shapes(cfg)
    opt_state = optim.state_shapes(tcfg, cfg)
    tokens_BL = jax.ShapeDtypeStruct((tcfg.batch, tcfg.seq + 1), jnp.int32)
    return params, opt_state, tokens_BL


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic garbage collector off for the block (back on after it, if it was
    on). A trace or a walk of the step allocates hundreds of thousands of objects that
    live till its end; the collector's passes over them, and over the heap jax's caches
    grow, took ~25% of a plan's tracing CPU time (8-device plan of `small`). What the
    block leaves unreachable is collected by the next pass after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def trace_step(cfg, tcfg, layout, parallel=None, pack=None) -> jcore.ClosedJaxpr:
    """The jaxpr of `Trainer.train_step` (the CLI's step) on `layout.abstract_mesh()`,
    with dead code removed as XLA removes it (e.g. the forward a `jax.vjp` traces only
    to take its transpose). pack: the Trainer's (its weight gather's 2-byte packing: the
    target's `Hardware.bf16_collectives_in_f32`; None: as this host's backend)."""
    from engine.config import ParallelConfig
    from engine.run.step import Trainer

    with paused_gc():
        trainer = Trainer(cfg, tcfg, layout, layout.abstract_mesh(),
                          parallel or ParallelConfig(), pack=pack)
        closed = jax.make_jaxpr(trainer.train_step)(*_shape_dtype_specs(cfg, tcfg))
        live, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return jcore.ClosedJaxpr(live, closed.consts)


def _phase_scope(stack: source_info_util.NameStack) -> tuple[str, str]:
    names = [e.name for e in stack.stack if isinstance(e, source_info_util.Scope)]
    transforms = [e.name for e in stack.stack if isinstance(e, source_info_util.Transform)]
    scope = next((n for n in names if n in SCOPES), "other")
    if "rematted_computation" in names:
        phase = "recompute"
    elif "transpose" in transforms:
        phase = "bwd"
    elif scope in ("reduce_grads", "optimizer"):
        phase = "update"
    else:
        phase = "fwd"
    return phase, scope


def _pp_scopes(stack: source_info_util.NameStack) -> tuple[str, ...]:
    return tuple(e.name for e in stack.stack
                 if isinstance(e, source_info_util.Scope) and e.name in PP_SCOPES)


def _axes(eqn) -> tuple[str, ...]:
    axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def widen_bytes(kind: str, nbytes_bf16: float, n: int) -> float:
    """Bytes XLA:CPU's casts around a bf16 collective of a `WIDENED_KINDS` kind and
    `nbytes_bf16` ledger bytes (the input; the output for an all-gather) over `n`
    devices move: its input read in
    bf16 and written in f32, the f32 result read and written back in bf16, 3 bytes an
    element each way; the side a reduce-scatter scatters or an all-gather gathers is
    1/n of the other. What the compiled step shows for fsdp8 `medium`: the layer's
    weight grads each converted to f32 (`convert_bitcast_fusion`), concatenated, an f32
    `reduce-scatter`, and a `wrapped_convert` of its shard back to bf16."""
    b = nbytes_bf16 / 2  # elements
    into, out = {"reduce-scatter": (3 * b, 3 * b / n), "all-gather": (3 * b / n, 3 * b),
                 "all-reduce": (3 * b, 3 * b)}[kind]
    return into + out


def _collective_rows(eqn, phase, scope, count, mesh_shape, pp=()) -> list[Row]:
    axes = _axes(eqn)
    size = math.prod(mesh_shape[a] for a in axes)
    kind = COLLECTIVES[eqn.primitive.name]
    rows = []
    for var_in, var_out in zip(eqn.invars, eqn.outvars):
        buf = var_out.aval if eqn.primitive.name.startswith("all_gather") else var_in.aval
        moved = 0 if kind is None or size == 1 else nbytes(buf)
        rows.append(Row(scope, phase, "collective", eqn.primitive.name, dtype_name(buf.dtype),
                        tuple(buf.shape), 0.0, float(moved), count, axes, size, pp=pp))
        if moved and buf.dtype == jnp.bfloat16 and kind in WIDENED_KINDS:
            rows.append(Row(scope, phase, "memory", "convert_element_type", "float32",
                            tuple(buf.shape), 0.0, widen_bytes(kind, moved, size), count,
                            fused_bytes=0.0, lib_bytes=0.0, pp=pp, widen=True))
    return rows


def _compute_row(eqn, phase, scope, count, moved: float, pp=()) -> Row:
    name = eqn.primitive.name
    ins = [v.aval for v in eqn.invars if hasattr(v.aval, "shape")]
    outs = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
    out = outs[0] if outs else ins[0]
    dot = None
    if name == "dot_general":
        dims = eqn.params["dimension_numbers"]
        k = math.prod(ins[0].shape[d] for d in dims[0][0])
        flops, kind, dtype = 2.0 * math.prod(out.shape) * k, "matmul", dtype_name(ins[0].dtype)
        dot = (tuple(ins[0].shape), tuple(ins[1].shape), dtype, dtype_name(ins[1].dtype),
               tuple(tuple(map(tuple, pair)) for pair in dims), dtype_name(out.dtype))
    else:
        elems = max([math.prod(a.shape) for a in ins + outs] or [0])
        flops = float(elems) if name in ARITH else 0.0
        kind, dtype = "memory", dtype_name(out.dtype)
    return Row(scope, phase, kind, name, dtype, tuple(out.shape), flops, float(moved), count,
               dot=dot, pp=pp)


def relayout_order(shape: tuple, dims, side: int) -> tuple[int, ...] | None:
    """The order of the dot operand's dimensions (`side` 0: lhs, 1: rhs) that XLA:CPU's
    dot library takes, [batch, free, contracting] for the lhs and [batch, contracting,
    free] for the rhs, or None when the operand is already in it (dimensions of size 1
    move freely: a bitcast)."""
    (lc, rc), (lb, rb) = dims
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    free = [d for d in range(len(shape)) if d not in contract and d not in batch]
    order = (*batch, *free, *contract) if side == 0 else (*batch, *contract, *free)
    moved = [d for d in order if shape[d] != 1]
    return None if moved == sorted(moved) else tuple(order)


def _relayout_rows(eqn, phase, scope, count, keys, seen: set, pp=()) -> list[Row]:
    """One row per operand of a dot_general `eqn` that XLA:CPU copies into its dot
    library's layout (`relayout_order`): the copy reads and writes the operand once.
    `keys`: the operands' canonical var keys; `seen`: (key, order) pairs of the fusion
    scope that already have a copy (updated)."""
    rows = []
    dims = eqn.params["dimension_numbers"]
    for side, (v, key) in enumerate(zip(eqn.invars[:2], keys)):
        order = relayout_order(v.aval.shape, dims, side)
        if order is None or (key is not None and (key, order) in seen):
            continue
        if key is not None:
            seen.add((key, order))
        rows.append(Row(scope, phase, "memory", "relayout", dtype_name(v.aval.dtype),
                        tuple(v.aval.shape[d] for d in order), 0.0, 2.0 * nbytes(v.aval),
                        count, pp=pp, relayout=True))
    return rows


def _kernel_row(eqn, phase, scope, count, body_rows, pp=()) -> Row:
    """The flash kernel an accelerator runs in place of the jnp key-block scan `eqn`:
    the scan's matmul FLOPs (every [L, T] tile of every key block), its operands and
    results as traffic, shape (J key blocks, T keys per block)."""
    flops = sum(r.flops * r.count for r in body_rows if r.kind == "matmul") / count
    # the scanned operands: key / value blocks [J, B, T, G, K]
    n_consts, n_carry = scan_counts(eqn)
    first = n_consts + n_carry
    blocks = [v.aval.shape for v in eqn.invars[first:] if len(getattr(v.aval, "shape", ())) == 5]
    block = blocks[0][2] if blocks else 1
    # what a flash kernel reads and writes: q, k, v, o (and lse, dO, dq, dk, dv); not
    # the causal masks (bool, formed in the kernel) nor operands of a score tile's shape
    # [B, G, R, L, T] (the body's largest matmul product): loop-invariant constants the
    # jnp scan hoists out of its body, or per-block fills of the masked scores that
    # partial evaluation splits off into a scan of their own and stacks [J, B, G, R,
    # L, T] (`_mask_scan`), which a flash kernel forms in registers
    tile = max((math.prod(r.shape) for r in body_rows if r.kind == "matmul"), default=0)

    def kernel_operand(v):
        shape = tuple(getattr(v.aval, "shape", ()))
        score_shaped = len(shape) >= 5 and shape[-1] == block \
            and math.prod(shape[-5:]) == tile
        return not isinstance(v, jcore.Literal) and v.aval.dtype != jnp.bool_ \
            and not score_shaped

    moved = sum(nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if kernel_operand(v))
    dtype = next((r.dot[2] for r in body_rows if r.dot), "float32")
    return Row(scope, phase, "attention", "flash_attention", dtype,
               (eqn.params["length"], block), flops, float(moved), count, pp=pp)


def _mask_scan(body: list[Row]) -> bool:
    """Whether the rows `body` of a scan in the attention scope are the known part of a
    key-block scan that partial evaluation split off: per key block the causal mask,
    whether any query sees the block and the constant fills of the masked scores (a
    forward's `jnp.where(mask, s, MASK_VALUE)` under `jax.vjp`), no matmul and no
    collective (a `pvary` marks, moves nothing). JAX hoists it out of the layer scan
    (loop-invariant residuals of the layers) and stacks its outputs [J, ..., L, T]; the
    compiled step builds the stacks once per forward (tests/test_cost_pp_masks.py), the
    target's flash kernel forms the masks in registers: rows of the jnp kernel
    (`Row.kernel`)."""
    return bool(body) and all(r.kind == "memory" or r.primitive == "pvary" for r in body)


def _tick_own(pp: tuple) -> bool:
    """Whether a row of scopes `pp` is in the tick but in none of its units."""
    return PP_TICK in pp and not set(pp) & set(PP_UNITS)


def _inherit_unit(rows: list[Row], start: int) -> None:
    """Give the rows from `start` on (a branch of one of the tick's slot conds) the
    branch's unit where they lack one. JAX hoists loop-invariant values out of a scan
    (the layer scan's masks, RoPE tables and positions under `jax.vjp`) with the name
    stack they had inside its body, which leaves out the scopes around the scan: the
    unit's among them. The branch runs one unit (engine/parallel/pipeline.py
    `slot_unit`): the unit scope its other rows carry."""
    units = {s for r in rows[start:] for s in r.pp if s in PP_UNITS}
    if len(units) != 1:
        return
    unit = units.pop()
    for i in range(start, len(rows)):
        pp = rows[i].pp
        if _tick_own(pp):
            at = pp.index(PP_TICK) + 1
            rows[i] = rows[i].replace(pp=(*pp[:at], unit, *pp[at:]))


def _costliest(rows: list[Row], bounds: list[int]) -> list[Row]:
    """The rows of a cond's costliest branch (most FLOPs, then most bytes), the
    branches being rows[bounds[k]:bounds[k + 1]]: a device runs one branch per
    execution. The cp ring's two (layers/kernels/context.py: a remote block's first
    keys against every query, or every key against the second queries) are alike in
    cost and one or the other runs at each ring step; a kernel's skip of a masked block
    (layers/kernels/blocked.py) has no rows, so its visible branch is counted, as for
    every execution it bounds."""
    parts = [rows[a:b] for a, b in itertools.pairwise(bounds)]
    return max(parts, key=lambda part: (sum(r.total_flops for r in part),
                                        sum(r.total_bytes for r in part)))


def _walk(jaxpr, stack, count, mesh_shape, rows, domain=None, alias=None, site=0,
          in_loop=False):
    """Rows of `jaxpr`'s equations into `rows`; compute rows join `domain` (a new one
    for the top call and for every loop body) for the accelerator fusion model.
    `in_loop`: `jaxpr` is a scan's body or inlined into one (`stack_slot_bytes`)."""
    own = domain is None
    if own:
        domain, alias = Domain(), {}
    fused, spilled = loop_fusion_sets(jaxpr)
    made = {v for e in jaxpr.eqns for v in e.outvars} if in_loop else set()
    labels = {}  # id of an equation's name stack -> (stack, phase, scope, pp scopes)
    for eqn in jaxpr.eqns:
        # equations share a few name stacks (objects the jaxpr keeps alive, so ids hold)
        got = labels.get(id(eqn.source_info.name_stack))
        if got is None:
            here = stack + eqn.source_info.name_stack
            got = labels[id(eqn.source_info.name_stack)] = (here, *_phase_scope(here),
                                                           _pp_scopes(here))
        here, phase, scope, pp = got
        subs = list(sub_jaxprs(eqn))
        name = eqn.primitive.name
        if name in MARKS:
            for ov, iv in zip(eqn.outvars, eqn.invars):
                alias[ov] = canon(iv, alias, site)
            continue
        if subs and name in INLINED and len(subs) == 1:
            sub = subs[0][0]
            inner_site = object()
            inner = {iv: canon(ov, alias, site) for iv, ov in zip(sub.invars, eqn.invars)
                     if not isinstance(ov, jcore.Literal)}
            _walk(sub, here, count, mesh_shape, rows, domain, inner, inner_site, in_loop)
            for ov, iv in zip(eqn.outvars, sub.outvars):
                key = canon(iv, inner, inner_site)
                if key is not None:
                    alias[ov] = key
            continue
        if subs:
            start = len(rows)
            slot = name == "cond" and _tick_own(pp)
            branches = []
            for sub, mult in subs:
                branch = len(rows)
                _walk(sub, here, count * mult, mesh_shape, rows,
                      in_loop=in_loop or name == "scan")
                branches.append(branch)
                if slot:
                    _inherit_unit(rows, branch)
            if name == "cond" and not slot:
                rows[start:] = _costliest(rows, [*branches, len(rows)])
            if name == "scan":
                rows.extend(scan_copy_rows(eqn, phase, scope, count, pp))
                rows.extend(carry_copy_rows(eqn, phase, scope, count, pp))
            body = rows[start:]
            if name == "scan" and scope == "attention" and _mask_scan(body):
                rows[start:] = [r.replace(kernel="blocked") for r in body]
            elif name == "scan" and scope == "attention" and any(
                    r.kind == "matmul" and len(r.shape) == 5 for r in body):
                # the key-block scan: its score tiles are [B, G, R, L, T]
                rows[start:] = [r.replace(kernel="blocked") for r in body]
                rows.append(_kernel_row(eqn, phase, scope, count, body, pp))
            continue
        if name in COLLECTIVES:
            if name in MERGED_COLLECTIVES:
                ins = [canon(v, alias, site) for v in eqn.invars]
                twin = domain.twin(name, eqn.params, ins)
                if twin is not None:  # XLA's CSE: the same shift of the same blocks, sent once
                    for v, key in zip(eqn.outvars, twin):
                        alias[v] = key
                    continue
                domain.remember(name, eqn.params, ins,
                                [canon(v, alias, site) for v in eqn.outvars])
            rows.extend(_collective_rows(eqn, phase, scope, count, mesh_shape, pp))
        else:
            rows.append(_compute_row(eqn, phase, scope, count,
                                     loop_fusion_bytes(eqn, fused, spilled), pp))
            slot = stack_slot_bytes(eqn, made) if in_loop else 0
            if slot:
                rows[-1] = rows[-1].replace(scan_stack=min(1.0, slot / max(rows[-1].bytes, 1)))
            in_b, out_b = io_bytes(eqn)
            ins = [(canon(v, alias, site), b) for v, b in zip(eqn.invars, in_b)]
            twin = domain.twin(name, eqn.params, [k for k, _ in ins]) if name in FUSIBLE \
                else None
            if twin is not None:  # XLA's CSE: the same op on the same operands, done once
                for v, key in zip(eqn.outvars, twin):
                    alias[v] = key
                rows[-1] = rows[-1].replace(fused_bytes=0.0, lib_bytes=0.0)
                continue
            outs = [(canon(v, alias, site), b) for v, b in zip(eqn.outvars, out_b)]
            if name in FUSIBLE:  # only these are merged (`twin`)
                domain.remember(name, eqn.params, [k for k, _ in ins], [k for k, _ in outs])
            domain.add(len(rows) - 1, name, [x for x in ins if x[0] is not None],
                       [x for x in outs if x[0] is not None])
            if name == "dot_general":
                rows.extend(_relayout_rows(eqn, phase, scope, count, [k for k, _ in ins],
                                           domain.relayouts, pp))
    if own:
        domain.outs = {canon(v, alias, site) for v in jaxpr.outvars}
        gid, moved = domain.groups(SLICE_FUSIBLE, REDUCTIONS, FREE, roots=IN_PLACE_ROOTS)
        lib_gid, lib_moved = domain.groups(SLICE_FUSIBLE, REDUCTIONS, FREE, epilogue=False,
                                           roots=IN_PLACE_ROOTS)
        for (i, *_), g, b, lg, lb in zip(domain.entries, gid, moved, lib_gid, lib_moved):
            rows[i] = rows[i].replace(fused_bytes=float(b), fusion=domain.entries[g][0],
                                      lib_bytes=float(lb), lib_fusion=domain.entries[lg][0])


def ledger(closed: jcore.ClosedJaxpr, layout) -> list[Row]:
    """Rows of every equation in the traced step, per device, with trip counts.

    while bodies count once (the step has none: layers scan, optax is loop-free) and
    a cond counts its costliest branch (`_costliest`), but the pipeline tick's own
    conds (its slots, one unit or idle) count every branch, which
    engine/cost/pipeline.py prices unit by unit. The pipeline's tick scan
    (engine/parallel/pipeline.py) is a switch over units and conds on the stage: its rows carry
    the pipeline scopes (`Row.pp`) that engine/cost/pipeline.py prices per unit."""
    rows: list[Row] = []
    with paused_gc():
        _walk(closed.jaxpr, source_info_util.NameStack(), 1, dict(layout.mesh_axes()), rows)
    return rows


def step_ledger(cfg, tcfg, layout, parallel=None, pack=None) -> list[Row]:
    """`ledger(trace_step(...))`: the plan of one training step (one pause of the
    garbage collector for both)."""
    with paused_gc():
        return ledger(trace_step(cfg, tcfg, layout, parallel, pack), layout)
