"""Checkpoint writes off the training thread: the step copies its state to host memory
(`checkpoint.snapshot`), then training goes on while a background thread writes, fsyncs
and renames (`checkpoint.write`). One write at a time: a second save waits for the first.
A failed write is raised at the next call of `finished` or `wait` (the loop's next step),
so it stops the run instead of passing silently; a kill during a write leaves the
previous checkpoint intact (the write renames into place only once complete)."""
from __future__ import annotations

import threading


class Writer:
    """One background checkpoint write at a time."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._done: list[str] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, write, *args) -> None:
        """Wait for the previous write (raising its error), then run `write(*args)` (which
        returns the path written) in a background thread."""
        self.wait_idle()

        def run():
            try:
                path = write(*args)
                with self._lock:
                    self._done.append(path)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_idle(self) -> None:
        """Block until no write is running; the paths it wrote stay for `finished`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finished(self) -> list[str]:
        """The paths written since the last call; raises the error of a failed write."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self) -> list[str]:
        """Block until the running write ends; the paths written since the last call."""
        self.wait_idle()
        return self.finished()
