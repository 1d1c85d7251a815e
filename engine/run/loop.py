"""The training loop and its hooks: after each step every hook sees the step's record
(and the session, for the params), in order. engine/cli/train.py builds the hooks from its
flags; another tool can run `loop` with its own."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

from engine.run import distributed


@dataclasses.dataclass
class Session:
    """What the loop runs, as `setup` leaves it: the compiled step, its state, the batch
    of each step and where to start."""

    trainer: object
    step_fn: object
    params: object
    opt_state: object
    batch: object  # (index, split="train") -> a device batch
    start: int
    steps: int
    peak: float  # FLOP/s, the MFU denominator
    tcfg: object = None  # the TrainConfig the step runs (its schedule's horizon resolved)


class Stop(Exception):
    """A hook ends the run after this step: `message` is said, `code` returned."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def loop(session: Session, hooks, say) -> int:
    """Run the steps; before the first, hooks with a `begin(session)` method get it;
    after each step, every hook sees (record, session) in order. A record
    starts as {step, loss, grad_norm, step_time_s} and the step's other metrics (the
    router's with experts; hooks add to it). Returns the exit code: 1 on a non-finite
    loss, 130 on Ctrl-C, a hook's `Stop` code (after the hooks close). Every hook's
    `close` runs; an error a `close` raises is raised after all of them ran."""
    for hook in hooks:  # a hook that must act before the first step has `begin`
        getattr(hook, "begin", lambda session: None)(session)
    try:
        code = _steps(session, hooks, say)
    finally:
        errors = []
        for hook in hooks:
            try:
                getattr(hook, "close", lambda: None)()
            except Exception as e:  # noqa: BLE001 - raised below, once all hooks closed
                errors.append(e)
    if errors:
        raise errors[0]
    return code


def _steps(session: Session, hooks, say) -> int:
    step = session.start
    try:
        for step in range(session.start, session.steps):
            tokens = session.batch(step)
            t0 = time.perf_counter()
            session.params, session.opt_state, metrics = session.step_fn(
                session.params, session.opt_state, tokens)
            loss, grad_norm = (distributed.host_value(metrics[k]) for k in ("loss", "grad_norm"))
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                say(f"error: loss is {loss} at step {step + 1}; stopping", file=sys.stderr)
                return 1
            record = dict(step=step + 1, loss=loss, grad_norm=grad_norm, step_time_s=dt)
            record.update({k: distributed.host_value(v) for k, v in metrics.items()
                           if k not in record})  # a mixture of experts' router metrics
            for hook in hooks:
                hook(record, session)
    except KeyboardInterrupt:
        print(f"interrupted after step {step}", file=sys.stderr)
        return 130
    except Stop as stop:
        say(stop.message)
        return stop.code
    return 0


def scalars(record) -> dict:
    """{`train/<name>`: value} of every number of a step's record but the step itself: what
    the TensorBoard and W&B hooks log at that step."""
    return {f"train/{name}": value for name, value in record.items()
            if name != "step" and isinstance(value, (int, float))}


