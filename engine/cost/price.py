"""Price ledger rows on a hardware profile and predict the step.

Compute rows by roofline: max(FLOPs / rate, bytes / (hbm * mem_eff)), matmuls at
`Hardware.matmul_rate` of their operand dtype (peak x matmul_eff x matmul_sustained: on
a GPU the clock a step's load sustains, not a benchmark's boost burst), other rows at
the vector rate (exp, log and the like, `TRANSCENDENTAL`, at the profile's rate for
them where it has one), the stack's share of the bytes of a scan's stacked inputs and
outputs (`Row.scan_stack`) at `cold_hbm` where the profile has one (a host whose caches
hold a layer's working set but not the stacks), the rest of those rows' bytes at `hbm`;
a matmul whose exact dot the profile has timed (`Hardware.dot_seconds`, measured in the same run by
`engine/cost/microbench.py`) costs its measured time, and so does a collective whose
kind, group size, bytes and dtype it has timed (`Hardware.collective_seconds`; an
all-reduce timed between the matmuls that feed and read it). Other
collectives by ring formulas over the slowest link tier their axes use, n = group size:

    all-gather, reduce-scatter: (n-1)/n * bytes / bw + (n-1) * latency
    all-reduce:                 2 (n-1)/n * bytes / bw + 2 (n-1) * latency
    collective-permute:         bytes / bw + (n-1) * latency
    all-to-all:                 (n-1)/n * bytes / bw + (n-1) * latency

all-to-all is MPICH's pairwise exchange for long messages, (n-1) latency + (n-1)/n *
bytes / bw with `bytes` a device's whole send buffer (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, sec. 4.4):
each device sends every peer its 1/n slice over its own link, at link bandwidth.
On the calibrated CPU the (latency, bandwidth) of each kind is the fitted one.

Overlap model (only when `hw.overlap`: XLA's async collectives and latency-hiding
scheduler on accelerators; on CPU every collective is synchronous and exposed). A
collective can hide under the scanned blocks' compute when nothing that compute needs
waits for it:
- FSDP grad reduce-scatters (scope `gather_params`, backward): layer i's grads reduce
  while layer i-1's backward computes; the unembedding's (scope `loss`, backward, over
  the params' axes: made before any layer's backward, read by nothing but the update)
  while the layers' backward computes (not the embedding's, made last);
- FSDP weight all-gathers (scope `gather_params`, forward and remat recompute) only
  with prefetch, which issues layer i+1's gather before layer i's compute; without it
  the gather feeds the very next matmul and is exposed;
- collective-permutes of the ring collective matmuls (`--tp-comm ring`): each step's
  ppermute runs under the partial matmul of the chunk already held.
Without overlap (a shared host) the same collectives are exposed and still run beside
the blocks' compute, XLA:CPU running a device's independent ops at once, and contend
with it for the cores: each costs 1 + `hw.beside_cost` times its own time (measured by
`microbench_comm.beside_cost`: a layer's matmuls and a weight gather alone and together).
Everything else (tp all-reduces, sequence-parallel gathers / reduce-scatters, grad
all-reduces over dp, the loss's reductions) sits between dependent computations and is
exposed. Hideable time beyond the blocks' compute is exposed too (scaled evenly). A
hidden collective is not free where compute runs slower beside it
(`hw.overlap_slowdown` s, GPUs): the compute it hides under takes 1 + s times as long,
so s / (1 + s) of the collective's hidden time stays on the critical path, counted in
its exposed time. Predicted step = compute + exposed communication (+ on a shared host,
where the compiled step's temporaries are known, the page faults of those mapped anew
each step: `fault_seconds`).

On an accelerator profile (`hw.fusion`, `hw.flash`) compute rows move their share of
their XLA fusion group's bytes (engine/cost/fusion.py) and attention is the target's
flash kernel: the jnp scan's matmul FLOPs times the causal tile fraction, at
`attention_eff` of the matmul peak, or where the kernel's speed is published per
sequence length (`attention_rates`), half the scan's FLOPs at the forward's or the
backward's measured rate for the row's key count. The CPU prices `Row.bytes` and the
scan's own rows.
"""
from __future__ import annotations

import dataclasses
import os

