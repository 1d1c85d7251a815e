"""Ledgers derived from shapes: trace a step's structure a few times, price every size.

Candidates that differ only in axis sizes (fsdp4xtp2, fsdp2xtp4, fsdp8xtp2 on 16 devices:
the same axes present, the same switches) trace to the same program up to the sizes of
its arrays and the trip counts of its scans. Every such number in a per-device program
is a global size (batch, sequence, a model dimension, a layer count) divided or
multiplied by some of the axis sizes: a monomial in them. `Structure` reads every such
number (each var's shape, each scan's length, each integer of an equation's params: a
broadcast's shape, a slice's limits; in one fixed walk of the jaxpr: `slots`) off k
traced programs of one structure, k the number of axes whose sizes vary, and solves, per
number, for its exponent in each axis size. Because every candidate of a structure has
the same device count n (and, in the planner, pp degree), the sizes' logarithms add up
to a constant: one axis is the rest's complement and k programs, spread in the others'
sizes (`independent`), fix the k unknowns (the value at the first and k-1 exponents).
`Structure.jaxpr(sizes)` rebuilds the traced jaxpr with every number at those sizes,
and engine/cost/ledger.py walks it as it walks a traced one, so FLOPs, bytes, the fusion
model and collective sizes come out of the same code.

A number that is not a monomial (a pipeline's 2(M + pp - 1) ticks, a block size capped
at a constant) shows as a non-integer exponent or a non-integer value (the planner
keeps the pp degree fixed within a structure for that, engine/planner/ledgers.py), and
sizes that make a dimension 1 that is more in the traced program may change the
program (jax and XLA:CPU treat dimensions of 1 apart): `Structure` then refuses
(`NotDerivable`) and the caller traces. `Structure.check` compares a derived ledger
with a traced one row by row (the planner checks one per structure).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.extend import core as jcore

from engine.cost.ledger import ledger
from engine.parallel.layout import Layout


class NotDerivable(Exception):
    """The traced programs do not determine this structure's numbers as monomials."""


