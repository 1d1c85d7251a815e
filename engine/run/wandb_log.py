"""Weights & Biases scalars of a run (`--wandb PROJECT`): a loop hook that logs the
same scalars as the TensorBoard hook (`loop.scalars`: every number of each step's
record as `train/<name>`) at that step, with the run's resolved config as the W&B
config. wandb's own settings apply: `WANDB_MODE=offline` writes the run under
`WANDB_DIR` (default: the working directory) for a later `wandb sync`, `WANDB_API_KEY`
or `wandb login` for the service. An optional extra: `pip install 'shardwise[wandb]'`."""
from __future__ import annotations

import importlib.util

from engine.run.loop import scalars

EXTRA = "pip install 'shardwise[wandb]'"


def available() -> bool:
    return importlib.util.find_spec("wandb") is not None


class WandbError(Exception):
    """wandb could not start the run (no login in online mode, ...): one line."""


class WandB:
    """Process 0's run in project `project`, with `config` as its W&B config."""

    def __init__(self, project: str, config: dict):
        import wandb

        try:
            self.run = wandb.init(project=project, config=config)
        except Exception as e:  # noqa: BLE001 - wandb raises several kinds: one line
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WandbError(f"--wandb {project}: {message}") from None

    def __call__(self, record, session):
        self.run.log(scalars(record), step=record["step"])

    def close(self):
        """Finish the run and wait until wandb's service has written (offline) or sent
        all of it: `finish` alone can return before the run's file holds its records."""
        import wandb

        self.run.finish()
        wandb.teardown()
