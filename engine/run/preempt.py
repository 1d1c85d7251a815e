"""Preemption: SIGTERM (what Slurm, Kubernetes and TPU maintenance send before a kill)
asks the run to finish its current step, save, and exit 0.

One process: a SIGTERM handler sets a flag the loop reads after each step. Several
processes: jax's preemption sync manager (started by `jax.distributed.initialize`)
catches the signal on whichever process gets it, and
`multihost_utils.reached_preemption_sync_point(step)` is true on every process at the
same step, so all of them save that step together."""
from __future__ import annotations

import signal


class Preemption:
    """`requested(step)`, called by every process after every step: stop and save now?"""

    def __init__(self):
        import jax

        self.shared = jax.process_count() > 1
        self.flag = False
        self.previous = None
        if not self.shared:
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.flag = True

    def requested(self, step: int) -> bool:
        if self.shared:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.flag

    def close(self) -> None:
        """Give SIGTERM back its previous handler."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
