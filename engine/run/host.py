"""Host-side settings for running the step on XLA's CPU backend.

XLA:CPU takes every buffer of a step (activations, scores, grads: tens of MB per layer)
from malloc and frees it when the step ends. glibc hands blocks above its mmap
threshold back to the kernel on free (munmap, or trimming the top of a heap), so the
next step page-faults and zero-fills the same memory again. The settings below keep
freed memory in the process for the next step, as an accelerator runtime's preallocated
pool does, and no block is mmapped on its own (`M_MMAP_MAX` 0: glibc's largest mmap
threshold, 32 MiB, is below many layouts' temporaries per device), which cut the kernel
time of a step and sped it up (bench/results/2026-11-27-malloc-cpu.md).

A block larger than a thread's heap (64 MiB: glibc's `HEAP_MAX_SIZE`) is still mapped
when a device thread asks for it, as single `small`'s temporaries are and most of
`medium`'s. Only the main arena could hold those, and one arena for every thread
(`M_ARENA_MAX` 1) made the 8-device steps slower (its lock). So every step faults such a
device's temporaries in page by page (`mapped_each_step`), a kernel page fault and zero
fill per 4 KiB page; the CPU cost model prices them (`price.fault_seconds`) where the
compiled step's temporaries are known (`bench/roofline.py`).
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
# glibc's HEAP_MAX_SIZE on 64-bit hosts (2 x the largest mmap threshold): the largest heap
# of a thread's arena, so the largest block a device thread's malloc can keep
THREAD_HEAP_MAX = 64 << 20


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


def mapped_each_step(temp_bytes: int) -> int:
    """Bytes of one device's step temporaries (`compiled.memory_analysis()
    .temp_size_in_bytes`, one block XLA:CPU asks malloc for on the device's thread) that
    are mapped anew, and faulted in page by page, on every step under
    `keep_freed_memory`: all of them when the block does not fit a thread's heap
    (THREAD_HEAP_MAX), else none. 0 where the settings do not apply (not glibc): what
    that allocator does is not modelled.

    Read off getrusage on this host (minor faults per step x 4 KiB, after two warm-up
    steps): single `small`, 145 MiB of temporaries, faults 145 MiB a step; medium on 8
    devices with 67 and 80 MiB each (fsdp4xtp2, dp2xfsdp2xtp2) faults 8 x that; medium
    fsdp8 with 56 MiB and `small` fsdp8 with 19 MiB fault under 1.5 MiB in most steps.
    The rule misses `small` dp2xfsdp2xtp2 (26 MiB a device), which faults about one
    device's temporaries a step: a heap shared by two device threads, it seems."""
    if not keep_freed_memory():
        return 0
    return temp_bytes if temp_bytes > THREAD_HEAP_MAX else 0


def memory_problem(cfg) -> str | None:
    """Why training `cfg` on this host's CPU devices cannot fit its available memory, or
    None: its params, grads and Adam moments are 4 f32 copies, 16 bytes a param, a floor
    under the step's peak (activations come on top). Checked before anything is built,
    by every tool that materialises a model on the host (a process past the host's
    memory is killed by the kernel with no message, and may take other jobs with it)."""
    from engine.parallel.params import param_count
    from engine.parallel.validate import available_host_memory

    n = param_count(cfg)
    need, have = 16 * n, available_host_memory()
    if need <= have:
        return None
    return (f"model needs {need / 2**30:.1f} GiB for params, grads and Adam state (16 bytes "
            f"x {n:,} params); this host has {have / 2**30:.1f} GiB available")
