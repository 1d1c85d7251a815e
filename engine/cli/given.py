"""Which flags the user gave, so a setting that cannot take effect is refused rather
than ignored: on a named layout `parse` refuses it (`engine.planner.space.ineffective`);
with `--layout auto` it pins the planner's search (`auto_pins`)."""
from __future__ import annotations

import argparse


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The dests of the flags on the command line `argv` (whatever their value): argparse
    fills in a default only where the namespace has no value yet, so a namespace of
    markers keeps a marker exactly where no flag was given."""
    marker = object()
    # the flags' dests, and the attributes set_defaults gives (flag groups a tool leaves out)
    names = {a.dest for a in parser._actions if a.dest != argparse.SUPPRESS} | set(
        parser._defaults)
    ns = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(names, marker)))
    return {name for name, value in vars(ns).items() if value is not marker}


def auto_pins(cfg, parallel, given: set[str]) -> tuple[dict, object]:
    """(pinned switches, base ParallelConfig) for `engine.planner.auto.auto`: every
    switch the user gave keeps its value, and the search leaves out layouts where it
    would take no effect; the fields that are not switches come from `parallel`."""
    import dataclasses

    from engine.config import ParallelConfig
    from engine.planner.space import SWITCHES

    pinned = {s.name: getattr(cfg if s.model else parallel, s.name)
              for s in SWITCHES if s.name in given}
    base = ParallelConfig(grad_reduce=parallel.grad_reduce,
                          microbatches=parallel.microbatches)
    switches = {s.name for s in SWITCHES}
    rest = {f.name for f in dataclasses.fields(ParallelConfig)} - switches
    assert rest <= {"grad_reduce"}, rest  # a new field must be passed on in `base` too
    return pinned, base
