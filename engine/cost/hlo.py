"""Read collectives out of compiled HLO text (`compiled.as_text()`), with how often each runs.

A collective inside a while body appears once in the text but runs trip-count times:
computations are parsed, and each one's multiplicity is propagated from ENTRY through
`while` (times `known_trip_count` from its backend_config), `call`, `conditional`
and fusion edges. Replica groups are read as listed device ids (jax 0.10's XLA) or as
named mesh axes, `replica_groups=mesh['a'=4,'b'=2] {'b'}` (jax 0.12's). Tuple-shaped (combined) collectives yield one `HloCollective` per
element, marked `combined`.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
               "pred": 1, "s64": 8, "u64": 8}

_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLEES = re.compile(r"(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# newer XLA (jax 0.12) names the mesh axes: replica_groups=mesh['a'=4,'b'=2] {'b'}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective (one tuple element of a combined one) of the compiled program.

    bytes: per-device buffer, as the ledger counts it (all-gather: output; reduce-scatter:
    input = output x group size; others: operand). groups: replica groups as a frozenset
    of frozensets of device ids. count: executions per step."""

    name: str
    kind: str
    dtype: str
    shape: tuple
    bytes: int
    groups: frozenset
    count: int
    combined: bool
    op_name: str


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    mult = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps[name]:
            trip = 1
            if " while(" in line:
                m = _TRIP.search(line)
                trip = int(m.group(1)) if m else 1
            callees = _CALLEES.findall(line)
            for group in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in group.split(",")]
            for callee in callees:
                if callee in comps:
                    step = trip if f"body=%{callee}" in line or f"body={callee}" in line else 1
                    mult[callee] = mult.get(callee, 0) + mult[name] * step
                    stack.append(callee)
    return mult


def _pair_groups(pairs: str) -> frozenset:
    """A collective-permute's devices grouped into the cycles its pairs form (a ring
    shift along a mesh axis: that axis' replica groups)."""
    parent: dict[int, int] = {}

    def root(d):
        while parent.setdefault(d, d) != d:
            d = parent[d]
        return d

    for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs):
        parent[root(int(a))] = root(int(b))
    comps: dict[int, set] = {}
    for d in list(parent):
        comps.setdefault(root(d), set()).add(d)
    return frozenset(frozenset(c) for c in comps.values())


def _mesh_groups(mesh: str, axes: str) -> frozenset:
    """Device groups of a collective over the named axes of a mesh whose device ids
    run row-major over its axes: each group varies the named axes, the others fixed."""
    sizes = [(name, int(n)) for name, n in re.findall(r"'([^']+)'=(\d+)", mesh)]
    names = re.findall(r"'([^']+)'", axes)
    ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes])
    order = [i for i, (name, _) in enumerate(sizes) if name not in names] + [
        [name for name, _ in sizes].index(name) for name in names]
    rows = ids.transpose(order).reshape(-1, math.prod(ids.shape[i] for i in order[-len(names):])
                                        if names else 1)
    return frozenset(frozenset(int(d) for d in row) for row in rows)


def _groups(rest: str) -> frozenset:
    named = _MESH_GROUPS.search(rest)
    if named:
        return _mesh_groups(named.group(1), named.group(2))
    m = _GROUPS.search(rest)
    if not m or not m.group(1):
        pairs = _PAIRS.search(rest)
        return _pair_groups(pairs.group(1)) if pairs else frozenset()
    return frozenset(frozenset(int(d) for d in g.split(",") if d)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))


def collectives(text: str) -> list[HloCollective]:
    """Every collective in the compiled module with its executions per step."""
    comps, entry = _computations(text)
    mult = _multiplicities(comps, entry)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, result, opcode, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            kind = opcode.removesuffix("-start")
            if kind not in KINDS or comp not in mult:
                continue
            groups = _groups(rest)
            size = max((len(g) for g in groups), default=1)
            arrays = _ARRAY.findall(result)
            if opcode.endswith("-start") and kind == "all-gather":
                arrays = arrays[len(arrays) // 2:]  # (operands, outputs) tuple
            m_op = _OP_NAME.search(rest)
            op_name = m_op.group(1) if m_op else ""
            for dtype, dims in arrays:
                shape = tuple(int(d) for d in dims.split(",") if d)
                nbytes = DTYPE_BYTES.get(dtype, 4)
                for d in shape:
                    nbytes *= d
                if kind == "reduce-scatter":
                    nbytes *= size
                out.append(HloCollective(name, kind, dtype, shape, nbytes, groups, mult[comp],
                                         len(arrays) > 1, op_name))
    return out
