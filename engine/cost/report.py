"""Tables of a prediction beside a measurement, shared by bench/roofline.py and the
training CLI's profile (engine/cost/profile.py): per ledger scope, per fusion group and per
collective, and the roofline plot.

`measured` is `engine.cost.trace.attribute`'s {(kind, scope, phase, key): seconds per
step}, or None when nothing was measured. Seconds are per step; FLOPs and bytes per
device per step (the ledger's rows are one device's program).
"""
from __future__ import annotations

import collections

from tabulate import tabulate

from engine.cost.hardware import Hardware
from engine.cost.price import Prediction, fusion_id, moved_bytes

SCOPE_HEADS = ["scope", "FLOPs", "bytes", "FLOP/B", "bound", "pred s", "meas s", "err"]
COLLECTIVE_HEADS = ["collective", "axes", "bytes/step", "count", "pred s", "pred exposed s",
                    "meas s", "wait s", "err"]
FUSION_HEADS = ["scope", "phase", "fusion (top ops)", "count", "FLOPs", "bytes", "bound",
                "pred s"]
OP_HEADS = ["HLO op", "kind", "scope", "phase", "result", "runs", "computes", "meas s", "share"]
# opcodes that move no data or only rename it: left out of an op's `computes` column
PLUMBING = {"parameter", "constant", "bitcast", "broadcast", "get-tuple-element", "tuple",
            "reshape", "iota"}


def error(pred: float, meas: float | None) -> float | None:
    """(predicted - measured) / measured, None without a measurement."""
    return None if meas in (None, 0) else (pred - meas) / meas


def fmt(x, unit: str = "") -> str:
    """A figure to 3 significant digits, a fraction as a signed percent, "-" for None."""
    if x is None:
        return "-"
    return f"{100 * x:+.0f}%" if unit == "%" else f"{x:.3g}"


def scope_table(pred: Prediction, measured, hw: Hardware) -> list[list]:
    """Rows per scope: FLOPs, bytes (as priced on `hw`), intensity, bound, predicted,
    measured, error."""
    agg = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for p in pred.rows:
        if p.row.kind == "collective":
            continue
        a = agg[p.row.scope]
        a[0] += p.row.total_flops
        a[1] += moved_bytes(p.row, hw) * p.row.count
        a[2] += p.seconds
        a[3] += p.seconds if p.bound == "compute" else 0.0
    meas = collections.Counter()
    for (kind, scope, *_), s in (measured or {}).items():
        if kind in ("matmul", "memory"):
            meas[scope] += s
    out = []
    for scope, (flops, nbytes, t, t_compute) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        m = meas.get(scope) if measured else None
        out.append([scope, flops, nbytes, flops / max(nbytes, 1),
                    "compute" if t_compute >= t / 2 else "memory", t, m, error(t, m)])
    return out


def fusion_table(pred: Prediction, hw: Hardware, top: int = 25) -> list[list]:
    """The `top` fusion groups by predicted time: scope, phase, members (primitives),
    count, FLOPs, bytes per step, bound, predicted seconds."""
    agg = {}
    for p in pred.rows:
        r = p.row
        if r.kind == "collective":
            continue
        fid = fusion_id(r, hw)
        if fid < 0 and r.kind != "attention":
            continue  # merged into an identical op (CSE): moves nothing
        key = ("kernel", id(r)) if fid < 0 else ("fusion", fid)
        a = agg.setdefault(key, dict(scope=r.scope, phase=r.phase, ops=collections.Counter(),
                                     count=r.count, flops=0.0, bytes=0.0, s=0.0, cs=0.0))
        a["ops"][r.primitive] += 1
        a["flops"] += r.total_flops
        a["bytes"] += moved_bytes(r, hw) * r.count
        a["s"] += p.seconds
        a["cs"] += p.seconds if p.bound == "compute" else 0.0
    out = []
    for a in sorted(agg.values(), key=lambda a: -a["s"])[:top]:
        ops = " ".join(f"{k}x{n}" if n > 1 else k for k, n in a["ops"].most_common(4))
        out.append([a["scope"], a["phase"], ops, a["count"], a["flops"], a["bytes"],
                    "compute" if a["cs"] >= a["s"] / 2 else "memory", a["s"]])
    return out