from engine.cost import nccl
from engine.cost.hardware import Hardware, Link
from engine.cost.ledger import COLLECTIVES, WIDENED_KINDS, Row
from layers.roles import roles_sharding
from layers.scopes import BLOCK_SCOPES

PARAM_AXES = frozenset(roles_sharding("params"))  # the axes param grads are scattered over

# Elementwise ops XLA evaluates by a polynomial or rational approximation, tens of vector
# instructions an element (XLA:CPU's `exp` and `log` lowerings, `tanh` and `logistic`
# through them), priced at `Hardware.transcendental_flops`; every other elementwise op
# is one or a few instructions (add, mul, max, select, convert, div, sqrt) at
# `vector_flops`. On this host (bench/calibrate.py) exp runs ~10x slower an element
# than a multiply-add.
TRANSCENDENTAL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sin", "cos", "tan",
    "atan2", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf",
    "erfc", "erf_inv", "lgamma", "digamma", "pow"})

RING = {"all-gather": (1, 1), "reduce-scatter": (1, 1), "all-reduce": (2, 2),
        "all-to-all": (1, 1), "collective-permute": (None, 1)}


def ring_factor(kind: str, n: int) -> tuple[float, int]:
    """(fraction of the buffer each device sends, latency hops) of a ring collective of
    `kind` over n devices: (n-1)/n and n-1 for all-gather / reduce-scatter / all-to-all,
    2(n-1)/n and 2(n-1) for all-reduce (a reduce-scatter then an all-gather), 1 and n-1
    for a collective-permute (the whole buffer once; n-1 latencies, as the CPU
    calibration fits them: `microbench_comm.fit` uses this same factor)."""
    bw_mult, hop_mult = RING[kind]
    frac = 1.0 if bw_mult is None else bw_mult * (n - 1) / n
    hops = 1 if hop_mult is None else hop_mult * (n - 1)
    return frac, hops


