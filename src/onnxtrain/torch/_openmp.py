"""Stop PyTorch's OpenMP threads from spinning while ONNX Runtime runs on the same cores.

PyTorch's CPU build runs its parallel ops on GNU OpenMP (libgomp), whose worker threads keep
spinning for a while after each parallel region. When an ONNX Runtime session runs right
after a PyTorch op (the loss, the optimizer, autograd bookkeeping), those spinning threads
hold the cores that ORT's pool needs, and the OS gives ORT its turn only slice by slice: on
2 cores the CNN benchmark's ORT runs took 14 + 35 ms instead of 9 + 28 ms. libgomp reads its
wait policy (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) once, when torch is imported, so a
library cannot change it; it can release the calling thread's OpenMP threads before the ORT
run with ``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0). The next parallel PyTorch
op starts them again (tens of microseconds).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_all():
    """libgomp's ``omp_pause_resource_all`` as loaded by torch, or None (another OpenMP runtime,
    an older libgomp, or no /proc to look in)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        path = fields[-1] if fields else ""
        if "libgomp" in Path(path).name:
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                return None
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_torch_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP threads go (no-op without libgomp); True if released."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
