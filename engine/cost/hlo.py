"""Read collectives out of compiled HLO text (`compiled.as_text()`), with how often each runs.

A collective inside a while body appears once in the text but runs trip-count times:
computations are parsed, and each one's multiplicity is propagated from ENTRY through
`while` (times `known_trip_count` from its backend_config), `call`, `conditional`
and fusion edges. Replica groups are read as listed device ids (jax 0.10's XLA) or as
named mesh axes, `replica_groups=mesh['a'=4,'b'=2] {'b'}` (jax 0.12's). Tuple-shaped
(combined) collectives yield one `HloCollective` per element, marked `combined`.

`parse` is the one entry point: a `Module` of `Instruction`s with their computations'
multiplicities; `collectives` (the audit's input) and engine/cost/trace.py read it.
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
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


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


def replica_groups(attributes: str) -> frozenset:
    """The device groups of a collective from its attributes text: listed replica groups,
    named mesh axes, or (collective-permute) the cycles of its source-target pairs.
    A frozenset of frozensets of device ids; empty if none is given."""
    named = _MESH_GROUPS.search(attributes)
    if named:
        return _mesh_groups(named.group(1), named.group(2))
    m = _GROUPS.search(attributes)
    if not m or not m.group(1):
        pairs = _PAIRS.search(attributes)
        return _pair_groups(pairs.group(1)) if pairs else frozenset()
    return frozenset(frozenset(int(d) for d in g.split(",") if d)
                     for g in re.findall(r"\{([\d,]*)\}", m.group(1)))


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name = result opcode(attributes`, in `computation`.

    result: the result type text (a tuple for combined collectives); attributes: the
    rest of the line (operands, attributes, metadata)."""

    computation: str
    name: str
    result: str
    opcode: str
    attributes: str

    @property
    def op_name(self) -> str:
        """The jax name stack of the op (`metadata={op_name=...}`), or ""."""
        m = _OP_NAME.search(self.attributes)
        return m.group(1) if m else ""

    @property
    def callee(self) -> str | None:
        """The computation a fusion or call runs (`calls=`), if any."""
        m = _CALLS.search(self.attributes)
        return m.group(1) if m else None

    @property
    def groups(self) -> frozenset:
        return replica_groups(self.attributes)


@dataclasses.dataclass(frozen=True)
class Module:
    """A compiled HLO module: its computations' instructions, the entry computation and
    how often each computation runs per execution of the entry."""

    computations: dict  # name -> [Instruction]
    entry: str
    multiplicity: dict  # name -> executions per step (absent: never reached from entry)

    def instructions(self):
        """Every instruction, computation by computation."""
        for instrs in self.computations.values():
            yield from instrs


def parse(text: str) -> Module:
    """Parse compiled HLO text (`compiled.as_text()`)."""
    comps, entry = _computations(text)
    instrs = {}
    for comp, lines in comps.items():
        instrs[comp] = [Instruction(comp, m.group(2), m.group(3), m.group(4), m.group(5))
                        for m in map(_INSTR.match, lines) if m]
    return Module(instrs, entry, _multiplicities(comps, entry))


def collectives(text: str) -> list[HloCollective]:
    """Every collective in the compiled module with its executions per step."""
    module = parse(text)
    out = []
    for ins in module.instructions():
        kind = ins.opcode.removesuffix("-start")
        if kind not in KINDS or ins.computation not in module.multiplicity:
            continue
        groups = ins.groups
        size = max((len(g) for g in groups), default=1)
        arrays = _ARRAY.findall(ins.result)
        if ins.opcode.endswith("-start") and kind == "all-gather":
            arrays = arrays[len(arrays) // 2:]  # (operands, outputs) tuple
        for dtype, dims in arrays:
            shape = tuple(int(d) for d in dims.split(",") if d)
            nbytes = DTYPE_BYTES.get(dtype, 4)
            for d in shape:
                nbytes *= d
            if kind == "reduce-scatter":
                nbytes *= size
            out.append(HloCollective(ins.name, kind, dtype, shape, nbytes, groups,
                                     module.multiplicity[ins.computation], len(arrays) > 1,
                                     ins.op_name))
    return out
