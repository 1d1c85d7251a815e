"""A backward split in two by dependency: B (the input gradient) and W (the weight
gradient), for the zero-bubble schedule (Qi et al. 2023, engine/parallel/schedules.py).

`split(f, *args, b_out=...)` traces f(*args) -> a flat tuple of outputs to a jaxpr and
cuts it: B is every equation an output in `b_out` needs; W is every other equation the
remaining outputs need. What W reads of B's values (the crossing values: a layer's
output cotangent, the activations its weight gradient multiplies) are extra outputs of
B, handed to W later, so W recomputes nothing of B's chain.

Equations that hold sub-jaxprs: calls (`jit`, `remat`, custom derivatives' calls) are
inlined first (`inline`); a `scan` needed by both parts is split through its body: B's
scan computes the carries B needs (to a fixed point: a carry whose update reads another
carry needs that one too) and its ys, and emits the body's crossing values as stacked
ys; W's scan takes them as xs, with the carries only W needs (an accumulated weight
gradient) as its own. Any other equation (`cond`, collectives, arithmetic) runs whole in
the part that first needs it, B before W: a `cond` whose outputs both parts read runs in
B and hands W what it computed.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # the name stack `jax.core.eval_jaxpr` keeps
from jax.extend import core

from collectives.basic import broadcast, varying_axes

CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
         "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def scan_counts(eqn) -> tuple[int, int]:
    """(consts, carry) operand counts of a `scan` equation: jax 0.10 names them in its
    params; newer jax keeps one flat tree of (consts, carry, xs) (`ft_in`)."""
    p = eqn.params
    if "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


def _sub_jaxpr(eqn):
    """(jaxpr, consts) a call equation runs."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            break
    if isinstance(sub, core.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


@contextlib.contextmanager
def _source_of(eqn):
    """Trace under `eqn`'s source info, as `jax.core.eval_jaxpr` does: its name stack
    (the named scopes and the transforms, e.g. `transpose`, the cost model's rows read
    their scope and phase from) after the current one, and its context."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
            eqn.ctx.manager:
        yield


def _holds_jaxpr(value) -> bool:
    """A jaxpr, or a tuple of them (`cond`'s branches)."""
    if isinstance(value, tuple | list):
        return any(map(_holds_jaxpr, value))
    return isinstance(value, core.ClosedJaxpr | core.Jaxpr)


def _match_varying(eqn, ins):
    """`ins` marked varying over the union of the axes each varies over, when they differ
    and `eqn` is a plain primitive (no sub-jaxpr), as `jax.lax`'s wrappers insert `pvary`
    before they bind. W reads what B made through the pipeline's W slots, which vary over
    pp: a value invariant when traced (a layer index, a mask) comes back varying, and its
    equation's other operands must be marked so too."""
    if any(map(_holds_jaxpr, eqn.params.values())):  # its operands typed by its jaxprs
        return ins
    vmas = [varying_axes(x) if isinstance(x, jax.Array) else frozenset() for x in ins]
    union = frozenset().union(*vmas)
    if all(vma == union for vma in vmas):
        return ins
    return [broadcast(jnp.asarray(x), tuple(sorted(union))) if union - vma else x
            for x, vma in zip(ins, vmas)]


def _bind(eqn, ins):
    """Bind `eqn`'s primitive on `ins` under its source info (`_source_of`); its outputs
    as a list."""
    ins = _match_varying(eqn, ins)
    if eqn.primitive.name == "pvary":  # an operand that came back varying is marked already
        axes = tuple(a for a in eqn.params["axes"] if a not in varying_axes(ins[0]))
        if not axes:
            return list(ins)
        eqn = eqn.replace(params=dict(eqn.params, axes=axes))
    with _source_of(eqn):
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


def _read(env, v):
    return v.val if isinstance(v, core.Literal) else env[v]


def _eval_inlined(jaxpr, consts, args):
    """Evaluate `jaxpr` binding its equations again, calls inlined and scans' bodies
    evaluated so too (traced under jax.make_jaxpr this gives the flat jaxpr)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in CALLS:
            sub, sub_consts = _sub_jaxpr(eqn)
            if name == "custom_vjp_call" or sub is None:
                outs = _bind(eqn, ins)
            else:  # the call's equations under its scopes, as if it were bound whole
                with _source_of(eqn):
                    outs = _eval_inlined(sub, sub_consts, ins)
        elif name == "scan":
            outs = _scan(eqn, ins, lambda body, b_consts, a: _eval_inlined(body, b_consts, a))
        else:
            outs = _bind(eqn, ins)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def _scan(eqn, ins, body_fn):
    """A scan equation run by `lax.scan` over `body_fn(body, consts, body args)`."""
    p = eqn.params
    nc, ncar = scan_counts(eqn)
    closed = p["jaxpr"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]

    def body(carry, x):
        outs = body_fn(closed.jaxpr, closed.consts, [*consts, *carry, *x])
        return outs[:ncar], outs[ncar:]

    with _source_of(eqn):  # a new scan equation: the old one's scopes (its body's own)
        carry, ys = lax.scan(body, init, xs, length=p["length"], reverse=p["reverse"])
    return [*carry, *ys]


def inline(f, *args):
    """The ClosedJaxpr of f(*args) (flat outputs) with calls inlined (module doc)."""
    closed = jax.make_jaxpr(f)(*args)
    flat = jax.tree.leaves(args)
    return jax.make_jaxpr(lambda *a: _eval_inlined(closed.jaxpr, closed.consts, a))(*flat)


@dataclasses.dataclass
class Plan:
    """How one jaxpr's equations are shared out (indices into `eqns`)."""

    b_eqns: set
    w_eqns: set
    scans: dict  # eqn index -> ScanPlan of a scan W and B both run
    cross: list  # what W reads of B: Vars, or (eqn index, j) for a split scan's j-th
    b_in: list  # [bool] per jaxpr invar: read by B
    w_in: list  # read by W (not through a crossing value)


@dataclasses.dataclass
class ScanPlan:
    b_carry: list
    w_carry: list
    b_ys: list
    w_ys: list
    body: Plan


def _outputs_of(eqn, i, plan_scans, part):
    """The outvars of equation i the part produces."""
    if i in plan_scans:
        s = plan_scans[i]
        mask = (s.b_carry + s.b_ys) if part == "B" else (s.w_carry + s.w_ys)
        return [v for v, m in zip(eqn.outvars, mask) if m]
    return list(eqn.outvars)


def analyze(jaxpr, need_b: list, need_w: list) -> Plan:
    """Share out `jaxpr`'s equations: B computes the outputs flagged in need_b, W those in
    need_w that B does not."""
    vb = {v for v, m in zip(jaxpr.outvars, need_b) if m and not isinstance(v, core.Literal)}
    vw = {v for v, m in zip(jaxpr.outvars, need_w) if m and not isinstance(v, core.Literal)}
    b_eqns, w_eqns, scans = set(), set(), {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs_b = [v in vb for v in eqn.outvars]
        outs_w = [v in vw for v in eqn.outvars]
        ins = [v for v in eqn.invars if not isinstance(v, core.Literal)]
        if eqn.primitive.name == "scan" and any(outs_w):
            s, b_in, w_in = _analyze_scan(eqn, outs_b, outs_w)
            if not any(s.w_carry + s.w_ys):  # B gives all W reads: the scan whole in B
                b_eqns.add(i)
                vb.update(ins)
                continue
            if any(s.b_carry + s.b_ys):
                b_eqns.add(i)
                vb.update(v for v, m in zip(eqn.invars, b_in) if m and v in ins)
            w_eqns.add(i)
            vw.update(v for v, m in zip(eqn.invars, w_in) if m and v in ins)
            scans[i] = s
        elif any(outs_b):
            b_eqns.add(i)
            vb.update(ins)
        elif any(outs_w):
            w_eqns.add(i)
            vw.update(ins)
    cross = []
    for i in sorted(b_eqns):
        eqn = jaxpr.eqns[i]
        cross += [v for v in _outputs_of(eqn, i, scans, "B") if v in vw]
        if i in scans:
            cross += [(i, j) for j in range(len(scans[i].body.cross))]
    defined_b = {v for i in b_eqns for v in jaxpr.eqns[i].outvars}
    return Plan(b_eqns, w_eqns, scans, cross, [v in vb for v in jaxpr.invars],
                [v in vw and v not in defined_b for v in jaxpr.invars])


def _analyze_scan(eqn, outs_b, outs_w):
    """(ScanPlan, outer invars B reads, outer invars W reads) of a scan equation."""
    p = eqn.params
    nc, ncar = scan_counts(eqn)
    body = p["jaxpr"].jaxpr
    nys = len(body.outvars) - ncar
    b_carry, b_ys = list(outs_b[:ncar]), list(outs_b[ncar:])
    while True:  # the carries B's carries read
        plan = analyze(body, b_carry + b_ys, [False] * (ncar + nys))
        more = [a or b for a, b in zip(b_carry, plan.b_in[nc:nc + ncar])]
        if more == b_carry:
            break
        b_carry = more
    w_carry = [w and not b for w, b in zip(outs_w[:ncar], b_carry)]
    w_ys = [w and not b for w, b in zip(outs_w[ncar:], b_ys)]
    while True:  # W's own carries (those not B's: B's are read as crossing values)
        plan = analyze(body, b_carry + b_ys, w_carry + w_ys)
        more = [a or (w and not b) for a, w, b in
                zip(w_carry, plan.w_in[nc:nc + ncar], b_carry)]
        if more == w_carry:
            break
        w_carry = more
    # B's carries W reads in the body are crossing values too (emitted per iteration)
    carry_in = body.invars[nc:nc + ncar]
    extra = [v for v, b, w in zip(carry_in, b_carry, plan.w_in[nc:nc + ncar]) if b and w]
    plan.cross = extra + plan.cross
    plan.w_in = [w and not (nc <= k < nc + ncar and b_carry[k - nc])
                 for k, w in enumerate(plan.w_in)]
    b_in = plan.b_in[:nc] + b_carry + plan.b_in[nc + ncar:]
    w_in = plan.w_in[:nc] + w_carry + plan.w_in[nc + ncar:]
    return ScanPlan(b_carry, w_carry, b_ys, w_ys, plan), b_in, w_in


def run_part(jaxpr, consts, plan: Plan, args, need, part: str, cross=()):
    """Run part "B" or "W" of `jaxpr` as `plan` shares it out: (the outputs flagged in
    `need`, None for the others; B's crossing values, [] for W). args: the jaxpr's
    inputs (only those the part reads are used); cross: W's, B's crossing values."""
    reads, eqns = (plan.b_in, plan.b_eqns) if part == "B" else (plan.w_in, plan.w_eqns)
    env = dict(zip(jaxpr.constvars, consts))
    env.update((v, a) for v, a, m in zip(jaxpr.invars, args, reads) if m)
    env.update(zip(plan.cross, cross))
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in eqns:
            continue
        if i in plan.scans:
            _scan_part(eqn, i, plan.scans[i], env, part)
            continue
        env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
    outs = [_read(env, v) if m else None for v, m in zip(jaxpr.outvars, need)]
    return outs, [env[c] for c in plan.cross] if part == "B" else []


def _scan_part(eqn, i, s: ScanPlan, env, part: str):
    """Run B's (part "B") or W's ("W") scan of a split scan equation, its outputs into
    `env`: B's carries and ys, and the body's crossing values stacked under (i, j); W's
    carries and ys from its inputs and those stacked crossing values."""
    p = eqn.params
    nc, ncar = scan_counts(eqn)
    closed = p["jaxpr"]
    body, bplan = closed.jaxpr, s.body
    carry_mask, ys_mask = (s.b_carry, s.b_ys) if part == "B" else (s.w_carry, s.w_ys)
    reads = bplan.b_in if part == "B" else bplan.w_in
    consts = [_read(env, v) if m else None for v, m in zip(eqn.invars[:nc], reads[:nc])]
    init = [_read(env, v) for v, m in zip(eqn.invars[nc:nc + ncar], carry_mask) if m]
    xs_mask = reads[nc + ncar:]
    xs = [_read(env, v) for v, m in zip(eqn.invars[nc + ncar:], xs_mask) if m]
    cross = [] if part == "B" else [env[(i, j)] for j in range(len(bplan.cross))]

    def step(carry, x):
        x, x_cross = x
        carry_it, x_it = iter(carry), iter(x)
        args = [*consts, *(next(carry_it) if m else None for m in carry_mask),
                *(next(x_it) if m else None for m in xs_mask)]
        outs, made = run_part(body, closed.consts, bplan, args, carry_mask + ys_mask, part,
                              x_cross)
        return ([o for o, m in zip(outs[:ncar], carry_mask) if m],
                ([o for o, m in zip(outs[ncar:], ys_mask) if m], made))

    with _source_of(eqn):
        carry, (ys, made) = lax.scan(step, init, (xs, cross), length=p["length"],
                                     reverse=p["reverse"])
    values = iter([*carry, *ys])
    env.update((v, next(values)) for v, m in zip(eqn.outvars, carry_mask + ys_mask) if m)
    env.update(((i, j), c) for j, c in enumerate(made))


@dataclasses.dataclass(frozen=True)
class Split:
    """A function's jaxpr cut into B and W (module doc), on f's flat inputs (leaves of
    its args): b(flat) -> (B's outputs, the crossing values), reading only the inputs
    `b_reads` flags; w(flat, cross) -> W's outputs, reading only the inputs `w_reads`
    flags (the others may be None in either); outputs
    in f's flat order, None for the other part's."""

    closed: object
    plan: Plan
    need_b: tuple
    need_w: tuple

    def b(self, flat):
        return run_part(self.closed.jaxpr, self.closed.consts, self.plan, flat,
                        self.need_b, "B")

    def w(self, flat, cross):
        return run_part(self.closed.jaxpr, self.closed.consts, self.plan, flat,
                        self.need_w, "W", cross)[0]

    @property
    def b_reads(self) -> list:
        """[bool] per flat input: read by B (the others may be None)."""
        return self.plan.b_in

    @property
    def w_reads(self) -> list:
        """[bool] per flat input: read by W itself (not through a crossing value)."""
        return self.plan.w_in


def split(f, *args, b_out) -> Split:
    """Cut f (args -> a flat list of outputs) at `args` (module doc); b_out: [bool] per
    output, the ones B computes; W computes the rest but those B's equations give
    (`Split.need_b` says which part returns each output)."""
    closed = inline(f, *args)
    jaxpr = closed.jaxpr
    plan = analyze(jaxpr, list(b_out), [not m for m in b_out])
    # an output B computes anyway (a `cond` run whole in B: the head's, the
    # embedding's) is B's to return, not a crossing value to hold until W
    defined_b = {v for i in plan.b_eqns for v in _outputs_of(jaxpr.eqns[i], i, plan.scans, "B")}
    need_b = tuple(m or v in defined_b for m, v in zip(b_out, jaxpr.outvars))
    need_w = tuple(not m for m in need_b)
    return Split(closed, analyze(jaxpr, list(need_b), list(need_w)), need_b, need_w)
