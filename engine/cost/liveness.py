"""Per-device peak memory of a traced step from the program's liveness (no fitted terms).

`peak_bytes(closed_jaxpr)` walks the jaxpr in program order and tracks the buffers live
at each equation:

- an equation's outputs are allocated when it runs (before its inputs are freed: no
  in-place reuse) and freed after their last use; a jaxpr's outputs live to its end;
- the step's arguments live throughout unless donated (then freed after their last use:
  the donated params and optimizer state are updated in place);
- bitcasts (`reshape`, `squeeze`, `expand_dims`, `pvary`, `stop_gradient`,
  `optimization_barrier`) and call outputs that return an argument alias their operand
  instead of allocating;
- calls (`jit`, `remat`, custom_vjp / custom_jvp bodies, `shard_map`) add their body's
  own peak above what the caller holds; the body's operands stay the caller's;
- `scan` holds, while it runs, its stacked outputs at full size ([N, ...]: XLA allocates
  them before the loop; under remat these are the residuals the backward reads), its
  carry, one slice of each scanned input and its body's peak; `while` its carry and the
  larger of its body's and its condition's peaks; `cond` the largest branch's.

The step's jaxpr (`ledger.trace_step`) is a `jit` holding one `shard_map`: `peak_bytes`
unwraps both, so the walk runs on the per-device body (shapes per device; the jit's
donation mapped onto the body's arguments). An equation outside any shard_map would be
counted at its global shape (exact on one device; the step has none).

With `fuse=True`, an elementwise intermediate (`fusion.FUSIBLE`) whose every consumer is
elementwise or a reduction in the same jaxpr is not materialised (XLA's loop and input
fusion; the ledger's XLA:CPU byte model uses the same rule): only what leaves a fused
chain (into a matmul, a collective, a loop, a call or out of the jaxpr) takes memory.

Both are models of a program without XLA's scheduling: operands die at their last use in
program order, not in the order the compiler reschedules them, and nothing is shared
between buffers that are live at different times except by freeing.

Against XLA:CPU (`python bench/memory.py`: compile only, remat full, reference
attention, batch 16; tiny at L = 64, small at L = 256; MiB per device, ratio to the
measured peak `memory.measure` = arguments + temp + unaliased outputs):

    model layout    dtype  measured  memory.predict  liveness       liveness, fused
    tiny  fsdp8     f32       1.87    1.68 (0.90)     2.11 (1.13)     1.32 (0.70)
    tiny  fsdp8     bf16      1.46    1.40 (0.96)     1.92 (1.31)     1.27 (0.87)
    tiny  fsdp4xtp2 f32       2.11    1.89 (0.90)     2.39 (1.13)     1.41 (0.67)
    tiny  fsdp4xtp2 bf16      1.70    1.60 (0.94)     2.27 (1.33)     1.50 (0.88)
    tiny  single    f32      14.46   11.91 (0.82)    15.25 (1.05)    11.62 (0.80)
    tiny  single    bf16     11.61   10.21 (0.88)    14.55 (1.25)    11.07 (0.95)
    small fsdp8     f32      36.39   33.35 (0.92)    43.30 (1.19)    26.38 (0.73)
    small fsdp8     bf16     30.53   28.97 (0.95)    39.30 (1.29)    24.73 (0.81)
    small fsdp4xtp2 f32      41.15   38.10 (0.93)    48.82 (1.19)    28.76 (0.70)
    small fsdp4xtp2 bf16     34.33   33.54 (0.98)    45.82 (1.33)    29.29 (0.85)
    small single    f32     320.76  264.39 (0.82)   322.02 (1.00)   249.32 (0.78)
    small single    bf16    281.51  237.27 (0.84)   302.77 (1.08)   232.44 (0.83)

With chunked attention (one custom_vjp over its query chunks; `--presets tiny --attention
chunked`, same six tiny rows) the unfused walk is 0.98-1.38x and the fused one
0.78-1.18x. With the
jnp `blocked` kernel (a scan over key blocks inside each layer's scan; `--presets tiny
--layouts fsdp4xtp2 single --attention blocked`, which `memory.predict` refuses on cpu)
it is not a bound: 0.94x and 0.88x in f32, 1.17x and 1.18x in bf16 (fused 0.61-0.91x);
what XLA:CPU holds there beyond the walk (copies into the nested loops' state are the
suspect) was not read off its buffer assignment.

The unfused walk is an upper bound on every row of the table (1.00-1.33x): its peak
falls, as the compiler's does, in the backward scan over layers while one layer is recomputed and
differentiated; it overcounts most in bf16 (each cast a buffer of its own, where XLA
fuses casts into their consumers) and least on one device (the argument bytes dominate).
The fused walk is under XLA:CPU's peak (0.67-0.95x): XLA:CPU keeps more elementwise
intermediates than the fusion rule lets through (multi-consumer f32 MLP values, the
softmax's exponential), so on CPU it is not a bound either way; on an accelerator, whose
XLA fuses more, it is the closer estimate (not checked against a compiler).
"""
from __future__ import annotations

