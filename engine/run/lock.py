"""One run at a time per output: an exclusive lock on a checkpoint directory (and on a
metrics file) for the run's lifetime.

The lock is `fcntl.flock` on `<directory>/.lock`, whose text names the holder
(`pid 1234 on host-a`). The kernel drops a flock when its holder exits, however it exits,
so a lock file left by a killed run is not held: the next run takes it over (and says
whose it was). A second run while the first holds it is refused in one line naming the
holder. With several processes, process 0 takes the lock for all of them
(`engine/cli/train.py`). flock is advisory and, on some network filesystems, local to a
host: it stops a second shardwise run, not other programs.
"""
from __future__ import annotations

import fcntl
import os
import socket

NAME = ".lock"


class LockError(Exception):
    """Another live run holds the lock; the message (one line) names it."""


def holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _take(fd: int, what: str) -> None:
    """flock `fd` exclusively without waiting; LockError naming the holder otherwise."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        raise LockError(f"{what} is in use by another run ({holder}); wait for it to "
                        f"finish or choose another") from None


class DirectoryLock:
    """`with DirectoryLock(directory):` holds `directory`'s lock (creating the
    directory); `previous` is the holder text a dead run left, or None."""

    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, NAME)
        self.fd, self.previous = None, None

    def acquire(self) -> DirectoryLock:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _take(fd, self.directory)
        except LockError:
            os.close(fd)
            raise
        self.previous = os.pread(fd, 200, 0).decode(errors="replace").strip() or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_text().encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Empty the lock file's text and drop the lock (the file stays: removing it
        would let a waiting run lock an unlinked file)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def lock_file(f, path: str) -> None:
    """flock the open file `f` (a metrics file) for as long as it stays open; LockError
    when another run writes it."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LockError(f"{path} is being written by another run; choose another "
                        f"--metrics-file") from None