@dataclasses.dataclass(frozen=True)
class Priced:
    """A row with its predicted seconds per step (all `count` executions), its bound,
    and for collectives the part left on the critical path by the overlap model."""

    row: Row
    seconds: float
    bound: str
    exposed: float = 0.0


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds per step: compute (matmul + memory rows), comm (all collectives),
    exposed_comm (what the overlap model leaves on the critical path), fault (a shared
    host faulting in temporaries mapped anew each step: `with_faults`), step."""

    rows: tuple
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    hardware: str
    fault_s: float = 0.0


def domain_share(hw: Hardware, mesh_axes, axes: tuple[str, ...]) -> tuple[int, bool]:
    """(k, crosses): how many of a group's devices share one fast domain (a GPU node, a
    TPU slice), and whether the group spans more than one. An axis stays inside a domain
    while it and every axis inside it (later in the layout) fit in one;
    k = product over the group's axes of min(size, fast_domain / stride), stride = the
    product of the sizes of the axes after it."""
    names = [n for n, _ in mesh_axes]
    sizes = [s for _, s in mesh_axes]
    crosses, k = False, 1
    for a in axes:
        i = names.index(a)
        inner = 1
        for s in sizes[i:]:
            inner *= s
        stride = inner // sizes[i]
        k *= max(1, min(sizes[i], hw.fast_domain // stride))
        if inner > hw.fast_domain:
            crosses = True
    return k, crosses


def link_for(hw: Hardware, mesh_axes, axes: tuple[str, ...]):
    """The slowest link tier any of `axes` uses (`domain_share`).

    A group crossing fast domains runs its rings over the slow tier, one ring channel per
    NIC: when k of the group's devices share a fast domain (a node), each with its own
    NIC (the GPU profiles' one NIC per GPU), k channels cross between domains at once and
    the group's bus bandwidth is k NICs' worth, capped by the fast tier: NCCL builds
    one ring channel per NIC on rail-optimized nodes (DGX A100 / H100 reference
    architectures: 8 x 200 / 400 Gb/s per node), so a ring crossing nodes is bounded by
    the node's aggregate NIC rate, not one NIC's."""
    k, crosses = domain_share(hw, mesh_axes, axes)
    if not crosses:
        return hw.fast
    return Link(min(hw.fast.bandwidth, hw.slow.bandwidth * k), hw.slow.latency)


def torus_rings(hw: Hardware, n: int) -> tuple[int, int]:
    """(d, hops) of a group of n chips inside a TPU slice (`Hardware.torus`): it fills
    the torus dimensions in turn, the last one in part, spanning d of them; its rings
    run on all d at once and take sum(side - 1) hops over the sides it fills (a 3D
    torus's last dimension takes the rest of a group larger than the cube: v5p and v4
    slices beyond 64 chips grow their dimensions past 4)."""
    d, hops, left = 0, 0, n
    for i, side in enumerate(hw.torus):
        if left <= 1:
            break
        side = left if i == len(hw.torus) - 1 else min(side, left)
        d, hops, left = d + 1, hops + side - 1, -(-left // side)
    return max(d, 1), max(hops, n - 1 if not hw.torus else 1)


def collective_key(row: Row) -> tuple:
    """What one execution of a collective row costs on a host, as
    `Hardware.collective_seconds` keys its measurement: (kind, group size, ledger bytes,
    dtype)."""
    return COLLECTIVES.get(row.primitive), row.axis_size, int(row.bytes), row.dtype


def collective_seconds(row: Row, hw: Hardware, mesh_axes) -> float:
    """One execution of a collective row (0 for pvary and size-1 axes): its measured
    time where the profile has one, on a GPU profile NCCL's (engine/cost/nccl.py: its
    algorithm and protocol of least time for the group's ranks per node), else the ring
    formula."""
    kind = COLLECTIVES.get(row.primitive)
    n = row.axis_size
    if kind is None or n == 1 or row.bytes == 0:
        return 0.0
    if (measured := hw.collective_seconds.get(collective_key(row))) is not None:
        return measured
    if hw.nccl is not None and kind not in hw.collective_fit:
        k, crosses = domain_share(hw, mesh_axes, row.axes)
        return nccl.seconds(kind, n, k if crosses else n, row.bytes, hw.nccl)
    if kind in hw.collective_fit:
        latency, bw = hw.collective_fit[kind]
        eff = 1.0
    else:
        link = link_for(hw, mesh_axes, row.axes)
        latency, bw, eff = link.latency, link.bandwidth, hw.link_eff
    frac, hops = ring_factor(kind, n)
    if (hw.torus and kind in ("all-gather", "reduce-scatter", "all-reduce")
            and kind not in hw.collective_fit
            and not domain_share(hw, mesh_axes, row.axes)[1]):  # rings on every dimension
        d, ring_hops = torus_rings(hw, n)
        bw, hops = bw * d, RING[kind][1] * ring_hops
    widened = hw.bf16_collectives_in_f32 and row.dtype == "bfloat16" and kind in WIDENED_KINDS
    nbytes = 2 * row.bytes if widened else row.bytes
    return frac * nbytes / (bw * eff) + hops * latency


def causal_tile_fraction(keys: int, tile: int) -> float:
    """Fraction of the [L, L] score tiles a causal flash kernel computes with square
    tiles of `tile`: the n (n + 1) / 2 tiles on or below the diagonal of n², n = L / tile
    (rounded up)."""
    n = max(1, -(-keys // tile))
    return (n + 1) / (2 * n)


def attention_flops(row: Row, hw: Hardware) -> float:
    """FLOPs the target's flash kernel is priced for in a `kind="attention"` row: the jnp
    scan's matmul FLOPs (all J x T key blocks of every query) times the causal tile
    fraction; with measured `hw.attention_rates`, half of them, the convention those
    benchmarks' FLOP/s are counted in."""
    if hw.attention_rates:
        return row.flops / 2
    blocks, block = row.shape
    return row.flops * causal_tile_fraction(blocks * block, hw.attention_tile)


def attention_rate(row: Row, hw: Hardware) -> float:
    """FLOP/s of the target's flash kernel for a `kind="attention"` row: its forward's
    (phases fwd, recompute) or backward's fraction of the matmul peak at the row's
    key count (`Hardware.attention_fraction`)."""
    blocks, block = row.shape
    fraction = hw.attention_fraction(blocks * block, backward=row.phase == "bwd")
    return hw.matmul_peak(row.dtype) * fraction


def priced_rows(rows: list[Row], hw: Hardware) -> list[Row]:
    """The rows the target runs: with a flash kernel (`hw.flash`), the attention
    kernel rows replace the jnp scan's rows (`Row.kernel`); otherwise (CPU) the scan's
    rows are what runs and the kernel rows are dropped. The copies laying dot operands
    out for XLA:CPU's dot library (`Row.relayout`) run only where the profile prices
    them (`Hardware.relayout_bw`), and the casts around a bf16 collective only where the
    runtime widens it to f32 (`Row.widen`, `Hardware.bf16_collectives_in_f32`)."""
    if not hw.relayout_bw:
        rows = [r for r in rows if not r.relayout]
    if not hw.bf16_collectives_in_f32:
        rows = [r for r in rows if not r.widen]
    if hw.flash:
        return [r for r in rows if not r.kernel]
    return [r for r in rows if r.kind != "attention"]


def moved_bytes(row: Row, hw: Hardware) -> float:
    """Bytes one execution of a compute row moves on `hw`: its fusion group share with
    `hw.fusion`, else `Row.bytes`; but nothing for the rows XLA adds to lower a scan
    (`Row.scan_stack`, `Row.loop_copy`) on an unfused accelerator (an eager framework,
    whose layer loop stacks, slices and copies nothing)."""
    if not hw.fusion:
        return 0.0 if (row.scan_stack or row.loop_copy) and not hw.shared_host else row.bytes
    fused = row.fused_bytes if hw.epilogue_fusion else row.lib_bytes
    return fused if fused >= 0 else row.bytes


def fusion_id(row: Row, hw: Hardware) -> int:
    """The row's fusion group on `hw` (engine/cost/fusion.py), -1 for none."""
    return row.fusion if hw.epilogue_fusion else row.lib_fusion


def compute_seconds(row: Row, hw: Hardware, n_devices: int) -> tuple[float, str]:
    """(seconds of one execution, "compute" | "memory") by roofline, or a dot's measured
    seconds when the profile has them. On a shared host the devices' work adds up:
    n_devices times the per-device work at the host's rate. With `hw.fusion` a row moves
    its share of its fusion group's bytes (engine/cost/fusion.py), else `Row.bytes`; a
    dot operand's relayout copy (`Row.relayout`) moves its bytes at `hw.relayout_bw`."""
    if row.dot in hw.dot_seconds:  # measured with every device at once: no scale
        return hw.dot_seconds[row.dot], "compute"
    scale = n_devices if hw.shared_host and not hw.concurrent_rates else 1
    if row.relayout:
        return scale * row.bytes / hw.relayout_bw, "memory"
    if row.kind == "attention":
        peak, flops = attention_rate(row, hw), attention_flops(row, hw)
    elif row.kind == "matmul":
        peak, flops = hw.matmul_rate(row.dtype), row.flops
    elif row.primitive in TRANSCENDENTAL and hw.transcendental_flops:
        peak, flops = hw.transcendental_flops, row.flops
    else:
        peak, flops = hw.vector_flops, row.flops
    t_flops = flops / peak
    t_bytes = moved_bytes(row, hw) / (hw.hbm * hw.mem_eff)
    if row.scan_stack and hw.cold_hbm:  # the stack's share out of cache, the rest in it
        t_bytes *= 1 - row.scan_stack + row.scan_stack * hw.hbm / hw.cold_hbm
    return scale * max(t_flops, t_bytes), "compute" if t_flops >= t_bytes else "memory"


def hideable(row: Row, prefetch: bool = False) -> bool:
    """Whether the overlap model lets this collective run under block compute."""
    if row.scope == "gather_params":
        return row.phase == "bwd" or prefetch
    if (row.scope == "loss" and row.phase == "bwd" and set(row.axes) <= PARAM_AXES
            and COLLECTIVES.get(row.primitive) == "reduce-scatter"):
        return True  # the unembedding's grad: reduced while the layers' backward runs
    return COLLECTIVES.get(row.primitive) == "collective-permute" and row.scope in BLOCK_SCOPES


def predict(rows: list[Row], hw: Hardware, mesh_axes, prefetch: bool = False,
            itemized: bool = True) -> Prediction:
    """Price every row and combine them with the overlap model (module doc). itemized
    False: the totals alone, `Prediction.rows` empty (the planner prices thousands of
    row sets and reads only the seconds)."""
    n_devices = 1
    for _, s in mesh_axes:
        n_devices *= s
    priced, compute, block_compute, comm, hidable = [], 0.0, 0.0, 0.0, 0.0
    for r in priced_rows(rows, hw):  # (row, seconds, bound, may hide under block compute)
        if r.kind == "collective":
            t = collective_seconds(r, hw, mesh_axes) * r.count
            beside = hideable(r, prefetch)
            if beside and not hw.overlap:  # run beside compute on shared cores
                t *= 1 + hw.beside_cost
            hides = beside and hw.overlap
            comm += t
            hidable += t if hides else 0.0
            priced.append((r, t, "comm", hides))
        else:
            t, bound = compute_seconds(r, hw, n_devices)
            t *= r.count
            compute += t
            if r.scope in BLOCK_SCOPES:
                block_compute += t
            priced.append((r, t, bound, False))
    hidden_frac = min(1.0, block_compute / hidable) if hidable else 0.0
    # what a hideable collective leaves on the critical path: the part beyond the
    # blocks' compute, and the slowdown of the compute it hides under
    left = 1 - hidden_frac + hidden_frac * hw.hidden_comm_share
    if not itemized:
        exposed = sum(t * (left if hides else 1) for _, t, bound, hides in priced
                      if bound == "comm")
        return Prediction((), compute, comm, exposed, compute + exposed, hw.name)
    priced = [Priced(r, t, bound, t * (left if hides else 1) if bound == "comm" else 0.0)
              for r, t, bound, hides in priced]
    exposed = sum(p.exposed for p in priced)
    return Prediction(tuple(priced), compute, comm, exposed, compute + exposed, hw.name)


def fault_seconds(hw: Hardware, n_devices: int, mapped_bytes: float) -> float:
    """Seconds a step spends faulting in the temporaries each of `n_devices` devices maps
    anew every step (`mapped_bytes` per device: engine/run/host.py `mapped_each_step`), at
    the profile's `fault_cost` a byte, measured on one thread. The kernel serves a
    thread's page faults on the core that thread runs on, so the devices' faults spread
    over the host's cores: n_devices x bytes x cost / min(n_devices, cores)."""
    if not mapped_bytes or not hw.fault_cost:
        return 0.0
    cores = max(1, min(n_devices, os.cpu_count() or 1))
    return n_devices * mapped_bytes * hw.fault_cost / cores


def with_faults(pred: Prediction, fault_s: float) -> Prediction:
    """`pred` with `fault_s` of page faults added to its step (`fault_seconds`)."""
    return dataclasses.replace(pred, fault_s=fault_s, step_s=pred.step_s - pred.fault_s + fault_s)


def model_flops(cfg, tcfg) -> float:
    """Model FLOPs of one step (6 per param per token + attention; no remat): the MFU
    numerator the training CLI uses."""
    from engine.run.mfu import flops_per_token

    return flops_per_token(cfg, tcfg.seq) * tcfg.batch * tcfg.seq


def mfu_peak(cfg, hw: Hardware, n_devices: int) -> float:
    """The MFU denominator, FLOP/s: the peak matmul rate of the compute dtype
    (`Hardware.mfu_peak_of`) per chip times chips; on a shared host the host's peak once
    (its devices share it), as engine/run/mfu.py measures it for the training CLI."""
    dtype = "bfloat16" if cfg.dtype == "bf16" else "float32"
    return hw.mfu_peak_of(dtype) * (1 if hw.shared_host else n_devices)


def mfu(cfg, tcfg, hw: Hardware, n_devices: int, step_s: float) -> float:
    """Model FLOPs per second of a step of `step_s` over `mfu_peak`, a fraction (printed
    as a percent, like the training CLI)."""
    return model_flops(cfg, tcfg) / (step_s * mfu_peak(cfg, hw, n_devices))


def predicted_mfu(pred: Prediction, cfg, tcfg, hw: Hardware, n_devices: int) -> float:
    """`mfu` of the predicted step, a fraction."""
    return mfu(cfg, tcfg, hw, n_devices, pred.step_s)
