"""Fusion groups as XLA forms them on an accelerator (GPU, TPU), and the bytes each moves.

The ledger's per-equation `Row.bytes` is the XLA:CPU model (each jaxpr's loop-fusible
chains read their inputs and write their outputs once, nothing crosses a call). On an
accelerator XLA first inlines every call (`pjit`, `closed_call`, `remat`, custom_jvp /
custom_vjp bodies), then fuses across what were call boundaries:

- loop fusion: elementwise / layout ops (`ledger.FUSIBLE`) join their fusible
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

import math

import jax.numpy as jnp
from jax.extend import core as jcore

# Calls XLA inlines before fusing: their bodies join the caller's fusion scope.
INLINED = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
           "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


def nbytes(aval) -> int:
    return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize if hasattr(aval, "shape") else 0


class Domain:
    """Compute entries of one fusion scope, in program order, on canonical var keys."""

    def __init__(self):
        self.entries = []   # (row index, primitive, [(key, bytes)] in, [(key, bytes)] out)
        self.outs = set()   # keys the scope returns
        self._seen = {}     # op signature -> output keys (CSE)

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
               epilogue: bool = True) -> tuple[list, list]:
        """(group id per entry, bytes per entry) under the module doc's rules;
        `epilogue=False` forms no output fusion (a matmul is a library call that
        writes its product, as on GPU)."""
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
            if name not in joins and name not in reductions:
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