def collective_table(pred: Prediction, measured, mesh_axes) -> list[list]:
    """Rows per (HLO kind, axes): bytes/step, count, predicted, predicted exposed,
    measured transfer, wait, error."""
    from engine.cost.audit import canonical_axes
    from engine.cost.ledger import COLLECTIVES

    agg = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    for p in pred.rows:
        kind = COLLECTIVES.get(p.row.primitive)
        if p.row.kind != "collective" or kind is None or p.row.bytes == 0:
            continue
        a = agg[(kind, canonical_axes(p.row.axes, mesh_axes))]
        a[0] += p.row.total_bytes
        a[1] += p.row.count
        a[2] += p.seconds
        a[3] += p.exposed
    meas, wait = collections.Counter(), collections.Counter()
    for (kind, _, _, key), s in (measured or {}).items():
        if kind == "collective":
            meas[key] += s
        elif kind == "collective wait":
            wait[key] += s
    out = []
    for key, (nbytes, count, t, exposed) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        m = meas.get(key) if measured else None
        out.append([key[0], ",".join(key[1]), nbytes, count, t, exposed, m,
                    wait.get(key) if measured else None, error(t, m)])
    return out


def format_scopes(srows) -> str:
    return tabulate([[r[0], *map(fmt, r[1:4]), r[4], *map(fmt, r[5:7]), fmt(r[7], "%")]
                     for r in srows], SCOPE_HEADS)


def format_collectives(crows) -> str:
    return tabulate([[r[0], r[1], *map(fmt, r[2:8]), fmt(r[8], "%")] for r in crows],
                    COLLECTIVE_HEADS)


def op_table(op_s: dict, info: dict, hlo_text: str, top: int) -> list[list]:
    """The `top` compiled ops by measured time (`engine.cost.trace.op_seconds`): name,
    kind, scope, phase (the ledger's, from its op_name), result type, executions per step
    per device, the opcodes it computes (a fusion's body, plumbing left out: a
    `transpose` there is a layout change the compiler added) and seconds per step."""
    from engine.cost import hlo
    from engine.cost.trace import UNCLASSIFIED

    module = hlo.parse(hlo_text)
    by_name = {i.name: i for i in module.instructions()}
    total = sum(s for s, _ in op_s.values()) or 1.0
    out = []
    for op, (secs, runs) in sorted(op_s.items(), key=lambda kv: -kv[1][0])[:top]:
        meta = info.get(op, UNCLASSIFIED)
        ins = by_name.get(op)
        body = module.computations.get(ins.callee, []) if ins and ins.callee else []
        ops = sorted({i.opcode for i in body} - PLUMBING) if body else \
            [ins.opcode] if ins else []
        out.append([op, meta.kind, meta.scope, meta.phase, ins.result if ins else "?",
                    runs, ",".join(ops), secs, secs / total])
    return out


def format_ops(orows) -> str:
    return tabulate([[*r[:5], f"{r[5]:.3g}", r[6], fmt(r[7]), f"{100 * r[8]:.1f}%"]
                     for r in orows], OP_HEADS, disable_numparse=True)


def format_fusions(frows) -> str:
    return tabulate([[*r[:4], *map(fmt, r[4:6]), r[6], fmt(r[7])] for r in frows],
                    FUSION_HEADS)


