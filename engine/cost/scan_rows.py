"""What a `lax.scan` costs beyond its body's equations: the rows XLA adds to lower it
to a while loop (`scan_copy_rows`: its stacked inputs sliced, its stacked outputs filled,
bf16 stacks upcast on jax 0.10's XLA:CPU), and the body's own equations that do the same
to a stack from outside it (`stack_slot_bytes`), both `Row.scan_stack` rows; and the copies
XLA adds to keep a carried value the body still reads after it makes the new one
(`carry_copy_rows`, `Row.loop_copy`).
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from engine.cost.fusion import FREE, FUSIBLE, INLINED, nbytes
from engine.cost.rows import Row, dtype_name
from engine.parallel.backward_split import scan_counts  # noqa: F401  (the ledger's, liveness')


def sub_jaxprs(eqn):
    """(jaxpr, trip multiplier) for every body an equation carries."""
    name = eqn.primitive.name
    mult = eqn.params["length"] if name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr, mult
            elif isinstance(item, jcore.Jaxpr):
                yield item, mult


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


def sliced_invars(jaxpr, targets) -> set:
    """The vars of `targets` (invars of `jaxpr`) that reach the operand of a
    `dynamic_slice`, in `jaxpr` or through the body of a call (`INLINED`: jit, ...)."""
    found = set()
    target = lambda v: not isinstance(v, jcore.Literal) and v in targets
    for e in jaxpr.eqns:
        if e.primitive.name == "dynamic_slice" and target(e.invars[0]):
            found.add(e.invars[0])
        elif e.primitive.name in INLINED:
            for sub, _ in sub_jaxprs(e):
                inner = {iv: ov for iv, ov in zip(sub.invars, e.invars) if target(ov)}
                found |= {inner[v] for v in sliced_invars(sub, set(inner))}
    return found


def stack_slot_bytes(eqn, made: set) -> int:
    """Bytes of the stack's row a loop body's equation reads with a `dynamic_slice` or
    writes with a `dynamic_update_slice` (a piece of leading size 1 of an operand with a
    leading size above 1), the stack coming from outside the body (not in `made`, the
    vars the body computes): the body's own form of what a scan does to its stacked
    inputs and outputs, the same traffic (`Row.scan_stack`). 0 for any other equation."""
    name = eqn.primitive.name
    if name == "dynamic_slice":
        piece = eqn.outvars[0].aval
    elif name == "dynamic_update_slice":
        piece = eqn.invars[1].aval
    else:
        return 0
    stack = eqn.invars[0]
    indexes = (stack.aval.ndim >= 1 and stack.aval.shape[0] > 1
               and piece.ndim == stack.aval.ndim and piece.shape[0] == 1 and stack not in made)
    return nbytes(piece) if indexes else 0


def scan_copy_rows(eqn, phase, scope, count, pp=()) -> list[Row]:
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

    Both slices are priced as `fusion.io_bytes` prices the explicit ops: the update
    slice is written in place (read the update, write the slice), the input slice is
    read and written out, 2x the slice's bytes each, half of them the stack's
    (`Row.scan_stack`: the slot in the stack; the other half, the update read or the
    slice written, is the loop's working set); the zero-fills and whole-stack upcasts
    are all the stack's. XLA:CPU fuses a slice with elementwise neighbours: an xs read
    only by fusible ops (not bitcasts: `FREE`) is sliced inside their loop fusion and a
    ys made by a fusible op used only there is written by it into the buffer, so those
    cost nothing beyond the rows of the body's own ops (which already read the slice or
    write the result). What `jax.jit(f).lower(...).compile().as_text()` shows on XLA:CPU
    for a scan of `c @ w`, `tanh` of it and `2 * c`, each stacked (tests/test_cost.py):
    a `dynamic-slice` fusion feeding the dot, one `dynamic-update-slice` fusion per
    stacked output aliasing the loop's buffer (the multiply inside its own), a
    `broadcast` of each stacked buffer in the entry; for a scan of a dot of bf16 `xs`, a
    `wrapped_convert` fusion of the whole f32[N, ...] stack in the entry and a
    `convert_bitcast_fusion` of the slice to bf16 in the loop, before the dot
    (tests/test_cost.py; jax 0.10's XLA:CPU).

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

    def row(primitive, aval, moved, n, in_stack=None):
        """in_stack: the bytes of `moved` that are the stack's (default all)."""
        share = 1.0 if in_stack is None else in_stack / moved
        rows.append(Row(scope, phase, "memory", primitive, dtype_name(aval.dtype),
                        tuple(aval.shape), 0.0, float(moved), n, fused_bytes=0.0,
                        lib_bytes=0.0, pp=pp, scan_stack=share))

    if cpu_upcasts_bf16_stacks():
        bf16 = {v for v in body.invars[:n_consts] if v.aval.dtype == jnp.bfloat16}
        for inner in sorted(sliced_invars(body, bf16), key=body.invars.index):
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
            # unfused: the f32 slot read (2 pieces) and the bf16 slice written
            row("dynamic_slice", inner.aval, piece if fused else 3 * piece, count * length,
                None if fused else 2 * piece)
        elif not fused:
            row("dynamic_slice", inner.aval, 2 * piece, count * length, piece)
    for outer, inner in zip(eqn.outvars[n_carry:], body.outvars[n_carry:]):
        row("broadcast_in_dim", outer.aval, nbytes(outer.aval), count)
        made = producer.get(inner)
        fused = (made is not None and made.primitive.name in FUSIBLE - FREE and uses[inner] == 1
                 and not consumers.get(inner))
        if not fused:
            row("dynamic_update_slice", inner.aval, 2 * nbytes(inner.aval), count * length,
                nbytes(inner.aval))
    return rows


