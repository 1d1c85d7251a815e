"""Measured time per HLO op from a profiler trace, attributed to ledger categories.

`jax.profiler.ProfileData` gives one event per executed HLO op per device (stats
`hlo_op`, `hlo_module`, `device_ordinal`). Each op of the compiled text is classified
(`classify`): collectives by kind, replica groups and bytes (the audit's key), compute
ops as matmul (a dot, or a fusion calling one) or memory, with phase and scope read from
the op's `op_name` metadata (the same name stack the ledger reads), or where XLA dropped
it from a dot fusion or a copy feeding one, from the ops it feeds or reads
(`inherited_op_names`).

On forced host-CPU devices every device is a thread on shared cores, so op events of
different devices overlap and stretch each other. `attribute` therefore splits the
measured wall-clock step time across categories in proportion to summed op durations,
after splitting each collective's events into transfer (the shortest duration among the
devices of one execution: the last device to arrive waits least) and wait (the rest),
which is reported as its own category, `collective wait`, rather than hidden. `while`
ops (`CONTAINERS`) are left out: their events overlap their bodies' op events.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import re

from engine.cost import hlo
from layers import scopes


# Ops whose profiler events span ops of their own bodies, which have events of their
# own: XLA:CPU's `while` event on a device overlaps its body's op events (fsdp8 small,
# remat none: each forward `while` event of 100-275 ms covered body ops summing to the
# same time), so counting it would count those ops twice, as unscoped time. (`call` and
# `conditional` events were not checked.)
CONTAINERS = ("while",)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What one HLO instruction is, in ledger terms. key: the audit key for collectives."""

    kind: str
    scope: str
    phase: str
    key: tuple | None = None


# an op the compiled text does not name (classify saw no such instruction)
UNCLASSIFIED = OpInfo("memory", "other", "fwd")


def _phase_scope(op_name: str) -> tuple[str, str]:
    parts = re.split(r"[/()]", op_name)
    scope = scopes.scope_of(parts)
    if "rematted_computation" in parts:
        return "recompute", scope
    if "transpose" in parts:
        return "bwd", scope
    return ("update" if scope in scopes.UPDATE_SCOPES else "fwd"), scope


def classify(hlo_text: str, axes_by_groups: dict) -> dict[str, OpInfo]:
    """{instruction name: OpInfo} for every instruction of the compiled module.
    axes_by_groups: replica groups -> mesh axes (`engine.cost.audit.axes_by_groups`)."""
    module = hlo.parse(hlo_text)
    has_dot = {name for name, instrs in module.computations.items()
               if any(i.opcode in ("dot", "convolution") for i in instrs)}
    first_op_name = {name: next((i.op_name for i in instrs if i.op_name), "")
                     for name, instrs in module.computations.items()}
    named = inherited_op_names(module, first_op_name, has_dot)
    info = {}
    for ins in module.instructions():
        phase, scope = _phase_scope(named.get(ins.name, ""))
        kind = ins.opcode.removesuffix("-start")
        if ins.opcode in CONTAINERS:
            info[ins.name] = OpInfo("container", scope, phase)
        elif kind in hlo.KINDS:
            info[ins.name] = OpInfo("collective", scope, phase,
                                    (kind, axes_by_groups.get(ins.groups, ())))
        elif is_matmul(ins, has_dot):
            info[ins.name] = OpInfo("matmul", scope, phase)
        else:
            info[ins.name] = OpInfo("memory", scope, phase)
    return info


def is_matmul(ins, has_dot: set) -> bool:
    """A dot, or a fusion calling a computation in `has_dot` (those holding a dot)."""
    return ins.opcode == "dot" or ins.callee in has_dot


_OPERAND = re.compile(r"%([\w.\-]+)")


