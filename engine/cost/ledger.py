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
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import math

import jax
import jax.numpy as jnp
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from engine.cost.fusion import (  # noqa: F401  (the op sets, as the ledger's)
    FREE, FUSIBLE, INLINED, MARKS, REDUCTIONS, Domain, canon, io_bytes, loop_fusion_bytes,
    loop_fusion_sets, nbytes,
)
from layers.scopes import PP_SCOPES, SCOPES  # the named scopes, outermost first

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
# Elementwise / reduction ops costing one FLOP per element (of the larger side).
ARITH = {"add", "add_any", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log",
         "log1p", "logistic", "rsqrt", "sqrt", "tanh", "pow", "integer_pow", "square", "abs",
         "sign", "select_n", "reduce_sum", "reduce_max", "reduce_min", "cumsum", "erf",
         "sin", "cos", "eq", "ne", "ge", "gt", "le", "lt", "and", "or", "not", "clamp"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One equation of the step, per device. `flops` and `bytes` are per execution;
    the step runs it `count` times (scan trip counts multiplied in).

    kind: "matmul" (dot_general), "memory" (elementwise, reductions, data movement),
    "collective", or "attention" (the flash kernel an accelerator runs in place of the
    jnp key-block scan, whose own rows carry `kernel="blocked"`; engine/cost/price.py
    prices one or the other). bytes: read + written for compute rows, under a loop-fusion model
    (`fusion.loop_fusion_bytes`: a chain of elementwise ops reads its inputs and writes
    its outputs once, as XLA's loop fusion does); for collectives the buffer
    each device holds before reducing / after gathering (all-gather: output, others:
    input), the `bytes` of the ring formulas.
    """

    scope: str
    phase: str
    kind: str
    primitive: str
    dtype: str
    shape: tuple
    flops: float
    bytes: float
    count: int
    axes: tuple = ()
    axis_size: int = 1
    # matmuls: (lhs shape, rhs shape, lhs dtype, rhs dtype, dimension_numbers, result
    # dtype), enough to re-run the same dot_general alone (engine/cost/microbench.py)
    dot: tuple | None = None
    # the accelerator fusion model (engine/cost/fusion.py): this row's share of its
    # fusion group's traffic, and the group's id (-1: not a compute row of a group)
    fused_bytes: float = -1.0
    fusion: int = -1
    # the same without epilogue fusion (a matmul is a library call writing its product:
    # GPU), and that group's id
    lib_bytes: float = -1.0
    lib_fusion: int = -1
    # "blocked": the row is inside the jnp flash kernel's key-block scan, which an
    # accelerator replaces by its own attention kernel (a `kind="attention"` row)
    kernel: str = ""
    # the pipeline scopes (layers.scopes.PP_SCOPES) on the row's name stack, outermost
    # first: which tick unit of engine/pipeline.py runs it (engine/cost/pipeline.py)
    pp: tuple = ()
    # the row is traffic XLA adds to lower a `lax.scan` to a loop (`_scan_copy_rows`:
    # the slices of its stacked inputs, the updates of its stacked outputs, their
    # zero-fills and upcasts), or the same traffic written in the body
    # (`_indexes_stack`: a row of a stack from outside the body read or written, as the
    # prefetching layer scans index their stacked weights and fill their carried
    # grads). Two consequences in pricing (engine/cost/price.py): the data is written
    # an iteration loop before it is read, so out of a host's caches
    # (`Hardware.cold_hbm`); and an eager framework's layer loop, which stacks and
    # slices nothing, does not move it
    scan_stack: bool = False

    def replace(self, **changes) -> Row:
        """`dataclasses.replace(self, **changes)` without its per-field loop (the walk
        makes one per compute row, pipeline pricing one per row of a pp ledger); the
        same Row."""
        new = object.__new__(Row)
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def total_flops(self) -> float:
        return self.flops * self.count

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


def _shape_dtype_specs(cfg, tcfg, trainer):
    from engine.params import param_shapes

    params = param_shapes(cfg)
    opt_state = jax.eval_shape(trainer.tx.init, params)
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
    from engine.step import Trainer

    with paused_gc():
        trainer = Trainer(cfg, tcfg, layout, layout.abstract_mesh(),
                          parallel or ParallelConfig(), pack=pack)
        closed = jax.make_jaxpr(trainer.train_step)(*_shape_dtype_specs(cfg, tcfg, trainer))
        live, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return jcore.ClosedJaxpr(live, closed.consts)


@functools.cache
def _dtype_name(dtype) -> str:
    """str(dtype), looked up: numpy formats a dtype's name anew each time."""
    return str(dtype)


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


def _collective_rows(eqn, phase, scope, count, mesh_shape, pp=()) -> list[Row]:
    axes = _axes(eqn)
    size = math.prod(mesh_shape[a] for a in axes)
    kind = COLLECTIVES[eqn.primitive.name]
    rows = []
    for var_in, var_out in zip(eqn.invars, eqn.outvars):
        buf = var_out.aval if eqn.primitive.name.startswith("all_gather") else var_in.aval
        moved = 0 if kind is None or size == 1 else nbytes(buf)
        rows.append(Row(scope, phase, "collective", eqn.primitive.name, _dtype_name(buf.dtype),
                        tuple(buf.shape), 0.0, float(moved), count, axes, size, pp=pp))
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
        flops, kind, dtype = 2.0 * math.prod(out.shape) * k, "matmul", _dtype_name(ins[0].dtype)
        dot = (tuple(ins[0].shape), tuple(ins[1].shape), dtype, _dtype_name(ins[1].dtype),
               tuple(tuple(map(tuple, pair)) for pair in dims), _dtype_name(out.dtype))
    else:
        elems = max([math.prod(a.shape) for a in ins + outs] or [0])
        flops = float(elems) if name in ARITH else 0.0
        kind, dtype = "memory", _dtype_name(out.dtype)
    return Row(scope, phase, kind, name, dtype, tuple(out.shape), flops, float(moved), count,
               dot=dot, pp=pp)


def _sub_jaxprs(eqn):
    """(jaxpr, trip multiplier) for every body an equation carries."""
    name = eqn.primitive.name
    mult = eqn.params["length"] if name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr, mult
            elif isinstance(item, jcore.Jaxpr):
                yield item, mult


def scan_counts(eqn) -> tuple[int, int]:
    """(consts, carry) operand counts of a `scan` equation: jax 0.10 names them in its
    params; newer jax keeps one flat tree of (consts, carry, xs) (`ft_in`)."""
    p = eqn.params
    if "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


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
    # the causal masks (bool, formed in the kernel) nor loop-invariant score-shaped
    # constants [..., L, T] the jnp scan hoists out of its body
    consts = eqn.invars[:n_consts]
    length = max((v.aval.shape[-2] for v in consts if len(getattr(v.aval, "shape", ())) == 5),
                 default=0)

    def kernel_operand(v):
        shape = getattr(v.aval, "shape", ())
        hoisted = len(shape) >= 5 and shape[-1] == block and shape[-2] == length \
            and any(v is c for c in consts)
        return not isinstance(v, jcore.Literal) and v.aval.dtype != jnp.bool_ and not hoisted

    moved = sum(nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if kernel_operand(v))
    dtype = next((r.dot[2] for r in body_rows if r.dot), "float32")
    return Row(scope, phase, "attention", "flash_attention", dtype,
               (eqn.params["length"], block), flops, float(moved), count, pp=pp)


@functools.cache
def cpu_upcasts_bf16_stacks() -> bool:
    """Whether this host's XLA:CPU upcasts a scan's bf16 stacked input whole to f32
    before the loop (jax 0.10's does, jax 0.12's does not): read off the compiled module
    of a four-step scan of a dot over a bf16 [4, 32, 32] stack, once per process."""
    from jax import lax

    from engine.cost import hlo

    def f(c_BD, w_NDD):
        def body(c_BD, w_DD):
            return jnp.dot(c_BD, w_DD, preferred_element_type=jnp.float32
                           ).astype(c_BD.dtype), None

        return lax.scan(body, c_BD, w_NDD)[0]

    on_cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    c, w = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on_cpu)
            for shape in ((16, 32), (4, 32, 32)))
    module = hlo.parse(jax.jit(f).lower(c, w).compile().as_text())
    return any(i.result.startswith("f32[4,32,32]") for i in module.computations[module.entry])


