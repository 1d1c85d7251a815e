"""Host-side settings for running the step on XLA's CPU backend.

XLA:CPU takes every buffer of a step (activations, scores, grads: tens of MB per layer)
from malloc and frees it when the step ends. glibc hands blocks above its mmap
threshold back to the kernel on free (munmap, or trimming the top of a heap), so the
next step page-faults and zero-fills the same memory again. On the 2-core machine this
project is built on, that was 70-90 ms of kernel time per `small` fsdp8 step (getrusage
sys time, ~10% of the step's CPU time); with the settings below it is 10-25 ms and the
step ~10% faster (`python bench/step.py --layout fsdp8 --model small`, 9,301 and 9,140
tok/s before, 10,256 and 10,419 after: README, "Performance"). Freed memory stays in the process for the next step, as an
accelerator runtime's preallocated pool does.

glibc's largest mmap threshold is 32 MiB, and a step's temporaries on one device
(`compiled.memory_analysis().temp_size_in_bytes`) are larger on many layouts: 39 MiB on
fsdp8 `small` with remat dots, 57 MiB on tp8 `small`, 56-404 MiB on `medium`. Above
the threshold glibc maps a block anew each time, so those steps faulted their
temporaries in whole every step (getrusage, `small`: 73,000 minor faults a step on the
first, 117,000 on the second, about 0.2 s of kernel time each; single `small`, 145 MiB
of temporaries, 37,000: the same 4 KiB pages). No mmap at all (`M_MMAP_MAX` 0) serves
such blocks from a heap too, where they stay: the first two then fault a few thousand
times a step at most. A block larger than a thread's heap (64 MiB: glibc's
`HEAP_MAX_SIZE`) is still mapped when a device thread asks for it, as single `small`'s
are and most of `medium`'s. Only the main arena could hold those, and one arena for
every thread (`M_ARENA_MAX` 1) made the 8-device steps slower on this host (its lock:
three times the voluntary context switches).
"""
from __future__ import annotations

import ctypes
import functools

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap
MMAP_MAX = 0  # no block mapped on its own: those above the threshold come from a heap too
TOP_PAD = 256 << 20  # grow a heap by this much beyond a request, so growth is rare
TRIM_THRESHOLD = 2**31 - 1  # never give the top of a heap back to the kernel


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process (idempotent). Returns
    whether it applied: False where the C library is not glibc (macOS, musl)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_MMAP_MAX, MMAP_MAX),
                (M_TOP_PAD, TOP_PAD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