def inherited_op_names(module, first_op_name: dict, has_dot: set) -> dict[str, str]:
    """{instruction: op_name}: its own `metadata={op_name=...}`, else the first of its
    fusion's computation; for a matmul (a dot, or a fusion calling one) and an op that
    feeds one, else the name of a neighbour in its computation: the first named user
    (through chains of unnamed ones), else the first named operand. XLA:CPU drops the
    metadata of some dot fusions it forms (the chunked attention's batched score dots)
    and of the copies that lay their operands out, which would otherwise count as
    unscoped `other` time; the ledger has those dots and copies in the scope and phase
    of the layer ops around them. Other ops without a name stay `other`, as the ledger's
    unscoped rows (the layer scan's own copies) are."""
    named, users, operands, dots = {}, {}, {}, set()
    for instrs in module.computations.values():
        here = {i.name for i in instrs}
        for ins in instrs:
            name = ins.op_name or first_op_name.get(ins.callee, "")
            if name:
                named[ins.name] = name
            if is_matmul(ins, has_dot):
                dots.add(ins.name)
            refs = [r for r in _OPERAND.findall(ins.attributes.split("), ")[0])
                    if r in here and r != ins.name]
            operands[ins.name] = refs
            for r in refs:
                users.setdefault(r, []).append(ins.name)
    unnamed = [n for n in operands if n not in named and (
        n in dots or any(u in dots for u in users.get(n, ())))]
    grew = True
    while grew:  # users first, through chains of unnamed ops; then operands
        grew = False
        for near_of in (users, operands):
            changed = True
            while changed:
                changed = False
                for name in unnamed:
                    near = [n for n in near_of.get(name, ()) if n in named]
                    if name not in named and near:
                        named[name] = named[near[0]]
                        changed = grew = True
    return named


def op_events(profile_dir: str, module_substr: str = "train_step") -> list[tuple]:
    """[(hlo_op, device, start_ns, duration_ns)] of the module's ops in the trace."""
    from jax.profiler import ProfileData

    events = []
    for pb in glob.glob(f"{profile_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(pb).planes:
            for line in plane.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats and module_substr in str(stats.get("hlo_module", "")):
                        events.append((stats["hlo_op"], stats.get("device_ordinal", 0),
                                       ev.start_ns, ev.duration_ns))
    return events


def attribute(events, info: dict[str, OpInfo], step_s: float, steps: int) -> dict:
    """Split the measured step time over (kind, scope, phase, key) categories, plus
    ("collective wait", ...) per collective key. Returns {category: seconds per step}."""
    by_op_device = collections.defaultdict(list)
    for op, dev, start, dur in sorted(events, key=lambda e: e[2]):
        by_op_device[(op, dev)].append(dur)
    weights = collections.Counter()
    for op in {op for op, _ in by_op_device}:
        meta = info.get(op, UNCLASSIFIED)
        if meta.kind == "container":
            continue
        runs = [d for (o, _), d in by_op_device.items() if o == op]
        cat = (meta.kind, meta.scope, meta.phase, meta.key)
        if meta.kind != "collective":
            weights[cat] += sum(map(sum, runs))
            continue
        for instance in zip(*runs):  # k-th execution on every device
            fastest = min(instance)
            weights[cat] += fastest * len(instance)
            weights[("collective wait", meta.scope, meta.phase, meta.key)] += (
                sum(instance) - fastest * len(instance))
    total = sum(weights.values()) or 1.0
    return {cat: step_s * w / total for cat, w in weights.items()}


def op_seconds(events, info: dict[str, OpInfo], step_s: float, steps: int) -> dict:
    """{HLO instruction: (seconds per step, executions per step per device)}: the step
    time split in proportion to each op's summed durations, as `attribute` splits it
    (a collective's transfer and wait together), so the ops' seconds add up to `step_s`.
    Containers are left out, as there."""
    durations, runs, devices = collections.Counter(), collections.Counter(), set()
    for op, dev, _, dur in events:
        devices.add(dev)
        if info.get(op, UNCLASSIFIED).kind != "container":
            durations[op] += dur
            runs[op] += 1
    total = sum(durations.values()) or 1.0
    per_run = max(len(devices), 1) * max(steps, 1)
    return {op: (step_s * d / total, runs[op] / per_run) for op, d in durations.items()}
