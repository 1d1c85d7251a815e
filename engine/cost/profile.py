"""`engine.train --profile-steps A:B`: a profiler trace of steps A..B and, at the end of
the run, where their time went per ledger scope and per collective, measured vs
predicted.

`Profile` is a training-loop hook (engine/run/loop.py): `begin` or the hook of step A-1
starts `jax.profiler.start_trace(DIR, create_perfetto_trace=True)`, the hook of step B
stops it. DIR then holds `plugins/profile/<run>/<host>.xplane.pb` (TensorBoard's profile
plugin: `tensorboard --logdir DIR`) and `<host>.trace.json.gz` (ui.perfetto.dev). The
table attributes the traced steps' median wall time to ledger categories as
bench/roofline.py does (engine/cost/trace.py: op events, classified by the compiled
step's HLO, split in proportion to summed op time) and sets the cost model's prediction
beside it: `price.predict` (with pp, `engine.cost.pipeline.predict_step` along the
schedule) on the ledger of the same step, on the `cpu` profile (engine/cost/calibration.py:
the calibration file, else the built-in defaults). Last, the compiled ops that took the
most of the measured time, each with what it computes (a fusion's opcodes).
"""
from __future__ import annotations

import glob
import os
import statistics
from pathlib import Path

TOP_OPS = 10  # compiled ops listed by measured time


def parse_steps(text: str) -> tuple[int, int]:
    """"A:B" -> (A, B); raises ValueError with the reason."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: want A:B, two step numbers "
                         f"(1-based, inclusive)") from None
    if not sep:
        raise ValueError(f"--profile-steps {text!r}: want A:B")
    return a, b


def flag_problems(steps_text: str | None, directory: str, steps: int) -> list[str]:
    """Bad --profile-steps / --profile-dir for a run of `steps` steps (no jax needed)."""
    if steps_text is None:
        return []
    try:
        a, b = parse_steps(steps_text)
    except ValueError as e:
        return [str(e)]
    problems = []
    if a < 1:
        problems.append(f"--profile-steps {steps_text}: the first step must be >= 1")
    if b < a:
        problems.append(f"--profile-steps {steps_text}: the last step must be >= the first")
    if b > steps:
        problems.append(f"--profile-steps {steps_text}: the last step must be <= --steps "
                        f"{steps}")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        problems.append(f"--profile-dir {directory}: not a directory")
    else:
        existing = next(p for p in (path, *path.resolve().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            problems.append(f"--profile-dir {directory}: {existing} is not writable")
    return problems


class Profile:
    """Traces steps `first`..`last` (1-based, inclusive) into `directory`; `close`
    prints the measured-vs-predicted tables with `say`."""

    def __init__(self, steps_text: str, directory: str, cfg, tcfg, layout, parallel, say):
        self.first, self.last = parse_steps(steps_text)
        self.directory = str(directory)
        self.cfg, self.tcfg, self.layout, self.parallel, self.say = (
            cfg, tcfg, layout, parallel, say)
        self.tracing, self.times, self.session = False, [], None
        self.before, self.trace_dir = set(), None

    def _runs(self) -> set[str]:
        """The trace directories jax's profiler has written under `directory`
        (`plugins/profile/<timestamp>/`)."""
        return set(glob.glob(os.path.join(self.directory, "plugins", "profile", "*", "")))

    def _start(self):
        import jax

        os.makedirs(self.directory, exist_ok=True)
        self.before = self._runs()
        jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        self.tracing = True

    def _stop(self):
        import jax

        jax.profiler.stop_trace()
        self.tracing = False
        new = sorted(self._runs() - self.before)  # this run's, not an earlier run's
        self.trace_dir = os.path.normpath(new[-1]) if new else self.directory

    def begin(self, session):
        """Before the first step: start when step A is the first this run takes."""
        self.session = session
        if session.start + 1 >= self.first and session.start < self.last:
            self._start()

    def __call__(self, record, session):
        done = record["step"]
        if self.tracing and done >= self.first:
            self.times.append(record["step_time_s"])
        if done == self.last and self.tracing:
            self._stop()
        elif done == self.first - 1 and not self.tracing:
            self._start()

    def close(self):
        if self.tracing:
            self._stop()
        if not self.times:
            return
        perfetto = glob.glob(os.path.join(self.trace_dir, "perfetto_trace.json.gz")) + glob.glob(
            os.path.join(self.trace_dir, "*.trace.json.gz"))
        self.say(f"profile of steps {self.first}-{self.first + len(self.times) - 1} in "
                 f"{self.trace_dir}: tensorboard --logdir {self.directory}, or open "
                 f"{perfetto[0] if perfetto else 'its perfetto_trace.json.gz'} in "
                 f"ui.perfetto.dev")
        for table in self.tables():
            self.say(table)

    def tables(self) -> list[str]:
        """A header line, then the per-scope and (with collectives) per-collective tables
        (engine/cost/report.py) of the traced steps: measured (attributed from the
        trace) vs predicted (the cpu profile); last, the `TOP_OPS` compiled ops that took
        the most of the measured time."""
        from engine.cost import calibration, hardware, report, trace
        from engine.cost.audit import axes_by_groups
        from engine.cost.predicted import predict_run_step

        step_s = statistics.median(self.times)
        events = trace.op_events(self.trace_dir)
        text = self.session.step_fn.as_text()
        info = trace.classify(text, axes_by_groups(self.layout.mesh_axes()))
        measured = trace.attribute(events, info, step_s, len(self.times))
        orows = report.op_table(trace.op_seconds(events, info, step_s, len(self.times)),
                                info, text, TOP_OPS)
        try:
            hw = hardware.get("cpu")
        except calibration.ProfileError as e:
            self.say(f"note: {e}; predicting with the built-in cpu defaults")
            hw = calibration.cpu_defaults()
        # pp: along the schedule; the compiled step's temporaries mapped anew each step:
        # their page faults
        pred = predict_run_step(self.cfg, self.tcfg, self.layout, self.parallel,
                                self.session.step_fn, hw)
        srows = report.scope_table(pred, measured, hw)
        crows = report.collective_table(pred, measured, self.layout.mesh_axes())
        head = (f"measured: median traced step {step_s:.4g} s split by op time; predicted: "
                f"{pred.step_s:.4g} s on the {hw.name} profile, {hw.source}")
        return [head, report.format_scopes(srows)] + (
            [report.format_collectives(crows)] if crows else []) + [report.format_ops(orows)]
