"""How a plan is printed: the ranked table, and why one candidate beats another (the
predicted difference split into compute and exposed communication, by category)."""
from __future__ import annotations

from engine.config import TrainConfig
from engine.planner.auto import gib
from engine.planner.search import Priced, predict_candidate


def _categories(pred) -> dict:
    """Seconds on the critical path per category: compute by scope, exposed
    collectives by kind and axes, page faults."""
    from engine.cost.ledger import COLLECTIVES

    out: dict[str, float] = {"page faults": pred.fault_s} if pred.fault_s else {}
    for p in pred.rows:
        r = p.row
        if r.kind == "collective":
            if COLLECTIVES.get(r.primitive) is None:
                continue
            key, t = f"{COLLECTIVES[r.primitive]} over {','.join(sorted(r.axes))}", p.exposed
        else:
            key, t = f"{r.scope} compute", p.seconds
        out[key] = out.get(key, 0.0) + t
    return out


def runner_up(ranked: list) -> int | None:
    """The rank (0-based) of the first candidate after the first choice that is another
    program or priced differently: not the same step with its axes in another order."""
    first = ranked[0]
    return next((i for i, p in enumerate(ranked[1:], 1)
                 if p.candidate.program != first.candidate.program or p.step_s != first.step_s),
                None)


def why(first: Priced, second: Priced, tcfg: TrainConfig, hw, ranks: tuple = (1, 2)) -> str:
    """One line: by how much the first beats the second (#ranks), split into compute,
    exposed communication and (where either pays them) page faults, and the category
    where most of the difference is."""
    a, b = (predict_candidate(p.candidate, tcfg, hw, p.mapped_bytes) for p in (first, second))
    ca, cb = _categories(a), _categories(b)
    diffs = {k: cb.get(k, 0.0) - ca.get(k, 0.0) for k in {*ca, *cb}}
    top = max(diffs, key=lambda k: abs(diffs[k]))
    gap = second.step_s - first.step_s
    i, j = ranks
    faults = (f", {b.fault_s - a.fault_s:+.4g} s on page faults"
              if a.fault_s or b.fault_s else "")
    return (f"#{i} {first.candidate.describe()} beats #{j} {second.candidate.describe()} by "
            f"{gap:.4g} s ({100 * gap / second.step_s:.1f}%): #{j} spends "
            f"{b.compute_s - a.compute_s:+.4g} s on compute and "
            f"{b.exposed_comm_s - a.exposed_comm_s:+.4g} s on exposed communication{faults}, "
            f"most in {top} ({diffs[top]:+.4g} s)")


def table(ranked: list, top: int) -> str:
    from tabulate import tabulate

    rows = [[i + 1, str(p.candidate.layout),
             " ".join(f"{k}={v}" for k, v in p.candidate.applied().items()),
             f"{p.step_s:.4g}", f"{100 * p.mfu:.1f}%", gib(p.peak_bytes),
             f"{p.exposed_comm_s:.4g}"] for i, p in enumerate(ranked[:top])]
    return tabulate(rows, ["#", "layout", "switches", "step s", "MFU", "peak/device",
                           "exposed comm s"], disable_numparse=True)