def _sliced_invars(jaxpr, targets) -> set:
    """The vars of `targets` (invars of `jaxpr`) that reach the operand of a
    `dynamic_slice`, in `jaxpr` or through the body of a call (`INLINED`: jit, ...)."""
    found = set()
    target = lambda v: not isinstance(v, jcore.Literal) and v in targets
    for e in jaxpr.eqns:
        if e.primitive.name == "dynamic_slice" and target(e.invars[0]):
            found.add(e.invars[0])
        elif e.primitive.name in INLINED:
            for sub, _ in _sub_jaxprs(e):
                inner = {iv: ov for iv, ov in zip(sub.invars, e.invars) if target(ov)}
                found |= {inner[v] for v in _sliced_invars(sub, set(inner))}
    return found


def _indexes_stack(eqn, made: set) -> bool:
    """Whether a loop body's equation reads one row of a stack with a `dynamic_slice`
    or writes one with a `dynamic_update_slice` (a piece of leading size 1 of an operand
    with a leading size above 1), the stack coming from outside the body (not in
    `made`, the vars the body computes): the body's own form of what a scan does to its
    stacked inputs and outputs, the same traffic (`Row.scan_stack`)."""
    name = eqn.primitive.name
    if name == "dynamic_slice":
        piece = eqn.outvars[0].aval
    elif name == "dynamic_update_slice":
        piece = eqn.invars[1].aval
    else:
        return False
    stack = eqn.invars[0]
    return (stack.aval.ndim >= 1 and stack.aval.shape[0] > 1 and piece.ndim == stack.aval.ndim
            and piece.shape[0] == 1 and stack not in made)


