"""The ledgers of many programs: from the cache, derived from shapes, or traced.

Programs of one structure (the same axes present, the same switches and model: they
differ only in axis sizes) are priced from a few traces (engine/cost/derive.py): with k
axes present, k of them are traced and fitted, one more is traced and must match its
derived ledger row for row, and the rest are derived. A structure whose numbers are not
monomials in its axis sizes or whose check fails is traced program by program. Every
ledger, traced or derived, goes to the ledger cache (engine/cost/cache.py).

What a process learns of a structure (`Learner`: its traces, the fit, the check)
outlives one call: a best-first plan (engine/planner/best.py) prices a few programs at a
time, a structure's programs in many calls, and a process derives a structure's programs
once it has traced k + 1 of them in any calls. It fits and checks only when a (k+2)-th
program is to be priced, and learns a structure only where the plan has more than k + 1
of its programs (`program_ledgers`' `planned`): for fewer, the fit and check would cost
and never derive.

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


class Learner:
    """What this process has learnt of one structure (`roles`: its roles that vary):
    its traced programs, kept until one more of it is to be priced and k + 1 of them
    are at hand: then k that span the sizes (`derive.independent`, the first traced
    the base) are fitted (`derive.Structure`) and a derivable other one is the check
    (its derived ledger must equal its traced one row for row). Once checked, the
    structure's derivable programs derive; the fit and check are paid only where a
    program then derives. refused: the fit or the check failed, or the traces kept do
    not span the sizes."""

    def __init__(self, roles: tuple):
        self.roles = roles
        self.traced: list = []  # [(sizes, closed jaxpr, rows, layout)] until checked
        self.fitted: derive.Structure | None = None
        self.checked = False
        self.refused = False

    def derives(self, c) -> bool:
        """Whether c's program derives (fitting and checking on the traces kept, when
        there are enough)."""
        if not (self.checked or self.refused) and (
                len(self.traced) > len(self.roles) or self.fitted is not None):
            self._fit_and_check()
        return self.checked and self.fitted.derivable(sizes(c, self.roles))

    def learn(self, c, closed, rows) -> None:
        """Keep candidate c's traced program (its jaxpr and ledger rows)."""
        if not (self.checked or self.refused):
            self.traced.append((sizes(c, self.roles), closed, rows, c.layout))

    def _fit_and_check(self) -> None:
        k = len(self.roles)
        if self.fitted is None:
            picked = derive.independent([t[0] for t in self.traced], k)
            if picked is None:
                if len(self.traced) > k + 2:  # sizes on a line: not worth keeping more
                    self.refused, self.traced = True, []
                return
            try:
                self.fitted = derive.Structure(self.roles,
                                               [self.traced[i][:2] for i in picked])
            except derive.NotDerivable:
                self.refused, self.traced = True, []
                return
            self.traced = [t for i, t in enumerate(self.traced) if i not in picked]
        checks = [t for t in self.traced if self.fitted.derivable(t[0])]
        if checks:  # else keep the traces until a derivable one comes
            _, _, rows, layout = checks[0]
            self.checked = not derive.differences(self.fitted.ledger(layout), rows)
            self.refused, self.traced = not self.checked, []


# the structures this process learns, oldest first; at most LEARNT of them, each holding
# up to k + 1 traced jaxprs until checked, then one
_LEARNT: dict = {}
LEARNT = 32


def learner(key: Key, tcfg, pack, n: int) -> Learner:
    """This process's `Learner` of structure `key` traced with (tcfg, pack) on n devices."""
    at = (key, tcfg, pack, n)
    if at not in _LEARNT:
        if len(_LEARNT) >= LEARNT:
            del _LEARNT[next(iter(_LEARNT))]
        _LEARNT[at] = Learner(key.roles)
    return _LEARNT[at]


def _in_order(cands: list, idx: list, roles: tuple, fresh: bool) -> list:
    """`idx` (one structure's programs) in the order to take them: the most even sizes
    first (the extremes are where a dimension reaches 1), and for a structure not yet
    learnt k that span the sizes ahead of the rest, so no trace toward the fit is lost."""
    every = {i: sizes(cands[i], roles) for i in idx}
    order = sorted(idx, key=lambda i: -min(every[i]))
    picked = derive.independent([every[i] for i in order], len(roles)) if fresh else None
    if picked is None:
        return order
    first = [order[j] for j in picked]
    return first + [i for i in order if i not in first]


def _ledger(c, tcfg, pack, learnt: Learner | None) -> tuple:
    """(rows, how) of candidate c's program: derived where `learnt` derives it, else
    traced (and learnt from), or (why, "failed") when its step does not trace."""
    if learnt is not None:
        try:  # the fit, the check or the derived ledger
            rows = learnt.fitted.ledger(c.layout) if learnt.derives(c) else None
        except Exception:  # noqa: BLE001 (a rebuilt jaxpr the walk refuses: trace the rest)
            learnt.refused, learnt.traced, rows = True, [], None
        if rows is not None:
            cache.store(rows, c.cfg, tcfg, c.layout, c.parallel, pack)
            return rows, "derived"
    try:
        closed, rows = _trace(c, tcfg, pack)
    except Exception as e:  # noqa: BLE001 (any error of the traced step's code)
        first = (str(e).strip().splitlines() or [""])[0]
        return f"its step does not trace ({type(e).__name__}: {first[:160]})", "failed"
    if learnt is not None:
        learnt.learn(c, closed, rows)
    return rows, "traced"


def program_ledgers(cands: list, tcfg, pack=None, shapes: bool = True,
                    planned: dict | None = None) -> list:
    """[(ledger rows, how: one of HOW)] of each candidate's program (one candidate per
    program); for a program whose step does not trace, (why: a str, "failed"). shapes:
    derive what a structure's traces determine (else trace every miss). planned:
    {structure: its programs in the whole plan} (default: those of `cands`); a structure
    of k roles is learnt (`Learner`) where more than k + 1 are planned."""
    out: list = [None] * len(cands)
    misses: dict[Key, list[int]] = {}
    for i, c in enumerate(cands):
        rows = cache.lookup(c.cfg, tcfg, c.layout, c.parallel, pack)
        if rows is not None:
            out[i] = (rows, "cached")
        else:
            misses.setdefault(structure(c), []).append(i)
    for key, idx in misses.items():
        k = len(key.roles)
        many = (planned or {}).get(key, len(idx)) >= k + 2
        learnt = (learner(key, tcfg, pack, cands[idx[0]].layout.size)
                  if shapes and k >= 2 and many else None)
        if learnt is not None:
            idx = _in_order(cands, idx, key.roles, not learnt.traced and learnt.fitted is None)
        for i in idx:
            out[i] = _ledger(cands[i], tcfg, pack, learnt)
    return out
