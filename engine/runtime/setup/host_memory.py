"""CPU stages keep freed memory for reuse, as CUDA's caching allocator does on a GPU.

Why: a training step allocates the same temporaries every time -- autograd's weight
gradients before they are added into the arena's flat gradient buffers (4 MiB for a
1024 x 1024 layer, per micro-batch), activations, input gradients. glibc's allocator serves
blocks above its mmap threshold with fresh mappings and returns the top of the heap to the
OS when enough of it is free; either way the next step touches those pages again and takes
a minor page fault per 4 KiB, thousands per step (tests/runtime/test_runtime_memory.py counts
them). With the mmap threshold fixed at 32 MiB and the trim
threshold at 1 GiB, freed blocks stay in the heap and the steady state faults no pages.

This is a process-wide setting, applied once when a pipeline with CPU stages is built, on
glibc systems only. Set ``ENGINE_HOST_MALLOC=system`` in the environment to leave the
allocator alone (e.g. when the process uses jemalloc or tcmalloc, which cache by themselves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_host_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit systems
_TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Configure glibc once (see the module docstring); True when the setting is in place."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("ENGINE_HOST_MALLOC", "").strip().lower() == "system":
        return False
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    _applied = ok
    return ok
