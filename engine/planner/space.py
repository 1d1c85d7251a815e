"""The planner's candidate space: every layout of N devices with every switch.

Candidates are every factorisation of N into the axes of the role registry
(layers/roles.py; axes of size 1 left out) in every order, times every value of each
switch in `SWITCHES` (each read from its own registry, offered only where it changes the
program). `candidates` splits them into what `engine.parallel.validate` lets run and what it
refuses; `neighbours` are the runnable ones a switch away; `accumulated` is a candidate
with twice its microbatches. engine/planner/search.py prices them.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

from collectives.ring import COMMS
from engine.config import ParallelConfig, TrainConfig
from engine.parallel import validate
from engine.parallel.layout import AXIS_ROLES, Layout
from engine.parallel.pipeline import SCHEDULES
from engine.parallel.zero import ZERO
from layers import roles
from layers.block import REMAT
from layers.config import ModelConfig
from layers.kernels.context import CP_COMMS


def degree(layout: Layout, what: str) -> int:
    """Product of the layout's sizes of the roles sharding `what` (roles.SHARDABLE)."""
    return math.prod(layout.degree(r) for r in roles.roles_sharding(what))


@dataclasses.dataclass(frozen=True)
class Switch:
    """One setting the plan chooses. name: the `ParallelConfig` (or, with model=True,
    `ModelConfig`) field, whose flag is `--name` with `-` for `_`; values: from its
    registry, or a function of the layout giving them; applies(layout, parallel):
    whether it changes the step's program there (elsewhere the field keeps its
    default). Switches are applied in order, so `applies` may read the ones before it."""

    name: str
    values: tuple | Callable[[Layout], tuple]
    applies: Callable[[Layout, ParallelConfig], bool]
    model: bool = False

    def options(self, layout: Layout) -> tuple:
        return self.values(layout) if callable(self.values) else self.values


SWITCHES: tuple[Switch, ...] = (
    Switch("zero", ZERO, lambda lay, par: degree(lay, "params") > 1),
    Switch("prefetch", (False, True), lambda lay, par: par.zero == 3 and degree(lay, "params") > 1),
    Switch("tp_comm", COMMS, lambda lay, par: degree(lay, "heads") > 1),
    Switch("cp_comm", tuple(CP_COMMS), lambda lay, par: degree(lay, "sequence") > 1),
    Switch("remat", REMAT, lambda lay, par: True, model=True),
    Switch("pp_schedule", tuple(SCHEDULES), lambda lay, par: lay.degree("pp") > 1),
    Switch("pp_virtual", (2,), lambda lay, par: par.pp_schedule == "interleaved"
           and lay.degree("pp") > 1),
    # a pipeline's bubble is (pp-1)/(M+pp-1): 4·pp microbatches keep it under 1/5 (one
    # value: each M is a program of its own to trace)
    # (without pp a step over memory is retried with more: `accumulated`)
    Switch("microbatches", lambda lay: (4 * lay.degree("pp"),),
           lambda lay, par: lay.degree("pp") > 1 or par.microbatches > 1),
)


# where each switch takes effect, for a flag given where it does not (`ineffective`)
NEEDS = {"zero": "an axis sharding the params ({params})",
         "prefetch": "--zero 3 on an axis sharding the params ({params})",
         "tp_comm": "an axis sharding the heads ({heads})",
         "cp_comm": "an axis sharding the sequence ({sequence})",
         "pp_schedule": "a pp axis", "pp_virtual": "--pp-schedule interleaved on a pp axis",
         "microbatches": "a pp axis, or more than 1", "remat": "",
         "grad_reduce": "--zero 2 or 3 on an axis sharding the params ({params})"}


def grad_reduce_applies(layout: Layout, par: ParallelConfig) -> bool:
    """Whether `grad_reduce` changes the step: fsdp's reduce-scatters of zero 2 and 3
    (zero 1 and dp all-reduce in f32 either way)."""
    return par.zero in (2, 3) and degree(layout, "params") > 1


def _rules():
    """(name, applies(layout, parallel), is a ModelConfig field) of every setting the
    layout decides the effect of: the switches, then grad_reduce."""
    return [*((s.name, s.applies, s.model) for s in SWITCHES),
            ("grad_reduce", grad_reduce_applies, False)]


def ineffective(cfg: ModelConfig, par: ParallelConfig, layout: Layout,
                given: set[str]) -> list[str]:
    """`--zero 1 takes no effect on tp4: it needs ...` for each setting in `given` (field
    names) that differs from its default and does not change the program on `layout`."""
    where = {w: "/".join(roles.roles_sharding(w)) for w in ("params", "heads", "sequence")}
    out = []
    for name, applies, model in _rules():
        value = getattr(cfg if model else par, name)
        default = getattr(ParallelConfig(), name) if not model else None
        if name in given and not model and value != default and not applies(layout, par):
            flag = "--" + name.replace("_", "-")
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            out.append(f"{shown} takes no effect on layout {layout}: it needs "
                       + NEEDS[name].format(**where))
    return out


