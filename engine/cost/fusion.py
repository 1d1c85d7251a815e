"""The two fusion models of the ledger's bytes, and the op sets they share.

`Row.bytes` is the XLA:CPU model (`loop_fusion_sets`, `loop_fusion_bytes`: each jaxpr's
loop-fusible chains read their inputs and write their outputs once, nothing crosses a
call). Fusion groups as XLA forms them on an accelerator (GPU, TPU), and the bytes each
moves, give `Row.fused_bytes` (`Domain`). On an accelerator XLA first inlines every
call (`pjit`, `closed_call`, `remat`, custom_jvp / custom_vjp bodies), then fuses across
what were call boundaries:

- loop fusion: elementwise / layout ops (`FUSIBLE`) join their fusible
  producers: one kernel reads the chain's inputs and writes what leaves it;
- input fusion: a reduction joins the elementwise chain feeding it (the chain is
  never written; the reduced result is);
- output (epilogue) fusion, TPU only: the elementwise consumers of a matmul join it
  when every consumer of its result is fusible, so the f32 product is not written and
  re-read (one matmul per fusion: a chain fed by two matmuls takes the first one met).
  XLA:TPU emits a dot as a "convolution fusion" kernel that takes elementwise producers
  and consumers into it. XLA:GPU emits a dot as a cuBLAS / cuBLASLt call
  (`GemmRewriter`, xla/service/gpu/transforms/gemm_rewriter.cc), which fuses only a
  scale, a bias add and a ReLU / GELU epilogue; no other consumer of its product joins
  it (a SwiGLU's silu(g)·u, a cast, a residual add are a separate loop fusion that
  reads the product back), so `Hardware.epilogue_fusion` is False on GPU profiles.

- slices in place: a dynamic slice fuses like the elementwise ops (reading its
  slice of the operand), and a dynamic-update-slice is the root of a loop fusion that
  takes in the producers of its update and writes only the update into the operand's
  buffer, in place; nothing consumes it inside a fusion. XLA:GPU counts both among
  the loop-fusible ops (`IsUniversallyLoopFusible`, xla/service/gpu/gpu_fusible.cc)
  and emits a loop fusion whose roots are dynamic-update-slices with the in-place
  emitter, whose threads cover the update's shape (`InPlaceDynamicUpdateSliceFusion`,
  xla/backends/gpu/codegen/emitters/in_place_dynamic_update_slice.h, chosen in
  xla/backends/gpu/codegen/fusions.cc); XLA:CPU forms the same
  `dynamic-update-slice` fusions (tests/test_cost_pp_masks.py's compiled step). XLA:TPU
  is not public: assumed alike. The XLA:CPU byte model (`Row.bytes`) keeps both apart.

A `Domain` is one fusion scope: the body of a `shard_map`, `scan`, `while` or `cond`
(loop bodies are separate computations to XLA, so nothing fuses across them). Each
compute row of a domain gets a fusion id and its share of the group's traffic:

    group bytes = sum of distinct inputs produced outside the group (or arguments)
                + sum of outputs consumed outside the group (or results of the domain)

with each input charged once per group (to the first member reading it). Matmuls read
every operand. FLOPs are untouched. An elementwise op identical to an earlier one (same
primitive, params and operands: the einsum wrapper casts one norm output to bf16 once
per projection) is merged into it, as XLA's CSE does, and moves nothing.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax.extend import core as jcore

# Ops XLA turns into bitcasts or folds away: no FLOPs, no bytes. (`broadcast_in_dim` is
# not free: fused it costs nothing, but a broadcast feeding a loop or a dot, such as the
# zeros a scan's gradient accumulators start from, is written to memory.)
FREE = {"reshape", "squeeze", "expand_dims", "stop_gradient", "axis_index", "iota",
        "copy_p", "optimization_barrier", "pjit", "closed_call"}
# Ops that only mark their operand (`checkpoint_name` for a remat policy): no row, and
# their output is their operand, for the fusion models too.
MARKS = {"name"}
# Ops XLA fuses into one loop with their elementwise neighbours (loop fusion).
FUSIBLE = {"add", "add_any", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log",
           "log1p", "logistic", "rsqrt", "sqrt", "tanh", "pow", "integer_pow", "square", "abs",
           "sign", "select_n", "erf", "sin", "cos", "eq", "ne", "ge", "gt", "le", "lt", "and",
           "or", "not", "clamp", "convert_element_type", "broadcast_in_dim", "reshape",
           "squeeze", "expand_dims", "iota", "concatenate", "split", "slice", "transpose",
           "stop_gradient", "pvary"}
# Ops whose output is their operand under loop fusion (bitcasts and marks): fused only
# where the operand is, and what needs their output in memory needs the operand there.
PASS_THROUGH = MARKS | (FREE & FUSIBLE)
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}
# The accelerator model's (`Domain.groups`): the loop-fusible ops and dynamic slices,
# and the ops a loop fusion ends with, writing in place (module doc).
SLICE_FUSIBLE = FUSIBLE | {"dynamic_slice"}
IN_PLACE_ROOTS = {"dynamic_update_slice"}
# Calls XLA inlines before fusing: their bodies join the caller's fusion scope.
INLINED = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
           "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


@functools.cache
def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def nbytes(aval) -> int:
    return math.prod(aval.shape) * _itemsize(aval.dtype) if hasattr(aval, "shape") else 0


# -- the XLA:CPU model: loop fusion inside one jaxpr (`Row.bytes`) --------------------


def io_bytes(eqn) -> tuple[list[int], list[int]]:
    """Bytes of each operand read and each result written. A slice of a large buffer
    touches only the slice: `slice` / `dynamic_slice` read their result's worth of their
    operand, and `dynamic_update_slice` / `scatter` (`.at[i].set`) write their updates
    into the operand in place (XLA aliases the buffer with the result: the scans' stacked
    residuals and grads, the pipeline's stash, are never copied), so the buffer is
    neither read nor written whole."""
    ins = [nbytes(v.aval) for v in eqn.invars]
    outs = [nbytes(v.aval) for v in eqn.outvars]
    name = eqn.primitive.name
    if name in ("slice", "dynamic_slice"):
        ins[0] = outs[0]
    elif name == "dynamic_update_slice":  # operand, update, *start indices
        ins[0], outs[0] = 0, ins[1]
    elif name == "scatter":  # operand, indices, updates
        ins[0], outs[0] = 0, ins[2]
    return ins, outs


def loop_fusion_bytes(eqn, fused_vars: set, spilled_vars: set) -> float:
    """Bytes an equation moves under loop fusion: inputs produced inside a fused chain
    are not re-read, the others are read as `io_bytes` counts them (a `slice` only its
    result's worth of its operand, as the loop indexes it); outputs only consumed by
    fusible ops or reductions are not written. Matmuls and everything else read and
    write all operands (`io_bytes`)."""
    name = eqn.primitive.name
    if name in FREE:
        return 0.0
    if name not in FUSIBLE and name not in REDUCTIONS:
        return float(sum(sum(b) for b in io_bytes(eqn)))
    reads = sum(b for v, b in zip(eqn.invars, io_bytes(eqn)[0])
                if not isinstance(v, jcore.Literal) and v not in fused_vars)
    writes = sum(nbytes(v.aval) for v in eqn.outvars
                 if name in REDUCTIONS or v in spilled_vars)
    return float(reads + writes)


def loop_fusion_sets(jaxpr) -> tuple[set, set]:
    """(vars produced by fusible ops, fusible outputs that must reach memory). A free op
    (a reshape: a bitcast in XLA) or a mark passes its operand on: its output is fused
    only where its operand is (a reshaped matmul product is still read from memory), and
    between a fusible producer and a consumer that reads memory the producer's output is
    written."""
    fused, spilled = set(), set(v for v in jaxpr.outvars if not isinstance(v, jcore.Literal))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in PASS_THROUGH:
            if all(isinstance(v, jcore.Literal) or v in fused for v in eqn.invars):
                fused.update(eqn.outvars)
        elif eqn.primitive.name in FUSIBLE:
            fused.update(eqn.outvars)
        elif eqn.primitive.name not in REDUCTIONS:
            spilled.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name in PASS_THROUGH and any(v in spilled for v in eqn.outvars):
            spilled.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return fused, spilled & fused

class Domain:
    """Compute entries of one fusion scope, in program order, on canonical var keys."""

    def __init__(self):
        self.entries = []   # (row index, primitive, [(key, bytes)] in, [(key, bytes)] out)
        self.outs = set()   # keys the scope returns
        self._seen = {}     # op signature -> output keys (CSE)
        self.relayouts = set()  # (operand key, order) of the dot operand copies (ledger)

    def _signature(self, name, params, in_keys):
        return (name, tuple(in_keys), tuple(sorted((k, str(v)) for k, v in params.items())))

    def twin(self, name, params, in_keys):
        """Output keys of an earlier identical op (same primitive, params and operands),
        which XLA's common-subexpression elimination keeps in its place; else None."""
        return self._seen.get(self._signature(name, params, in_keys))

    def remember(self, name, params, in_keys, out_keys):
        self._seen.setdefault(self._signature(name, params, in_keys), out_keys)

    def add(self, row_index: int, name: str, ins, outs):
        self.entries.append((row_index, name, list(ins), list(outs)))

    def groups(self, fusible: set, reductions: set, free: set,
               epilogue: bool = True, roots: set = frozenset()) -> tuple[list, list]:
        """(group id per entry, bytes per entry) under the module doc's rules;
        `epilogue=False` forms no output fusion (a matmul is a library call that
        writes its product, as on GPU); `roots` join the fusible producers of every
        operand but their first (the buffer they update in place) and no consumer."""
        n = len(self.entries)
        parent = list(range(n))
        has_dot = [e[1] == "dot_general" for e in self.entries]

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def union(i, j):
            a, b = find(i), find(j)
            if a == b or (has_dot[a] and has_dot[b]):
                return
            parent[b] = a
            has_dot[a] = has_dot[a] or has_dot[b]

        producer, consumers = {}, {}
        for i, (_, _, ins, outs) in enumerate(self.entries):
            for key, _ in ins:
                consumers.setdefault(key, []).append(i)
            for key, _ in outs:
                producer[key] = i
        joins = fusible | free

        def epilogue_only(key):
            cs = consumers.get(key, [])
            return cs and key not in self.outs and all(self.entries[c][1] in joins for c in cs)

        for i, (_, name, ins, _) in enumerate(self.entries):
            if name in roots:
                ins = ins[1:]
            elif name not in joins and name not in reductions:
                continue
            for key, _ in ins:
                p = producer.get(key)
                if p is None:
                    continue
                pname = self.entries[p][1]
                if pname in joins:
                    union(p, i)
                elif (epilogue and pname == "dot_general" and name in joins
                      and epilogue_only(key)):
                    union(p, i)
        gid = [find(i) for i in range(n)]
        moved = [0.0] * n
        read = {}  # group -> keys already charged
        for i, (_, name, ins, outs) in enumerate(self.entries):
            if name in free:
                continue
            g = gid[i]
            seen = read.setdefault(g, set())
            for key, b in ins:
                p = producer.get(key)
                if (p is None or gid[p] != g) and key not in seen:
                    seen.add(key)
                    moved[i] += b
            for key, b in outs:
                if key in self.outs or any(gid[c] != g for c in consumers.get(key, [])):
                    moved[i] += b
        return gid, moved


def canon(v, alias: dict, site):
    """The var's key in its fusion scope: an argument of an inlined call is its caller's
    var; a var of a body walked at several call sites is keyed by the site."""
    if isinstance(v, jcore.Literal):
        return None
    return alias.get(v, (site, v))
