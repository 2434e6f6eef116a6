"""Resident-set-size figures of the current process (Linux; no third-party dependency)."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys


def rss_mb() -> float:
    """The current resident set size in MB (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # no /proc: fall back to the peak
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """The peak resident set size of this process so far in MB: Linux's ``VmHWM`` where there is
    /proc, else ``ru_maxrss``.

    ``ru_maxrss`` outlives ``exec``: a process started by ``subprocess`` from a parent holding
    800 MB reads ~800 MB there before doing anything (Linux carries the old address space's peak
    into the new program's rusage), which buried a small worker's own peak under its parent's.
    ``VmHWM`` belongs to the process's own address space (unless reset, see below).
    """
    try:
        return high_water_mark_mb()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def reset_high_water_mark() -> None:
    """Restart the resident set's high-water mark (Linux: ``/proc/self/clear_refs``); the next
    :func:`peak_rss_mb` counts from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def high_water_mark_mb() -> float:
    """The resident set's high-water mark (``VmHWM``) since the last reset, in MB (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")


def trim() -> None:
    """Collect garbage and give freed heap memory back to the OS, so the next RSS reading is clean."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peaks(rss_before_mb: float) -> dict:
    peak = peak_rss_mb()
    return {"peak_rss_mb": peak, "peak_increase_mb": peak - rss_before_mb, "rss_end_mb": rss_mb()}