def honours(layout: Layout, par: ParallelConfig, pinned: dict, base: ParallelConfig) -> bool:
    """Whether a candidate takes effect of every switch the user pinned away from its
    default, and of `base`'s grad_reduce when it is not the default: a pinned setting
    that changes nothing on a layout is not that layout's setting."""
    for name, applies, model in _rules():
        if model:
            continue
        wanted = pinned.get(name, getattr(base, name) if name == "grad_reduce" else None)
        if wanted is not None and wanted != getattr(ParallelConfig(), name) \
                and not applies(layout, par):
            return False
    return True


# schedules whose steps have one ledger (`Candidate.program`)
SHARED_TRACE = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout with its switches; `cfg` is the model with the candidate's remat."""

    layout: Layout
    parallel: ParallelConfig
    cfg: ModelConfig

    @property
    def flags(self) -> dict:
        """{switch name: value} for every switch (defaults where it does not apply)."""
        return {s.name: getattr(self.cfg if s.model else self.parallel, s.name)
                for s in SWITCHES}

    @property
    def program(self) -> tuple:
        """What the traced step's ledger depends on: axis sizes by role, the parallel
        config and the model (not the order of the axes, which only picks link tiers in
        pricing; nor the choice between the gpipe and 1f1b schedules: their ticks run
        the same units and shifts, and only their tables, which pricing walks, and
        their numbers of ticks, which pricing reads off the rows, differ)."""
        par = self.parallel
        if par.pp_schedule in SHARED_TRACE:
            par = dataclasses.replace(par, pp_schedule=SHARED_TRACE[0])
        return (tuple(self.layout.degree(r) for r in AXIS_ROLES), par, self.cfg)

    def argv(self) -> list[str]:
        """The training CLI's flags for this candidate."""
        out = ["--layout", str(self.layout)]
        for name, value in self.flags.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            else:
                out += [flag, str(value)]
        return out

    def applied(self) -> dict:
        """{switch name: value} for the switches that apply to this layout."""
        return {s.name: v for s, v in zip(SWITCHES, self.flags.values())
                if s.applies(self.layout, self.parallel)}

    def describe(self) -> str:
        """`fsdp4xtp2 zero 3 tp_comm ring remat full`: the layout and every switch that
        applies to it."""
        shown = [f"{k} {v}" if not isinstance(v, bool) else k
                 for k, v in self.applied().items() if v is not False]
        return " ".join([str(self.layout), *shown])


def considered(cfg: ModelConfig, names: tuple[str, ...]) -> tuple[tuple[str, ...], dict]:
    """(the roles of `names` the plan lays out, {role: why it is left out}): roles that
    `engine.parallel.validate` refuses for the model whatever their size (ep without
    experts, pp over one layer) are left out before the space is
    enumerated, not enumerated and refused one layout at a time."""
    why = {}
    if not cfg.moe:
        why["ep"] = "the model has no experts"
    if cfg.n_layers < 2:
        why["pp"] = "the model has one layer"
    left = {r: w for r, w in why.items() if r in names}
    return tuple(r for r in names if r not in left), left


def reasons(refused: list, top: int = 3) -> list[tuple[int, str]]:
    """[(count, reason)] of the `top` commonest first reasons of `refused` [(candidate,
    reason)], sizes written N so layouts of one kind count together."""
    import collections
    import re

    counts = collections.Counter(re.sub(r"\d+", "N", r.split("; ")[0]) for _, r in refused)
    return [(k, r) for r, k in counts.most_common(top)]


