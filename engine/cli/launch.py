"""`python -m engine.launch --processes 2 -- <train args>`: run `engine.train` as N
processes on this machine, the way N hosts would run it.

Starts `python -m engine.train <train args> --coordinator 127.0.0.1:<free port>
--num-processes N --process-id i` for i = 0..N-1 (each forces layout size / N host
devices), prints one line with their pids on stderr, and waits. SIGINT and SIGTERM are
forwarded to every process (each runs in its own session, so a terminal's Ctrl-C reaches
it once, through here). Fails fast: when a process exits non-zero or is killed, the
others are terminated (SIGTERM, then SIGKILL after --grace seconds) and the launcher
exits non-zero with one line naming the process and its exit code or signal. Exit code:
0 when all exit 0; else the first failure's exit code (128 + signal for a signal).

The processes' stdout and stderr pass through the launcher whole line by whole line (two
processes never interleave within a line); Gloo's connection reports are dropped; after
a failure, what the stopped processes print (the tracebacks of collectives whose peer
died) is dropped too, so the launcher's line ends the output.
"""
from __future__ import annotations

import argparse
import ctypes
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

FORWARDED = (signal.SIGINT, signal.SIGTERM)
# Gloo's connection report, "[Gloo] Rank r is connected to c peer ranks. Expected number
# of connected peer ranks is : e", written piecewise by several threads, so its pieces
# can land on other lines: drop every line holding a piece (digits alone included).
CHATTER = re.compile(rb"\[Gloo\]|connected peer ranks|^\s*\d+\s*$")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the coordinator binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def commands(n: int, port: int, train_args: list[str]) -> list[list[str]]:
    return [[sys.executable, "-m", "engine.train", *train_args,
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
             "--process-id", str(i)] for i in range(n)]


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process, then SIGKILL whatever is left after `grace` s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in live):
        time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            p.kill()
        p.wait()


class Relay:
    """Lines of every child's stdout and stderr, queued by reader threads and written by
    the launcher's loop (`flush`), each line whole, to the launcher's own stream."""

    def __init__(self):
        self.lines: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []

    def attach(self, i: int, proc: subprocess.Popen) -> None:
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=self._read, args=(i, pipe, out), daemon=True)
            t.start()
            self.threads.append(t)

    def _read(self, i: int, pipe, out) -> None:
        for line in iter(pipe.readline, b""):
            if not CHATTER.search(line):
                self.lines.put((i, out, line))
        pipe.close()

    def flush(self, keep=lambda i: True, limit: int | None = None) -> None:
        """Write the queued lines (the first `limit` of them, else all) of the processes
        `keep` accepts; drop the others."""
        for _ in range(self.lines.qsize() if limit is None else limit):
            i, out, line = self.lines.get_nowait()
            if keep(i):
                out.write(line.decode(errors="replace"))
                out.flush()

    def close(self, keep=lambda i: True) -> None:
        """After the processes exit: wait for their last lines, then write them."""
        for t in self.threads:
            t.join(timeout=5)
        self.flush(keep)


def launch(n: int, train_args: list[str], grace: float = 10.0, env=None) -> int:
    port = free_port()
    procs: list[subprocess.Popen] = []
    received: list[int] = []
    relay = Relay()
    keep = lambda i: True  # noqa: E731  (after a failure: only the failed process's lines)

    def forward(signum, _frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for cmd in commands(n, port, train_args):
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                          preexec_fn=_die_with_parent,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            relay.attach(len(procs) - 1, procs[-1])
        print(f"engine.launch: {n} processes on 127.0.0.1:{port} "
              f"(pids {', '.join(str(p.pid) for p in procs)})", file=sys.stderr, flush=True)
        while True:
            # lines queued before this poll were written before it: a survivor's reaction
            # to a peer's death is queued after the death, which the poll then sees
            pending = relay.lines.qsize()
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                keep = lambda j: j == i  # noqa: E731
                others = sum(c is None for c in codes)
                stop(procs, grace)
                relay.close(keep)
                cause = (f" after {signal.Signals(received[0]).name}" if received else "")
                print(f"engine.launch: process {i} (pid {procs[i].pid}) {describe(code)}{cause}; "
                      f"stopped the other {others} running process(es)", file=sys.stderr,
                      flush=True)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            relay.flush(limit=pending)
            if len(received) > 1:  # a second signal: stop waiting for a clean exit
                stop(procs, 0)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        relay.close(keep)
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        own, train_args = argv[:cut], argv[cut + 1:]
    else:
        own, train_args = argv, []
    p = argparse.ArgumentParser(prog="python -m engine.launch",
                                usage="python -m engine.launch [--processes N] -- <train args>",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="processes to start")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping processes")
    args = p.parse_args(own)
    if args.processes < 1:
        p.error(f"--processes {args.processes} must be >= 1")
    taken = [f for f in ("--coordinator", "--num-processes", "--process-id")
             if any(a == f or a.startswith(f + "=") for a in train_args)]
    if taken:
        p.error(f"the launcher sets {', '.join(taken)} itself")
    return launch(args.processes, train_args, args.grace)


if __name__ == "__main__":
    sys.exit(main())
