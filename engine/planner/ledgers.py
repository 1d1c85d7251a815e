"""The ledgers of many programs: from the cache, derived from shapes, or traced.

Programs of one structure (the same axes present, the same switches and model: they
differ only in axis sizes) are priced from a few traces (engine/cost/derive.py): with k
axes present, k of them are traced and fitted, one more is traced and must match its
derived ledger row for row, and the rest are derived. A structure with fewer than k + 2
programs to price, one whose numbers are not monomials in its axis sizes or whose check
fails, is traced program by program. Every ledger, traced or derived, goes to the ledger
cache (engine/cost/cache.py).

The pp degree is part of a structure, not one of its sizes: a pipeline's tick scan runs
2(M + pp - 1) ticks (M = 4·pp microbatches in the plan), its tick tables are [T, pp]
constants, neither a monomial in pp. With pp (and so M, the schedule, V) fixed, a pp
program's numbers are monomials in the other roles' sizes as a flat program's are, and
the tables are the same constants, so pp4 programs that differ only in their fsdp, tp,
dp or cp sizes derive; pp2 and pp4 are two structures.
"""
from __future__ import annotations

from typing import NamedTuple

from engine.cost import cache, derive
from engine.cost.ledger import ledger, trace_step
from engine.parallel.layout import AXIS_ROLES

HOW = ("cached", "traced", "derived", "failed")


# roles whose size is part of a structure, not one of the sizes it derives over
FIXED = ("pp",)


class Key(NamedTuple):
    """A structure: the roles whose sizes vary (present, not `FIXED`), the sizes of the
    `FIXED` roles, the program's parallel config and model."""

    roles: tuple
    fixed: tuple
    parallel: object
    cfg: object


def structure(cand) -> Key:
    """What a candidate's program is up to the sizes of its roles not `FIXED`."""
    _, parallel, cfg = cand.program
    lay = cand.layout
    return Key(tuple(r for r in AXIS_ROLES if lay.degree(r) > 1 and r not in FIXED),
               tuple(lay.degree(r) for r in FIXED), parallel, cfg)


def sizes(cand, roles: tuple) -> tuple:
    return tuple(cand.layout.degree(r) for r in roles)


def _trace(c, tcfg, pack):
    """(jaxpr, rows) of the candidate's step, the rows stored in the cache."""
    closed = trace_step(c.cfg, tcfg, c.layout, c.parallel, pack)
    rows = ledger(closed, c.layout)
    cache.store(rows, c.cfg, tcfg, c.layout, c.parallel, pack)
    return closed, rows


def _derive(cands: list, tcfg, pack, roles: tuple) -> list | None:
    """[(rows, how)] of `cands` (one structure's programs, their ledgers not cached)
    from k traced, one checked, the rest derived (any the fit cannot derive traced);
    None when no k of them determine the fit (nothing traced then)."""
    k = len(roles)
    every = [sizes(c, roles) for c in cands]
    # fit on the most even sizes first: the extremes are where a dimension reaches 1
    order = sorted(range(len(cands)), key=lambda i: -min(every[i]))
    picked = derive.independent([every[i] for i in order], k)
    if picked is None:
        return None
    picked = [order[j] for j in picked]
    out: list = [None] * len(cands)

    def trace(i):
        out[i] = (_trace(cands[i], tcfg, pack)[1], "traced")

    traced = []
    for i in picked:
        closed, rows = _trace(cands[i], tcfg, pack)
        out[i] = (rows, "traced")
        traced.append((every[i], closed))
    try:
        fitted = derive.Structure(roles, traced)
    except derive.NotDerivable:
        fitted = None
    rest = [i for i in order if out[i] is None]
    ok = [i for i in rest if fitted is not None and fitted.derivable(every[i])]
    if ok:
        check = ok.pop(0)
        trace(check)
        if derive.differences(fitted.ledger(cands[check].layout), out[check][0]):
            ok = []
    for i in rest:
        if out[i] is not None:
            continue
        if i in ok:
            rows = fitted.ledger(cands[i].layout)
            cache.store(rows, cands[i].cfg, tcfg, cands[i].layout, cands[i].parallel, pack)
            out[i] = (rows, "derived")
        else:
            trace(i)
    return out


def _trace_or_why(c, tcfg, pack) -> tuple:
    """(rows, "traced") of the candidate's step, or (why, "failed") when jax cannot
    trace it: one line naming the error, so one such program is refused in the plan's
    output instead of ending the plan."""
    try:
        return _trace(c, tcfg, pack)[1], "traced"
    except Exception as e:  # noqa: BLE001 (any error of the traced step's code)
        first = (str(e).strip().splitlines() or [""])[0]
        return f"its step does not trace ({type(e).__name__}: {first[:160]})", "failed"


def program_ledgers(cands: list, tcfg, pack=None, shapes: bool = True) -> list:
    """[(ledger rows, how: one of HOW)] of each candidate's program (one candidate per
    program); for a program whose step does not trace, (why: a str, "failed"). shapes:
    derive what a structure's traces determine (else trace every miss)."""
    out: list = [None] * len(cands)
    misses: dict[tuple, list[int]] = {}
    for i, c in enumerate(cands):
        rows = cache.lookup(c.cfg, tcfg, c.layout, c.parallel, pack)
        if rows is not None:
            out[i] = (rows, "cached")
        else:
            misses.setdefault(structure(c), []).append(i)
    for key, idx in misses.items():
        roles, got = key.roles, None
        if shapes and len(roles) >= 2 and len(idx) >= len(roles) + 2:
            try:
                got = _derive([cands[i] for i in idx], tcfg, pack, roles)
            except Exception:  # noqa: BLE001 (one that does not trace: each alone below)
                got = None
        if got is None:
            got = [_trace_or_why(cands[i], tcfg, pack) for i in idx]
        for i, g in zip(idx, got):
            out[i] = g
    return out