from collections import Counter

from jax.extend import core as jcore

from engine.cost.fusion import FUSIBLE, REDUCTIONS, nbytes
from engine.cost.scan_rows import scan_counts

# ops XLA turns into bitcasts of their operand (or that only mark it): no new buffer
ALIASES = {"reshape", "squeeze", "expand_dims", "pvary", "stop_gradient",
           "optimization_barrier", "name"}
# primitives whose single body runs once per call with the call's operands as arguments
CALLS = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
         "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin",
         "shard_map"}


def _body(eqn):
    """The jaxpr of a call equation (its `jaxpr` or `call_jaxpr` param), else None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr
        if isinstance(sub, jcore.Jaxpr):
            return sub
    return None


def _jaxpr(sub):
    return sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub


class _Walk:
    """One jaxpr's walk: `peak` above what the caller holds, `snapshot` the buffers
    [(label, bytes)] live at that peak, `outs` per output: ("alias", input index) or
    ("new", bytes)."""

    def __init__(self, jaxpr, fuse: bool, donated=frozenset(), held=None):
        self.fuse = fuse
        uses = Counter()
        consumers: dict = {}
        for eqn in jaxpr.eqns:
            for v in {v for v in eqn.invars if isinstance(v, jcore.Var)}:
                uses[v] += 1
                consumers.setdefault(v, []).append(eqn.primitive.name)
        for v in jaxpr.outvars:
            if isinstance(v, jcore.Var):
                uses[v] += 1 << 40  # live to the end
        self.root, self.refs, self.bytes, self.label = {}, {}, {}, {}
        self.live, self.peak, self.snapshot = 0, 0, []
        # the caller's buffers: held (not freed here) unless donated
        for i, v in enumerate(jaxpr.invars):
            self.root[v] = v
            self.refs[v] = uses[v]
            self.bytes[v] = held[i] if held is not None else 0
            self.label[v] = "arguments"
            self.live += self.bytes[v]
        self.freeable = set(donated)
        self.peak, self.snapshot = self.live, self._items()
        self.fused = set()
        if fuse:
            outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in FUSIBLE and eqn.primitive.name not in ALIASES:
                    self.fused.update(v for v in eqn.outvars if v not in outs and all(
                        c in FUSIBLE or c in REDUCTIONS for c in consumers.get(v, [])))
        self.uses = uses
        for eqn in jaxpr.eqns:
            self._eqn(eqn)
        self.outs = []
        index = {v: i for i, v in enumerate(jaxpr.invars)}
        for v in jaxpr.outvars:
            r = self.root.get(v) if isinstance(v, jcore.Var) else None
            self.outs.append(("alias", index[r]) if r in index
                             else ("new", self.bytes.get(r, 0) if r is not None else 0))

    def _items(self, extra=()):
        """[(label, bytes)] of the buffers live now, then `extra`."""
        return [(self.label[r], self.bytes[r]) for r in self.refs if self.bytes[r]] + list(extra)

    def _at(self, extra: int, items):
        if self.live + extra > self.peak:
            self.peak = self.live + extra
            self.snapshot = self._items(items)

    def _new(self, v, size: int, label: str):
        self.root[v] = v
        self.refs[v] = self.uses[v]
        self.bytes[v] = 0 if v in self.fused else size
        self.label[v] = label
        self.freeable.add(v)
        self.live += self.bytes[v]

    def _alias(self, v, of):
        r = self.root[of] if isinstance(of, jcore.Var) else None
        if r is None or r not in self.refs:
            return self._new(v, 0, "literal")
        self.root[v] = r
        self.refs[r] += self.uses[v]

    def _release(self, eqn):
        for v in {v for v in eqn.invars if isinstance(v, jcore.Var)}:
            r = self.root[v]
            self.refs[r] -= 1
            if self.refs[r] == 0 and r in self.freeable:
                del self.refs[r]
                self.live -= self.bytes[r]
        for v in eqn.outvars:  # produced but never used
            r = self.root.get(v)
            if r is v and self.refs.get(r) == 0:
                del self.refs[r]
                self.live -= self.bytes[r]

    def _eqn(self, eqn):
        name = eqn.primitive.name
        outs = list(eqn.outvars)
        if name in ALIASES:
            self._at(0, ())
            for o, i in zip(outs, eqn.invars):
                self._alias(o, i)
        elif name == "scan":
            self._scan(eqn)
        elif name == "while":
            self._loop(eqn, [_jaxpr(eqn.params["body_jaxpr"]), _jaxpr(eqn.params["cond_jaxpr"])],
                       carry_from=eqn.params["body_nconsts"] + eqn.params["cond_nconsts"])
        elif name == "cond":
            self._loop(eqn, [_jaxpr(b) for b in eqn.params["branches"]], carry_from=None)
        elif name in CALLS and _body(eqn) is not None:
            body = _body(eqn)
            sub = _Walk(body, self.fuse)
            self._at(sub.peak, [(f"{name}: {lab}", b) for lab, b in sub.snapshot])
            for o, (kind, x) in zip(outs, sub.outs):
                if kind == "alias":
                    self._alias(o, eqn.invars[x])
                else:
                    self._new(o, x, f"{name} outputs")
        else:
            sizes = [0 if o in self.fused else nbytes(o.aval) for o in outs]
            self._at(sum(sizes), [(name, s) for s in sizes if s])
            for o in outs:
                self._new(o, nbytes(o.aval), name)
        self._release(eqn)

    def _scan(self, eqn):
        p = eqn.params
        body = _jaxpr(p["jaxpr"])
        nc, nk = scan_counts(eqn)
        carry = sum(nbytes(v.aval) for v in eqn.outvars[:nk])
        stacked = sum(nbytes(v.aval) for v in eqn.outvars[nk:])
        slices = sum(nbytes(v.aval) for v in body.invars[nc + nk:])
        sub = _Walk(body, self.fuse)
        held = [("scan carry", carry), (f"scan stacked outputs [{p['length']}, ...]", stacked),
                ("scan input slices", slices)]
        self._at(carry + stacked + slices + sub.peak,
                 [x for x in held if x[1]] + [(f"scan body: {lab}", b) for lab, b in sub.snapshot])
        for i, o in enumerate(eqn.outvars):
            self._new(o, nbytes(o.aval), "scan carry" if i < nk
                      else f"scan stacked outputs [{p['length']}, ...]")

    def _loop(self, eqn, bodies, carry_from):
        subs = [_Walk(b, self.fuse) for b in bodies]
        worst = max(subs, key=lambda s: s.peak)
        carry = sum(nbytes(v.aval) for v in eqn.outvars) if carry_from is not None else 0
        self._at(carry + worst.peak, [("loop carry", carry)] +
                 [(f"{eqn.primitive.name} body: {lab}", b) for lab, b in worst.snapshot])
        for o in eqn.outvars:
            self._new(o, nbytes(o.aval), f"{eqn.primitive.name} outputs")


def _unwrap(closed) -> tuple:
    """(jaxpr, donated invars, argument bytes): through a jit holding one shard_map, the
    per-device body with the jit's donation mapped onto its arguments."""
    jaxpr = closed.jaxpr
    donated = set()
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in ("jit", "pjit", "shard_map"):
        eqn = jaxpr.eqns[0]
        body = _body(eqn)
        flags = eqn.params.get("donated_invars", (False,) * len(eqn.invars))
        donated = {bv for ov, bv, flag in zip(eqn.invars, body.invars, flags)
                   if flag or ov in donated}
        jaxpr = body
    return jaxpr, donated, [nbytes(v.aval) for v in jaxpr.invars]


def peak_bytes(closed, fuse: bool = False) -> tuple[int, dict]:
    """(peak, breakdown): the most bytes live at once on one device while `closed` (a
    ClosedJaxpr, e.g. `ledger.trace_step`'s) runs, and what is live at that moment,
    {label: bytes} largest first, summing to the peak ("arguments": the step's inputs
    still held; "scan stacked outputs [N, ...]": what a scan saves; else the producing
    primitive, prefixed by the calls and loop bodies it runs in). Module doc."""
    jaxpr, donated, held = _unwrap(closed)
    walk = _Walk(jaxpr, fuse, donated, held)
    breakdown = Counter()
    for label, b in walk.snapshot:
        breakdown[label] += b
    assert sum(breakdown.values()) == walk.peak, (sum(breakdown.values()), walk.peak)
    return walk.peak, dict(breakdown.most_common())