def factorisations(n: int, names: tuple[str, ...] = AXIS_ROLES) -> list[dict]:
    """Every {role: size > 1} over `names` whose sizes multiply to n ({} for n = 1)."""
    if not names:
        return [{}] if n == 1 else []
    out = []
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in factorisations(n // d, names[1:]):
            out.append({names[0]: d, **rest} if d > 1 else rest)
    return out


def _within(n: int, names: tuple[str, ...], limits: dict | None) -> list[dict]:
    """The factorisations of n over `names` with no size past its role's limit."""
    limits = limits or {}
    return [f for f in factorisations(n, names)
            if all(f.get(r, 1) <= m for r, m in limits.items())]


def orders(f: dict) -> list[Layout]:
    """The factorisation {role: size} as a layout in every order of its axes."""
    return [Layout(tuple((r, f[r]) for r in order)) for order in itertools.permutations(f)]


def layouts(n: int, names: tuple[str, ...] = AXIS_ROLES, limits: dict | None = None
            ) -> list[Layout]:
    """Every factorisation of n devices over the roles `names` in every order of its
    axes; limits: {role: largest size} leaves out factorisations past them."""
    return [lay for f in _within(n, names, limits) for lay in orders(f)]


def switch_settings(cfg: ModelConfig, layout: Layout, pinned: dict,
                    base: ParallelConfig = ParallelConfig()) -> list[tuple]:
    """Every (ParallelConfig, ModelConfig) of the switches for `layout`, the other
    fields from `base`; a switch named in `pinned` keeps that value where it applies
    (elsewhere its default)."""
    settings = [(base, cfg)]
    for s in SWITCHES:
        grown = []
        for par, c in settings:
            values = (((pinned[s.name],) if s.name in pinned else s.options(layout))
                      if s.applies(layout, par) else (None,))
            for v in values:
                if v is None and s.model:
                    grown.append((par, c))
                elif v is None:  # does not apply: the default
                    grown.append((dataclasses.replace(
                        par, **{s.name: getattr(ParallelConfig(), s.name)}), c))
                elif s.model:
                    grown.append((par, dataclasses.replace(c, **{s.name: v})))
                else:
                    grown.append((dataclasses.replace(par, **{s.name: v}), c))
        settings = grown
    return settings


class Program(Sequence):
    """One program's candidates (`Candidate.program`): every order of one factorisation
    (`layouts`) under each of the switch settings [(ParallelConfig, ModelConfig)] that
    trace to it, setting by setting, each Candidate built when it is read. A plan of
    hundreds of devices has millions of candidates in tens of thousands of programs,
    most of them never priced."""

    def __init__(self, layouts: list[Layout], settings: list[tuple]):
        self.layouts = layouts
        self.settings = settings

    def __len__(self) -> int:
        return len(self.layouts) * len(self.settings)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        par, cfg = self.settings[(i % len(self)) // len(self.layouts)]
        return Candidate(self.layouts[i % len(self.layouts)], par, cfg)

    def __iter__(self):
        return (Candidate(lay, par, cfg) for par, cfg in self.settings for lay in self.layouts)


def programs(cfg: ModelConfig, tcfg: TrainConfig, n: int, pinned: dict | None = None,
             names: tuple[str, ...] = AXIS_ROLES, limits: dict | None = None,
             base: ParallelConfig = ParallelConfig()) -> tuple[list[Program], list]:
    """([Program] of the runnable candidates, [(refused candidate, reason)]) of n devices
    over the roles `names` (sizes up to `limits`, as `layouts`); ParallelConfig fields
    that are not switches from `base`. A setting pinned (or in `base`) away from its
    default leaves out the layouts where it would take no effect (`honours`). The
    switches and `engine.parallel.validate` read the axis sizes, not their order, so
    both run once per factorisation and hold for all its orders (a refusal names each
    order's own layout)."""
    ok, refused = [], []
    for f in _within(n, names, limits):
        every = orders(f)
        first = every[0]
        settings: dict[tuple, list] = {}  # program -> its settings, in order
        for par, c in switch_settings(cfg, first, pinned or {}, base):
            if not honours(first, par, pinned or {}, base):
                continue
            if problems := validate.problems(c, tcfg, par, first):
                reason = "; ".join(problems)
                refused += [(Candidate(lay, par, c),
                             reason.replace(first.describe(), lay.describe()))
                            for lay in every]
            else:
                settings.setdefault(Candidate(first, par, c).program, []).append((par, c))
        ok += [Program(every, s) for s in settings.values()]
    return ok, refused


def candidates(cfg: ModelConfig, tcfg: TrainConfig, n: int, pinned: dict | None = None,
               names: tuple[str, ...] = AXIS_ROLES, limits: dict | None = None,
               base: ParallelConfig = ParallelConfig()):
    """(runnable candidates, [(refused candidate, reason)]): the candidates of
    `programs`, one list."""
    ok, refused = programs(cfg, tcfg, n, pinned, names, limits, base)
    return [c for p in ok for c in p], refused


def neighbours(cand: Candidate, tcfg: TrainConfig) -> list[Candidate]:
    """The runnable candidates that differ from `cand` in one switch (in every order of
    its axes): a switch that stops applying goes back to its default."""
    out = []
    for s in SWITCHES:
        if not s.applies(cand.layout, cand.parallel):
            continue
        current = cand.flags[s.name]
        for v in (v for v in s.options(cand.layout) if v != current):
            pinned = {**cand.flags, s.name: v}
            for order in itertools.permutations(cand.layout.axes):
                layout = Layout(tuple(order))
                for par, c in switch_settings(cand.cfg, layout, pinned, cand.parallel):
                    if not validate.problems(c, tcfg, par, layout):
                        out.append(Candidate(layout, par, c))
    return out


def accumulated(cand: Candidate, tcfg: TrainConfig) -> Candidate | None:
    """`cand` without pp with twice its microbatches (gradient accumulation: the same
    update from smaller steps, for a step over memory), or None where that cannot run
    (M would not divide the per-device batch) or there is a pp axis (its microbatches
    are a switch of their own)."""
    if cand.layout.degree("pp") > 1:
        return None
    par = dataclasses.replace(cand.parallel, microbatches=2 * cand.parallel.microbatches)
    if validate.problems(cand.cfg, tcfg, par, cand.layout):
        return None
    return Candidate(cand.layout, par, cand.cfg)