class _Walk:
    """One walk over a closed jaxpr that visits every var's shape, every scan's length and
    every integer of an equation's params (a broadcast's shape, a slice's limits, a
    reshape's sizes, a collective's axis size: `_ints`) in a fixed order. With `values`
    None it records them (`seen`); with values it rebuilds the jaxpr with the numbers
    replaced, in the same order. Each equation is marked by a -1 in `seen` (`marks`)."""

    def __init__(self, values=None):
        self.values = None if values is None else iter(values)
        self.seen: list[int] = []
        self.kinds: list[str] = []  # what each number is, for the structure's signature
        self.marks: list[bool] = []  # which of `seen` mark an equation

    def number(self, d: int, kind: str) -> int:
        self.seen.append(int(d))
        self.kinds.append(kind)
        self.marks.append(False)
        return int(d) if self.values is None else int(next(self.values))

    def var(self, v, env: dict):
        aval = v.aval
        if isinstance(aval, jax.core.ShapedArray):
            shape = tuple(self.number(d, str(aval.dtype)) for d in aval.shape)
            if self.values is not None:
                aval = aval.update(shape=shape)
        if self.values is None:
            new = v
        else:
            new = jcore.DropVar(aval) if isinstance(v, jcore.DropVar) else jcore.Var(aval)
        env[v] = new
        return new

    def ints(self, value, kind: str):
        """An int param (not a bool), or a tuple of them nested, with each int a number."""
        if isinstance(value, tuple):
            return tuple(self.ints(x, kind) for x in value)
        return self.number(value, kind)

    def param(self, key, value):
        if isinstance(value, jcore.ClosedJaxpr):
            return jcore.ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
        if isinstance(value, jcore.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, (tuple, list)) and any(
                isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)) for x in value):
            return type(value)(self.param(key, x) for x in value)
        if key == "length" and isinstance(value, int):
            return self.number(value, "length")
        if key not in DEVICE_PARAMS and _ints(value):
            return self.ints(value, f"param {key}")
        return value

    def jaxpr(self, jaxpr):
        env: dict = {}
        constvars = [self.var(v, env) for v in jaxpr.constvars]
        invars = [self.var(v, env) for v in jaxpr.invars]
        eqns = []
        for e in jaxpr.eqns:
            self.kinds.append(e.primitive.name)
            self.seen.append(-1)
            self.marks.append(True)
            ins = [v if isinstance(v, jcore.Literal) else env[v] for v in e.invars]
            params = {k: self.param(k, p) for k, p in e.params.items()}
            outs = [self.var(v, env) for v in e.outvars]
            if self.values is not None:
                eqns.append(e.replace(invars=ins, outvars=outs, params=params))
        if self.values is None:
            return jaxpr
        outvars = [v if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
        return jaxpr.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)

    def closed(self, closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
        return jcore.ClosedJaxpr(self.jaxpr(closed.jaxpr), closed.consts)


# params of device indices, not sizes (a ring's (source, destination) pairs): a derived
# program keeps the traced one's, which nothing in the ledger reads
DEVICE_PARAMS = ("perm", "axis_index_groups")


def _ints(value) -> bool:
    """Whether a param is an int (not a bool) or a non-empty tuple of them, nested: the
    params that may hold sizes. The ledger reads shapes off the vars, but the fusion
    model's common-subexpression test compares params, so a derived program's must be
    its own (two broadcasts whose shapes coincide at the traced sizes differ at others)."""
    if isinstance(value, tuple):
        return bool(value) and all(_ints(x) for x in value)
    return isinstance(value, int) and not isinstance(value, bool)


def slots(closed: jcore.ClosedJaxpr) -> tuple[list[int], list[str], list[bool]]:
    """(every number of the jaxpr: var shapes, scan lengths and integer params, -1
    marking each equation; what each is: a dtype, "length", "param <key>", or the
    equation's primitive; which of them mark an equation)."""
    w = _Walk()
    w.closed(closed)
    return w.seen, w.kinds, w.marks


def independent(sizes: list[tuple[int, ...]], k: int) -> list[int] | None:
    """Indices of k of the size vectors (each the sizes of the k axes present) whose
    logarithms, less the first's, span the first k-1 axes' (the k-th is their
    complement in n); None when the vectors do not."""
    if not sizes:
        return None
    if k == 1:
        return [0]
    logs = np.log2(np.array(sizes, dtype=float))[:, : k - 1]
    picked, basis = [0], np.zeros((0, k - 1))
    for j in range(1, len(sizes)):
        trial = np.vstack([basis, logs[j] - logs[0]])
        if np.linalg.matrix_rank(trial, tol=1e-9) == len(trial):
            picked.append(j)
            basis = trial
            if len(picked) == k:
                return picked
    return None


class Structure:
    """The numbers of one structure's program as monomials in its axis sizes, fitted on
    k traced programs (k axes present). roles: the roles present, in a fixed order;
    traced: [(sizes of `roles`, closed jaxpr)], k of them (`independent`)."""

    def __init__(self, roles: tuple[str, ...], traced: list[tuple[tuple, object]]):
        self.roles = roles
        k = len(roles)
        if len(traced) != k:
            raise NotDerivable(f"{len(traced)} traced programs for {k} axes")
        read = [slots(closed) for _, closed in traced]
        first, kinds, marks = read[0]
        for values, other, _ in read[1:]:
            if other != kinds or len(values) != len(first):
                raise NotDerivable("the traced programs differ in more than sizes")
        self.base_sizes = np.array(traced[0][0], dtype=float)
        self.closed = traced[0][1]
        values = np.array([v for v, _, _ in read], dtype=float)  # [k programs, numbers]
        logs = np.log2(np.array([s for s, _ in traced], dtype=float))[:, : k - 1]
        a = logs[1:] - logs[0]  # [k-1, k-1]
        marks = np.array(marks)
        nums = values[:, ~marks]
        # a number the same in every traced program is a constant (exponents 0), as
        # the marks and an index param (an axis, a negative padding) are
        const = (nums == nums[0]).all(axis=0)
        if (nums[:, ~const] <= 0).any():
            raise NotDerivable("a number that varies is 0 or negative in some program")
        ratios = np.zeros((k - 1, nums.shape[1]))
        ratios[:, ~const] = np.log2(nums[1:, ~const]) - np.log2(nums[0, ~const])
        exps = np.linalg.solve(a, ratios) if k > 1 else np.zeros((0, ratios.shape[1]))
        if not np.allclose(exps, np.round(exps), atol=1e-6):
            raise NotDerivable("a number is not a monomial in the axis sizes")
        self.exps = np.round(exps)  # [k-1, numbers]
        self.marks = marks
        self.base = values[0]

    def numbers(self, sizes: tuple) -> np.ndarray:
        """Every number of the program at `sizes` (the roles' sizes, same n)."""
        if len(self.roles) > 1 and not math.isclose(
                math.prod(sizes), float(np.prod(self.base_sizes))):
            raise NotDerivable("another device count than the traced programs'")
        scale = np.log2(np.array(sizes, dtype=float)[: len(self.roles) - 1]) - np.log2(
            self.base_sizes[: len(self.roles) - 1])
        out = self.base.copy()
        base = self.base[~self.marks]
        vals = base * np.exp2(scale @ self.exps)
        varies = self.exps.any(axis=0)
        if not np.allclose(vals, np.round(vals), rtol=0, atol=1e-6):
            raise NotDerivable(f"sizes {sizes} give a fractional array size")
        if (varies & ((np.round(vals) <= 1) & (base > 1))).any():
            # a dimension of 1 (or 0) where the traced program has more: jax and XLA
            # treat those apart (broadcasts, free relayouts), so the program may differ
            raise NotDerivable(f"sizes {sizes} make a dimension 1")
        out[~self.marks] = np.round(vals)
        return out

    def derivable(self, sizes: tuple) -> bool:
        """Whether `numbers` derives the program at `sizes`."""
        try:
            self.numbers(sizes)
        except NotDerivable:
            return False
        return True

    def jaxpr(self, sizes: tuple) -> jcore.ClosedJaxpr:
        """The traced jaxpr rebuilt with every shape and scan length at `sizes`."""
        values = self.numbers(sizes)[~self.marks].astype(int)
        return _Walk(values).closed(self.closed)

    def ledger(self, layout: Layout):
        """The ledger rows of the program at `layout`'s sizes of `roles`."""
        return ledger(self.jaxpr(tuple(layout.degree(r) for r in self.roles)), layout)


def differences(derived: list, traced: list, rel: float = 0.0) -> list[str]:
    """What differs between two ledgers, row by row (empty when equal): the row count,
    or for a row any field of `Row` (its shape, count, axes, collective size, ...), the
    float ones (FLOPs, bytes, the fusion model's bytes) beyond `rel` relative."""
    if len(derived) != len(traced):
        return [f"{len(derived)} rows derived, {len(traced)} traced"]
    out = []
    for i, (d, t) in enumerate(zip(derived, traced)):
        for f in (f.name for f in dataclasses.fields(t)):
            a, b = getattr(d, f), getattr(t, f)
            same = math.isclose(a, b, rel_tol=rel) if isinstance(b, float) else a == b
            if not same:
                out.append(f"row {i} {t.primitive}: {f} {a} != {b}")
    return out