def _scan_copy_rows(eqn, phase, scope, count, pp=()) -> list[Row]:
    """What XLA adds when it lowers a `lax.scan` to a while loop, which the scan's jaxpr
    does not show, in the scan's own scope and phase:

    - each stacked output (ys) is a buffer filled with zeros before the loop (one write
      of the whole [N, ...] buffer per execution of the scan: a `broadcast_in_dim` row),
      into which each iteration writes its slice with a `dynamic_update_slice`;
    - each stacked input (xs) is sliced once per iteration with a `dynamic_slice`;
    - XLA:CPU of jax 0.10 upcasts a bf16 stacked input whole to f32 before the loop (a
      `convert_element_type` row reading the stack and writing it twice as wide), and
      each iteration slices the f32 stack and converts the slice back to bf16; jax
      0.12's slices the bf16 stack as it is (`cpu_upcasts_bf16_stacks` asks the host's).
      It does the same to a bf16 operand the body indexes itself (a loop-invariant
      operand reaching a `dynamic_slice`: the residual stacks of the prefetching layer
      scan's backward, `layers/block.py`), charged the same whole-stack convert; the
      body's own `dynamic_slice` row keeps its bf16 bytes.

    Both slices are priced as `fusion.io_bytes` prices the explicit ops: the update slice is
    written in place (read the update, write the slice), the input slice is read and
    written out, 2x the slice's bytes each. XLA:CPU fuses a slice with elementwise
    neighbours: an xs read only by fusible ops (not bitcasts: `FREE`) is sliced inside
    their loop fusion and a ys made by a fusible op used only there is written by it into
    the buffer, so those cost nothing beyond the rows of the body's own ops (which already
    read the slice or write the result). What `jax.jit(f).lower(...).compile().as_text()`
    shows on XLA:CPU for a scan of `c @ w`, `tanh` of it and `2 * c`, each stacked
    (tests/test_cost.py): a `dynamic-slice` fusion feeding the dot, one
    `dynamic-update-slice` fusion per stacked output aliasing the loop's buffer (the
    multiply inside its own), a `broadcast` of each stacked buffer in the entry; for a
    scan of a dot of bf16 `xs`, a `wrapped_convert` fusion of the whole f32[N, ...] stack
    in the entry and a `convert_bitcast_fusion` of the slice to bf16 in the loop, before
    the dot (tests/test_cost.py; jax 0.10's XLA:CPU).

    Accelerators (`Hardware.fusion`): XLA on TPU and GPU emits a scan's ys update as a
    dynamic-update-slice fused in place with the op producing the update, and fuses an
    xs dynamic-slice into its consumers as a producer, so the traffic is the producer's
    write and the consumer's read the fusion model already charges: these rows carry
    `fused_bytes = lib_bytes = 0` (their zero-fills are not charged there either). Not
    checked against an accelerator compiler here; a slice feeding a GPU library matmul
    (cuBLAS) or a library matmul's product stacked would be a copy of its own there."""
    body = eqn.params["jaxpr"].jaxpr
    length = eqn.params["length"]
    n_consts, n_carry = scan_counts(eqn)
    first = n_consts + n_carry
    consumers, producer = {}, {}
    for e in body.eqns:
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(e.primitive.name)
        for v in e.outvars:
            producer[v] = e
    uses = collections.Counter(v for v in body.outvars if not isinstance(v, jcore.Literal))
    rows = []

    def row(primitive, aval, moved, n):
        rows.append(Row(scope, phase, "memory", primitive, _dtype_name(aval.dtype),
                        tuple(aval.shape), 0.0, float(moved), n, fused_bytes=0.0,
                        lib_bytes=0.0, pp=pp, scan_stack=True))

    if cpu_upcasts_bf16_stacks():
        bf16 = {v for v in body.invars[:n_consts] if v.aval.dtype == jnp.bfloat16}
        for inner in sorted(_sliced_invars(body, bf16), key=body.invars.index):
            row("convert_element_type", inner.aval, 3 * nbytes(inner.aval), count)
    for outer, inner in zip(eqn.invars[first:], body.invars[first:]):
        names = consumers.get(inner, [])
        fused = bool(names) and all(n in FUSIBLE and n not in FREE for n in names) \
            and inner not in uses
        piece = nbytes(inner.aval)
        if inner.aval.dtype == jnp.bfloat16 and cpu_upcasts_bf16_stacks():
            # the stack upcast whole to f32 before the loop (read it, write it twice as
            # wide); each slice read from that, twice its bytes, and written back in
            # bf16 (its fusible consumers are charged the bf16 read: the rest is here)
            row("convert_element_type", outer.aval, 3 * piece * length, count)
            row("dynamic_slice", inner.aval, piece if fused else 3 * piece, count * length)
        elif not fused:
            row("dynamic_slice", inner.aval, 2 * piece, count * length)
    for outer, inner in zip(eqn.outvars[n_carry:], body.outvars[n_carry:]):
        row("broadcast_in_dim", outer.aval, nbytes(outer.aval), count)
        made = producer.get(inner)
        fused = (made is not None and made.primitive.name in FUSIBLE - FREE and uses[inner] == 1
                 and not consumers.get(inner))
        if not fused:
            row("dynamic_update_slice", inner.aval, 2 * nbytes(inner.aval), count * length)
    return rows


