"""TensorBoard scalars of a run (`--tensorboard DIR`): a loop hook that writes every
number of each step's record (loss, lr, grad_norm, tokens_per_s, mfu, step_time_s,
val_loss when evaluated, the router's metrics with experts, predicted_step_s when the
cost model is on) as `train/<name>` at that step (`loop.scalars`). Written with
tensorboardX, the lightest maintained writer: numpy, protobuf and packaging, against
tensorboard's own writer, which brings grpcio, werkzeug and the TensorBoard server. An
optional extra: `pip install 'shardwise[tensorboard]'`."""
from __future__ import annotations

import importlib.util

from engine.run.loop import scalars

EXTRA = "pip install 'shardwise[tensorboard]' (tensorboardX)"


def available() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


class TensorBoard:
    """Process 0's scalars, flushed every `flush_every` steps and at the end."""

    def __init__(self, directory: str, flush_every: int = 10):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=directory, flush_secs=3600)
        self.flush_every = flush_every

    def __call__(self, record, session):
        step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if step % self.flush_every == 0:
            self.writer.flush()

    def close(self):
        self.writer.close()
