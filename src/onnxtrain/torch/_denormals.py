"""Denormal floats as zero in ORTModule's onnxruntime runs, and only there.

A masked attention Softmax exponentiates very negative scores (the masked keys), and MLAS's
``exp`` then computes with denormal intermediates, which x86 cores handle in a slow microcode
path: ORT's Softmax over BERT/MiniLM-sized attention with padded keys ran ~4x slower than over
unmasked scores (2.0 against 0.46 ms on ``[8, 12, 128, 128]``, 2 threads), although every
masked probability comes out exactly 0 either way. onnxruntime's session option
``session.set_denormal_as_zero`` sets the flush-to-zero and denormals-are-zero flags (FTZ/DAZ)
on its pool threads, but also on the thread that creates the process's first session asking for
it, and a run shares its work with the calling thread, whose flags it does not set.

So ORTModule asks onnxruntime for it, puts the creating thread's flags back right after the
session exists, and sets them on the calling thread for the length of each run only
(:func:`denormals_flushed`, through ``torch.set_flush_denormal``): PyTorch's own arithmetic in
the user's threads is never affected. Values below float32's smallest normal (~1.2e-38) that
ORT computes become 0.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnxruntime as ort
import torch

DENORMALS_AS_ZERO = "session.set_denormal_as_zero"
# the smallest positive float32 denormal times two: nonzero unless the thread flushes denormals
_DENORMAL = np.array([2.0**-148], dtype=np.float32)


def thread_flushes_denormals() -> bool:
    """Whether the calling thread's float arithmetic flushes denormals (FTZ or DAZ set)."""
    return float((_DENORMAL * np.float32(1.0))[0]) == 0.0


def can_flush_denormals() -> bool:
    """Whether PyTorch can set the flags on this CPU (x86 with SSE3, arm64); leaves them as they are."""
    return torch.set_flush_denormal(thread_flushes_denormals())


def asks_for_flushing(options: ort.SessionOptions | None) -> bool:
    """Whether ``options`` set ``session.set_denormal_as_zero``."""
    if options is None:
        return False
    try:
        return options.get_session_config_entry(DENORMALS_AS_ZERO) == "1"
    except RuntimeError:  # onnxruntime's answer for an entry never set
        return False


@contextlib.contextmanager
def denormals_flushed():
    """FTZ/DAZ on the calling thread for the ``with`` block; its flags as before afterwards."""
    if thread_flushes_denormals() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def creating_thread_kept():
    """Restore the calling thread's flags after a session creation that may have set them."""
    before = thread_flushes_denormals()
    try:
        yield
    finally:
        if not before and thread_flushes_denormals():
            torch.set_flush_denormal(False)