def per_second(x: float) -> str:
    """A rate for a log line: thousands separated from 100 up, else 3 significant digits
    (a slow run's 0.25 tok/s must not print as 0)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


class Rates:
    """Adds lr, tokens/s and MFU to the record."""

    def __init__(self, cfg, tcfg, peak: float):
        from engine.run import mfu
        from engine.run.optim import schedule

        self.lr_at, self.tokens = schedule(tcfg), tcfg.batch * tcfg.seq  # per step
        self.flops = mfu.flops_per_token(cfg, tcfg.seq) * self.tokens  # per step
        self.peak = peak

    def __call__(self, record, session):
        dt = record.pop("step_time_s")
        record.update(lr=float(self.lr_at(record["step"] - 1)), tokens_per_s=self.tokens / dt,
                      step_time_s=dt, mfu=self.flops / dt / self.peak)


def evaluate(loss, params, batch, batches: int, bytes_per_token: float | None) -> dict:
    """{val_loss, val_ppl, and with text val_bpb}: the mean cross-entropy (nats per token)
    of `loss(params, tokens)` over validation batches `batch(i, "val")` i < `batches`, its
    perplexity exp(loss), and bits per byte loss / ln 2 / bytes_per_token (the data's UTF-8
    bytes per token, from a token file's sidecar: a corpus-wide ratio)."""
    import numpy as np

    losses = [distributed.host_value(loss(params, batch(i, "val"))) for i in range(batches)]
    val = float(np.mean(np.asarray(losses, np.float64)))
    out = dict(val_loss=val, val_ppl=math.exp(min(val, 700.0)))
    if bytes_per_token:
        out["val_bpb"] = val / math.log(2) / bytes_per_token
    return out


def eval_summary(record) -> str:
    """`val loss 2.3456 | ppl 10.44 | 1.234 bits/byte` for a record with an evaluation."""
    bpb = f" | {record['val_bpb']:.3f} bits/byte" if "val_bpb" in record else ""
    return f"val loss {record['val_loss']:.4f} | ppl {record['val_ppl']:.2f}{bpb}"


class Evaluate:
    """Every `every` steps and at the last: `evaluate` over `batches` batches."""

    def __init__(self, every: int, batches: int, steps: int,
                 bytes_per_token: float | None = None):
        self.every, self.batches, self.steps = every, batches, steps
        self.bytes_per_token = bytes_per_token

    def __call__(self, record, session):
        done = record["step"]
        if done % self.every and done != self.steps:
            return
        record.update(evaluate(session.trainer.loss, session.params, session.batch,
                               self.batches, self.bytes_per_token))


class MetricsFile:
    """One JSON object per step, appended to the file or (`append` False) replacing what
    it held; the file is locked against another run while it is open
    (engine/run/lock.py)."""

    def __init__(self, path: str, append: bool):
        from engine.run.lock import lock_file

        self.file = open(path, "a")
        try:
            lock_file(self.file, path)
        except BaseException:
            self.file.close()
            raise
        if not append:
            self.file.truncate(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __call__(self, record, session):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


class Log:
    """A progress line every `every` steps and at the last (averaged over the window),
    and the eval line when the record has one."""

    def __init__(self, every: int, steps: int, rates: Rates, say):
        self.every, self.steps, self.rates, self.say = every, steps, rates, say
        self.window_t, self.window_n = 0.0, 0

    def __call__(self, record, session):
        done = record["step"]
        self.window_t, self.window_n = self.window_t + record["step_time_s"], self.window_n + 1
        if done % self.every == 0 or done == self.steps:
            avg = self.window_t / self.window_n
            self.say(f"step {done:>5}/{self.steps} | loss {record['loss']:.4f} | grad norm "
                     f"{record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
                     f"{per_second(self.rates.tokens / avg)} tok/s | {avg * 1e3:.0f} ms/step | "
                     f"MFU {100 * self.rates.flops / avg / self.rates.peak:.1f}%"
                     + router_summary(record))
            self.window_t, self.window_n = 0.0, 0
        if "val_loss" in record:
            self.say(f"eval {done:>5}/{self.steps} | {eval_summary(record)}")


def router_summary(record) -> str:
    """` | aux 1.012 z 4.31 | tokens/expert max/mean 1.42 | dropped 0.0%` for a step of a
    mixture of experts (layers/moe.py `router_losses`), else empty."""
    if "aux_loss" not in record:
        return ""
    imbalance = record["tokens_per_expert_max"] / max(record["tokens_per_expert_mean"], 1e-9)
    return (f" | aux {record['aux_loss']:.3f} z {record['z_loss']:.2f} | tokens/expert "
            f"max/mean {imbalance:.2f} | dropped {100 * record['dropped_fraction']:.1f}%")


class Checkpoints:
    """A checkpoint every `every` steps and at the last, keeping the newest `keep`. With
    `asynchronous`, the state is copied to host memory and written by a background
    thread (engine/run/writer.py) while training goes on; a failed write stops the run
    at the next step. With a `preemption` (engine/run/preempt.py), a SIGTERM saves the
    step just finished and ends the run with exit code 0."""

    def __init__(self, directory: str, every: int, keep: int, steps: int, meta: dict, say,
                 asynchronous: bool = False, preemption=None):
        from engine.run.writer import Writer

        self.directory, self.every, self.keep, self.steps = directory, every, keep, steps
        self.meta, self.say, self.preemption = meta, say, preemption
        self.writer = Writer() if asynchronous else None

    def __call__(self, record, session):
        from engine.run import checkpoint

        self._report(self.writer.finished() if self.writer else [])
        done = record["step"]
        stop = self.preemption is not None and self.preemption.requested(done)
        if not (done % self.every == 0 or done == self.steps or stop):
            return
        trainer = session.trainer  # saved in the model's layer order
        snap = checkpoint.snapshot(trainer.unstore(session.params),
                                   trainer.unstore(session.opt_state))
        args = (self.directory, done, snap, self.meta, self.keep)
        if self.writer is not None and not stop:
            self.writer.submit(checkpoint.write, *args)
            return
        if self.writer is not None:
            self._report(self.writer.wait())
        path = checkpoint.write(*args)
        if not stop:
            self.say(f"saved {path}")
            return
        raise Stop(0, f"preempted (SIGTERM): saved step {done} to {path}; exiting")

    def _report(self, paths):
        for path in paths:
            self.say(f"saved {path}")

    def close(self):
        try:
            if self.writer is not None:
                self._report(self.writer.wait())
        finally:
            if self.preemption is not None:
                self.preemption.close()
