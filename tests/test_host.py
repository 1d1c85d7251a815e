"""engine.run.host: glibc keeps XLA:CPU's freed step buffers in the process."""
import ctypes
import platform

import pytest

from engine.run import host


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="mallopt is glibc's")


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


@GLIBC
@pytest.mark.parametrize("mib", [16, 48])
def test_a_step_sized_block_comes_from_the_heap_and_stays_there(mib):
    """A 16 MiB block (an activation of `small`) and a 48 MiB one (a device's
    temporaries of tp8 `small`, above glibc's largest mmap threshold, 32 MiB) are
    neither mmapped at malloc nor given back to the kernel at free: both happen with
    glibc's defaults (mmap threshold 128 KiB, trimming above 128 KiB), and the second
    with any threshold while mmap is allowed. Each block is asked for beyond the free
    top of the heap (`keepcost`), so the heap cannot serve it without growing: the
    growth is where glibc chooses mmap. The free top is first given back
    (`malloc_trim`): late in a full test run earlier tests leave gigabytes there, and
    top plus block would pass the trim threshold (2 GiB), where glibc rightly trims."""
    assert host.keep_freed_memory()
    libc = _libc()
    libc.malloc_trim(0)
    size = (mib << 20) + libc.mallinfo2().keepcost
    mapped = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    assert block and libc.mallinfo2().hblkhd - mapped < size, "block was mmapped"
    libc.free(block)
    assert libc.mallinfo2().fordblks >= size, "freed block was returned to the kernel"


def test_only_temporaries_above_a_thread_heap_are_mapped_each_step(monkeypatch):
    """A device's temporaries larger than glibc's largest thread heap (64 MiB) are mapped
    anew every step; smaller ones come from the heap and stay; where the settings do not
    apply (no glibc) nothing is said to be."""
    monkeypatch.setattr(host, "keep_freed_memory", lambda: True)
    assert host.mapped_each_step(host.THREAD_HEAP_MAX + 4096) == host.THREAD_HEAP_MAX + 4096
    assert host.mapped_each_step(56 << 20) == 0
    monkeypatch.setattr(host, "keep_freed_memory", lambda: False)
    assert host.mapped_each_step(145 << 20) == 0