def _walk(jaxpr, stack, count, mesh_shape, rows, domain=None, alias=None, site=0,
          in_loop=False):
    """Rows of `jaxpr`'s equations into `rows`; compute rows join `domain` (a new one
    for the top call and for every loop body) for the accelerator fusion model.
    `in_loop`: `jaxpr` is a scan's body or inlined into one (`_indexes_stack`)."""
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
        subs = list(_sub_jaxprs(eqn))
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
            for sub, mult in subs:
                _walk(sub, here, count * mult, mesh_shape, rows,
                      in_loop=in_loop or name == "scan")
            if name == "scan":
                rows.extend(_scan_copy_rows(eqn, phase, scope, count, pp))
            body = rows[start:]
            if name == "scan" and scope == "attention" and all(
                    v.aval.dtype == jnp.bool_ for v in eqn.outvars):
                # the causal masks per key block, split off the forward scan by partial
                # evaluation: formed inside the target's kernel
                rows[start:] = [r.replace(kernel="blocked") for r in body]
            elif name == "scan" and scope == "attention" and any(
                    r.kind == "matmul" and len(r.shape) == 5 for r in body):
                # the key-block scan: its score tiles are [B, G, R, L, T]
                rows[start:] = [r.replace(kernel="blocked") for r in body]
                rows.append(_kernel_row(eqn, phase, scope, count, body, pp))
            continue
        if name in COLLECTIVES:
            rows.extend(_collective_rows(eqn, phase, scope, count, mesh_shape, pp))
        else:
            rows.append(_compute_row(eqn, phase, scope, count,
                                     loop_fusion_bytes(eqn, fused, spilled), pp))
            if in_loop and _indexes_stack(eqn, made):
                rows[-1] = rows[-1].replace(scan_stack=True)
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
    if own:
        domain.outs = {canon(v, alias, site) for v in jaxpr.outvars}
        gid, moved = domain.groups(FUSIBLE, REDUCTIONS, FREE)
        lib_gid, lib_moved = domain.groups(FUSIBLE, REDUCTIONS, FREE, epilogue=False)
        for (i, *_), g, b, lg, lb in zip(domain.entries, gid, moved, lib_gid, lib_moved):
            rows[i] = rows[i].replace(fused_bytes=float(b), fusion=domain.entries[g][0],
                                      lib_bytes=float(lb), lib_fusion=domain.entries[lg][0])


def ledger(closed: jcore.ClosedJaxpr, layout) -> list[Row]:
    """Rows of every equation in the traced step, per device, with trip counts.

    while bodies count once (the step has none: layers scan, optax is loop-free) and
    every branch of a cond is counted (an upper bound). The pipeline's tick scan
    (engine/pipeline.py) is a switch over units and conds on the stage: its rows carry
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
