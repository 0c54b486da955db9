"""glibc's malloc tuned for a CPU engine process: step activations reuse memory, not fresh pages.

Torch's CPU allocator is `malloc`. A prefill step of SmolLM2 allocates and frees activations of
4-25 MB per op (2048 tokens × 3072 floats for gate/up alone). glibc serves blocks above its mmap
threshold with a fresh `mmap` and unmaps them on free, and trims the heap's free top back to
the OS past its trim threshold; either way the next step's same-size activation page-faults
every 4 KiB page in again, and the kernel zeroes each one. Measured on a 64-prompt SmolLM2
prefill (16,786 tokens, float32, 2 cores): 5-7 million minor faults and 12-15 s of system
time with glibc's defaults, 0.73 million and 2.4 s tuned, and the prefill 15-17 s → 11.8 s.
tcmalloc and jemalloc (what vLLM's CPU backend preloads) keep freed memory too; this gets the
same effect from the allocator every Linux process already has, with no preload.

The tuning, done once per engine process before the model loads (`tune_cpu_malloc`):

- `M_MMAP_THRESHOLD` = 32 MiB, glibc's maximum: activations up to that size come from the
  heap, so a freed one is reused by the next step;
- `M_TRIM_THRESHOLD` = 1 GiB: up to that much free memory at the heap's top is kept, so the
  process's resident memory stays at its step peak instead of shrinking and faulting back.

Setting either also turns off glibc's dynamic threshold. Larger blocks (the KV cache, weights)
are still mapped on their own. `FLEETSERVE_CPU_MALLOC_TUNING=0` keeps glibc's defaults; a libc
that is not glibc (musl) is left alone; both are logged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "MallocTuning",
    "release_free_heap",
    "tune_cpu_malloc",
]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest accepted mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)."""
TRIM_THRESHOLD_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class MallocTuning:
    """What `tune_cpu_malloc` did."""

    applied: bool
    reason: str


def tune_cpu_malloc(enabled: bool = True) -> MallocTuning:
    """Set glibc's mmap and trim thresholds for this process (see the module docstring) and
    log what was done; never raises (a process whose libc cannot be tuned runs untuned)."""
    tuning = _tune(enabled)
    logger.info(
        "CPU malloc: %s (%s)", "tuned" if tuning.applied else "glibc defaults", tuning.reason
    )
    return tuning


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS now (glibc's `malloc_trim(0)`), for a one-off
    release the trim threshold would keep: weights copied elsewhere at start-up, not step
    activations. Returns whether glibc released any; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # musl has none


def _tune(enabled: bool) -> MallocTuning:
    if not enabled:
        return MallocTuning(False, "FLEETSERVE_CPU_MALLOC_TUNING=0")
    libc = _glibc()
    if libc is None:
        return MallocTuning(False, "the C library is not glibc")
    version = libc.gnu_get_libc_version
    version.restype = ctypes.c_char_p
    glibc = version().decode()
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # NOTE: mallopt returns 1 on success, 0 when it refuses the value.
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return MallocTuning(False, f"glibc {glibc} refused M_MMAP_THRESHOLD")
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        return MallocTuning(False, f"glibc {glibc} refused M_TRIM_THRESHOLD")
    return MallocTuning(
        True,
        f"glibc {glibc}: blocks up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, "
        f"up to {TRIM_THRESHOLD_BYTES >> 20} MiB of free heap kept for the next step",
    )