def _ancestors(eqns, producer: dict, var) -> set:
    """Indices of the equations `var` depends on (its producer and theirs), in one body."""
    seen, todo = set(), [var]
    while todo:
        v = todo.pop()
        k = producer.get(v)
        if k is None or k in seen:
            continue
        seen.add(k)
        todo.extend(u for u in eqns[k].invars if not isinstance(u, jcore.Literal))
    return seen


def carry_copy_rows(eqn, phase, scope, count, pp=()) -> list[Row]:
    """The copies XLA adds to a `lax.scan`'s loop body to keep a carried value, one per
    carry whose old value the body reads somewhere the new value does not depend on (or
    stacks as an output): the new value cannot be written over the old one in place, so
    XLA:CPU's copy insertion copies it every iteration, read and written once (an
    in-cache `copy` row, `Row.loop_copy`, in the scan's scope and phase).

    The prefetching layer scans (layers/block.py) carry each layer's gathered weights and
    replace them by the next layer's gather while the layer's compute still reads them,
    and every remat scan stacks its carried input for the backward: on fsdp8 `small`
    (zero 3, remat full) XLA:CPU's compiled forward and backward loop bodies each copy
    the nine carried weights and the [B, L, D] carry with prefetch, and the carry
    without it. A body whose new value depends on every read of the old one (x ->
    f(x), a buffer updated in place) gets no row. A body that makes the new value from
    scratch can get two copies from XLA, the old value's and the new one's; one is
    counted. On a fusion profile the rows move nothing (not checked against an
    accelerator compiler); an eager framework has no loop to copy for."""
    body = eqn.params["jaxpr"].jaxpr
    n_consts, n_carry = scan_counts(eqn)
    carry_in, carry_out = body.invars[n_consts:n_consts + n_carry], body.outvars[:n_carry]
    stacked = {v for v in body.outvars[n_carry:] if not isinstance(v, jcore.Literal)}
    producer = {v: k for k, e in enumerate(body.eqns) for v in e.outvars}
    readers = collections.defaultdict(list)
    for k, e in enumerate(body.eqns):
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                readers[v].append(k)
    rows = []
    for old, new in zip(carry_in, carry_out):
        if isinstance(new, jcore.Literal) or new is old or not hasattr(new.aval, "shape"):
            continue
        before = _ancestors(body.eqns, producer, new)
        if old in stacked or any(k not in before for k in readers[old]):
            moved = 2 * nbytes(new.aval)
            rows.append(Row(scope, phase, "memory", "copy", dtype_name(new.aval.dtype),
                            tuple(new.aval.shape), 0.0, float(moved),
                            count * eqn.params["length"], fused_bytes=0.0, lib_bytes=0.0,
                            pp=pp, loop_copy=True))
    return rows
