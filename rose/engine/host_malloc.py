"""Keep glibc malloc from handing a CPU engine's activation memory back to the kernel after every step.

A CPU step allocates multi-MiB activations (a 2048-token chunk through a 1024-wide MLP is 8 MiB per tensor) and frees
them again. glibc serves such sizes with mmap, or trims them off the heap top once the free space passes its
threshold, so every step page-faults the same memory back in: the kernel zeroes it page by page and a prefill-heavy
step runs up to 30% slower. Raising the mmap and trim thresholds keeps that memory in the process (its peak is the
working set anyway). vLLM's CPU backend gets the same effect by preloading tcmalloc; this needs nothing installed.

Process-wide, applied once; a no-op off glibc, when the user already tuned these settings (MALLOC_*_THRESHOLD_ and
the like, GLIBC_TUNABLES, a preloaded allocator), or with ROSE_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the largest value glibc accepts (half its 64 MiB heap size on 64-bit)
TRIM_THRESHOLD = 2**30

# glibc's own variables for the same settings (MALLOC_ARENA_MAX, common in containers, is another matter)
_THRESHOLD_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: dict[str, int] | None = None


def _user_tuned() -> str | None:
    if os.environ.get("ROSE_MALLOC_TUNING", "1").strip().lower() in {"0", "false", "no", "off"}:
        return "ROSE_MALLOC_TUNING=0"
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    named = [k for k in _THRESHOLD_ENV if k in os.environ]
    if named:
        return f"{named[0]} is set"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(lib in preload for lib in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded"
    return None


def tune_malloc() -> dict[str, int] | None:
    """Raise glibc's mmap and trim thresholds once per process. Returns the settings applied, None if skipped."""
    global _applied
    if _applied is not None:
        return _applied
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    reason = _user_tuned()
    if reason is not None:
        logger.debug("malloc tuning skipped: %s", reason)
        return None
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("mallopt refused the thresholds; malloc left as it was")
        return None
    _applied = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    logger.debug("glibc malloc: mmap_threshold=%d trim_threshold=%d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return _applied


def malloc_tuning() -> dict[str, int] | None:
    """What `tune_malloc` applied in this process (None: nothing)."""
    return _applied
