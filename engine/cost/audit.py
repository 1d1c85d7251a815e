"""The audit: the compiled step holds exactly the collectives the ledger placed.

Each collective on either side becomes a key (HLO kind, replica groups, dtype, bytes per
device) with an execution count per step; the audit compares the two multisets and
names every op the compiler added or dropped. Transformations XLA legitimately makes
are modelled by named rules, applied to the ledger side before comparing, and reported
with how many ops each touched:

- `cpu_bf16_collectives_in_f32` (CPU only): XLA's CPU runtime has no bf16 collective
  kernels, so float normalization wraps every bf16 all-gather / reduce-scatter in
  converts and runs it in f32 (the HLO shows `convert(bf16->f32)` feeding an f32
  all-gather and reductions named `*_promoted`). Values are unchanged (already rounded
  to bf16); bytes double. Accelerators keep bf16, so the rule is off there.
- `all_reduce_combiner`: XLA's all-reduce combiner merges independent all-reduces over
  the same replica groups into one tuple-shaped op. Each tuple element is compared as
  its own collective (same kind, groups, dtype, bytes), so combining changes nothing
  in the comparison; the number of merged ops is reported.
- `cpu_permute_sent_in_f32` (CPU only): where every use of a bf16 value a
  collective-permute receives is in f32 (the cp ring's K/V blocks, whose tiles XLA:CPU
  computes in f32), the compiler moves the upcast ahead of the permute, which then
  sends f32: the same elements, twice the bytes. Whether it does depends on the
  receiver's uses, so the rule is applied after comparing: a bf16 permute the ledger
  placed and an f32 one of twice its bytes over the same axes in the compiled step are
  paired as one. (The ledger prices the bf16 bytes.)
- `cpu_all_to_all_as_tuple` (CPU only): XLA:CPU runs an array all-to-all over n devices
  as a tuple all-to-all of its n slices along the split dimension (one per peer: the
  HLO shows `all-to-all(slice_0, ..., slice_{n-1})` of [1, ...] pieces). The bytes
  moved are the same; the ledger's op is compared as n elements of bytes / n.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from engine.cost import hlo
from engine.cost.ledger import COLLECTIVES, WIDENED_KINDS, Row

HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32",
             "float64": "f64", "bool": "pred", "uint32": "u32"}


@dataclasses.dataclass(frozen=True)
class Audit:
    """clean: no collective added or dropped. matched/missing/extra: {key: count} with
    key = (kind, axes, dtype, bytes); missing = placed in code, absent from HLO; extra =
    in HLO, not placed. names: key -> where each side's ops come from. rules: rule name
    -> ops it applied to."""

    clean: bool
    matched: dict
    missing: dict
    extra: dict
    names: dict
    rules: dict


def axis_groups(mesh_axes: tuple[tuple[str, int], ...], axes: tuple[str, ...]) -> frozenset:
    """Replica groups (device ids, row-major over the mesh) of a collective over `axes`."""
    names = [n for n, _ in mesh_axes]
    ids = np.arange(int(np.prod([s for _, s in mesh_axes]))).reshape([s for _, s in mesh_axes])
    moved = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in moved]
    grid = ids.transpose(rest + moved).reshape(-1, int(np.prod([ids.shape[i] for i in moved])))
    return frozenset(frozenset(int(d) for d in row) for row in grid)


def axes_by_groups(mesh_axes) -> dict:
    """groups -> axes (in mesh order) for every non-empty subset of the mesh axes."""
    names = [n for n, _ in mesh_axes]
    table = {}
    for bits in range(1, 2 ** len(names)):
        axes = tuple(n for i, n in enumerate(names) if bits >> i & 1)
        table.setdefault(axis_groups(mesh_axes, axes), axes)
    return table


def expected(rows: list[Row], platform: str) -> tuple[collections.Counter, dict, dict]:
    """Ledger collectives as audit keys after the platform's rules."""
    counts, names, rules = collections.Counter(), collections.defaultdict(set), collections.Counter()
    for r in rows:
        kind = COLLECTIVES.get(r.primitive)
        if r.kind != "collective" or kind is None or r.axis_size == 1:
            continue
        dtype, nbytes = HLO_DTYPE[r.dtype], int(r.bytes)
        if platform == "cpu" and dtype == "bf16" and kind in WIDENED_KINDS:
            dtype, nbytes = "f32", 2 * nbytes
            rules["cpu_bf16_collectives_in_f32"] += r.count
        count = r.count
        if platform == "cpu" and kind == "all-to-all":
            nbytes, count = nbytes // r.axis_size, count * r.axis_size
            rules["cpu_all_to_all_as_tuple"] += r.count
        key = (kind, tuple(r.axes), dtype, nbytes)
        counts[key] += count
        names[key].add(f"{r.phase}/{r.scope}/{r.primitive}")
    return counts, names, rules


def _pair_upcast_permutes(missing: collections.Counter, extra: collections.Counter,
                          want: collections.Counter, rules: collections.Counter) -> None:
    """`cpu_permute_sent_in_f32` (module doc): each bf16 collective-permute the ledger
    placed that the compiled step sends as f32 (same axes, twice the bytes) leaves
    `missing` and `extra`, and counts as matched under the compiled key in `want`."""
    for (kind, axes, dtype, nbytes), n in list(missing.items()):
        sent = (kind, axes, "f32", 2 * nbytes)
        if kind != "collective-permute" or dtype != "bf16" or not extra.get(sent):
            continue
        k = min(n, extra[sent])
        missing[(kind, axes, dtype, nbytes)] -= k
        extra[sent] -= k
        want[(kind, axes, dtype, nbytes)] -= k
        want[sent] += k
        rules["cpu_permute_sent_in_f32"] += k
    for counter in (missing, extra, want):
        for key in [key for key, n in counter.items() if n <= 0]:
            del counter[key]


def canonical_axes(axes: tuple, mesh_axes) -> tuple:
    """`axes` in mesh order (the order `axes_by_groups` names them in)."""
    order = [n for n, _ in mesh_axes]
    return tuple(sorted(axes, key=order.index))


def audit(rows: list[Row], hlo_text: str, mesh_axes, platform: str) -> Audit:
    """Compare the ledger's collectives with the compiled HLO's (see module doc)."""
    placed, placed_names, rules = expected(rows, platform)
    want, names = collections.Counter(), collections.defaultdict(set)
    for (kind, axes, dtype, nbytes), n in placed.items():
        key = (kind, canonical_axes(axes, mesh_axes), dtype, nbytes)
        want[key] += n
        names[key] |= placed_names[(kind, axes, dtype, nbytes)]
    by_groups = axes_by_groups(mesh_axes)
    got, hlo_names, combined = collections.Counter(), collections.defaultdict(set), set()
    for c in hlo.collectives(hlo_text):
        axes = by_groups.get(c.groups, ("?",) if c.groups else ())
        key = (c.kind, axes, c.dtype, c.bytes)
        got[key] += c.count
        hlo_names[key].add(c.op_name.split("shard_map/")[-1] or c.name)
        if c.combined:
            combined.add(c.name)
    if combined:
        rules["all_reduce_combiner"] = len(combined)
    missing, extra = want - got, got - want
    if platform == "cpu":
        _pair_upcast_permutes(missing, extra, want, rules)
    all_names = {k: sorted(names.get(k, set()) | hlo_names.get(k, set()))
                 for k in set(want) | set(got)}
    return Audit(not missing and not extra, dict(want & got), dict(missing), dict(extra),
                 all_names, dict(rules))