def roofs(pred: Prediction, hw: Hardware, n_devices: int) -> list[tuple[str, float, float]]:
    """[(label, FLOP/s, bytes/s)] per device: the rates the prediction priced compute
    rows with. On a shared host whose rates were measured for the host (not all devices
    at once) each device gets 1/n of them, as `price.compute_seconds` scales its time;
    rates measured on every device at once (`concurrent_rates`) are already per device.
    Matmuls priced by their measured time (`Hardware.dot_seconds`) get, per dtype, the
    rate those measurements add up to (their FLOPs over their seconds in the step)
    instead of the profile's peak: one dot's own rate can sit above or below it."""
    share = n_devices if hw.shared_host and not hw.concurrent_rates else 1
    nbytes = hw.hbm * hw.mem_eff / share
    flops, seconds = collections.Counter(), collections.Counter()
    for p in pred.rows:
        r = p.row
        if r.kind == "matmul" and r.dot in hw.dot_seconds:
            flops[r.dtype] += r.total_flops
            seconds[r.dtype] += hw.dot_seconds[r.dot] * r.count
    if flops:
        out = [(f"measured {d} matmuls (overall rate)", flops[d] / seconds[d], nbytes)
               for d in sorted(flops) if seconds[d]]
    else:
        out = [(f"{d} matmul", hw.matmul_rate(d) / share, nbytes)
               for d in sorted(hw.peak_flops)]
    out.append(("elementwise", hw.vector_flops / share, nbytes))
    if hw.transcendental_flops:
        out.append(("exp, log, ... (elementwise)", hw.transcendental_flops / share, nbytes))
    return out


def plot_roofline(srows, pred: Prediction, hw: Hardware, n_devices: int, path: str) -> None:
    """Per-scope points (FLOP/B, achieved FLOP/s per device, predicted and measured)
    under the roofs the prediction used (`roofs`), with the machine's peak matmul rate
    per device (the MFU denominator) dashed above them: a measured point above a solid
    roof is a scope the prediction over-priced. Needs the optional `plot` extra
    (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [10 ** (i / 10) for i in range(-20, 51)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, flops, nbytes in roofs(pred, hw, n_devices):
        ax.plot(x, [min(flops, i * nbytes) for i in x], label=f"roof: {label}")
    share = n_devices if hw.shared_host else 1  # the machine's peak, per device
    for d in sorted(hw.peak_flops):
        ax.axhline(hw.mfu_peak_of(d) / share, linestyle="--", linewidth=0.8, color="grey")
        ax.annotate(f"{d} peak (MFU denominator)", (x[0], hw.mfu_peak_of(d) / share),
                    fontsize=7, color="grey")
    for scope, flops, _, intensity, _, t_pred, t_meas, _ in srows:
        if flops and intensity:
            ax.scatter([intensity], [flops / t_pred], marker="o")
            ax.annotate(scope, (intensity, flops / t_pred), fontsize=8)
            if t_meas:
                ax.scatter([intensity], [flops / t_meas], marker="x", color="k")
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="FLOP/s per device",
           title=f"{hw.name}: predicted (o) and measured (x) per scope")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def assumptions(cfg, parallel, hw: Hardware, activations_flag: str) -> str:
    """One line of every choice a prediction was priced with: the model's dtypes (and
    whether `--activations auto` chose them), remat, the attention kernel the profile
    prices, the parallel settings and how the profile runs collectives."""
    acts = cfg.activations + (" (auto for this platform)" if activations_flag == "auto" else "")
    if hw.attention_rates:
        kernel = "flash kernel at its published speed per sequence length"
    elif hw.attention_eff:
        kernel = f"flash kernel at {hw.attention_eff:.2f} of the matmul peak"
    else:
        kernel = f"the jnp key-block scan ({cfg.attention})"
    comms = ("NCCL's ring / tree / NVLS by size (engine/cost/nccl.py)" if hw.nccl is not None
             else "measured per kind (collective_fit)" if hw.collective_fit
             else "rings over the slowest link tier")
    p = parallel
    return (f"assumed: compute {cfg.dtype}, activations {acts}, params and optimizer f32, "
            f"remat {cfg.remat}, attention {kernel}, zero {p.zero}, "
            f"prefetch {'on' if p.prefetch else 'off'}, tp-comm {p.tp_comm}, "
            f"cp-comm {p.cp_comm}, microbatches {p.microbatches}, pp-schedule "
            f"{p.pp_schedule} (virtual {p.pp_virtual}), grad-reduce {p.grad_reduce}, "
            f"collectives {comms}, overlap {'on' if hw.overlap else 'off'}")
