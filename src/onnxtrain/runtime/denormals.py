"""Denormal floats as zero in onnxtrain's onnxruntime CPU runs, and only there.

A masked attention Softmax exponentiates very negative scores (the masked keys), and MLAS's
``exp`` then computes with denormal intermediates, which x86 cores handle in a slow microcode
path: ORT's Softmax over BERT/MiniLM-sized attention with padded keys ran ~4x slower than over
unmasked scores (2.0 against 0.46 ms on ``[8, 12, 128, 128]``, 2 threads), although every
masked probability comes out exactly 0 either way. onnxruntime's session option
``session.set_denormal_as_zero`` sets the flush-to-zero and denormals-are-zero flags (FTZ/DAZ)
on its pool threads, but also on the thread that creates the process's first session asking for
it, and a run shares its work with the calling thread, whose flags it does not set.

So onnxtrain asks onnxruntime for it, puts the creating thread's flags back right after the
session exists (:func:`creating_thread_kept`), and sets them on the calling thread for the
length of each run only (:func:`denormals_flushed`): the user's own arithmetic in that thread
(numpy's, PyTorch's) is never affected. Values below float32's smallest normal (~1.2e-38) that
ORT computes become 0.

The calling thread's flags are set through the C library's ``fegetmode``/``fesetmode`` (glibc
2.25 or later, x86-64 and arm64 Linux), or through ``torch.set_flush_denormal`` where PyTorch is
already imported; elsewhere nothing is flushed (:func:`can_flush_denormals` says which).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import sys

import numpy as np
import onnxruntime as ort

DENORMALS_AS_ZERO = "session.set_denormal_as_zero"
# the smallest positive float32 denormal times two: nonzero unless the thread flushes denormals
_DENORMAL = np.array([2.0**-148], dtype=np.float32)


class _X86Mode(ctypes.Structure):
    """glibc's ``femode_t`` on x86-64: the x87 control word and the SSE control register."""

    _fields_ = [("control_word", ctypes.c_ushort), ("reserved", ctypes.c_ushort), ("mxcsr", ctypes.c_uint)]


class _Arm64Mode(ctypes.Structure):
    """glibc's ``femode_t`` on arm64: the floating-point control register."""

    _fields_ = [("fpcr", ctypes.c_uint)]


# per machine: the femode_t layout, its register field and that register's flush bits
# (x86 MXCSR: FTZ bit 15, DAZ bit 6; arm64 FPCR: FZ bit 24)
_MODES = {"x86_64": (_X86Mode, "mxcsr", 0x8040), "amd64": (_X86Mode, "mxcsr", 0x8040),
          "aarch64": (_Arm64Mode, "fpcr", 1 << 24), "arm64": (_Arm64Mode, "fpcr", 1 << 24)}


def thread_flushes_denormals() -> bool:
    """Whether the calling thread's float arithmetic flushes denormals (FTZ or DAZ set)."""
    return float((_DENORMAL * np.float32(1.0))[0]) == 0.0


class _FloatingPointMode:
    """The calling thread's flush flags through the C library's ``fegetmode``/``fesetmode``."""

    def __init__(self, libm: ctypes.CDLL, layout: type[ctypes.Structure], field: str, bits: int):
        self._get, self._set = libm.fegetmode, libm.fesetmode
        self._layout, self._field, self._bits = layout, field, bits

    def _read(self):
        mode = self._layout()
        if self._get(ctypes.byref(mode)) != 0:
            raise OSError("fegetmode failed")
        return mode

    def restore(self, mode) -> None:
        """Make ``mode`` (one :meth:`flush_unless_flushing` returned) the thread's mode again."""
        if self._set(ctypes.byref(mode)) != 0:
            raise OSError("fesetmode failed")

    def set_flush(self, enabled: bool) -> None:
        mode = self._read()
        register = getattr(mode, self._field)
        setattr(mode, self._field, register | self._bits if enabled else register & ~self._bits)
        self.restore(mode)

    def flush_unless_flushing(self):
        """Set the flush bits unless one of them is set already; the mode to restore afterwards,
        or None when nothing was changed (two C calls: this runs around every session run)."""
        saved = self._read()
        register = getattr(saved, self._field)
        if register & self._bits:
            return None
        mode = self._layout.from_buffer_copy(saved)
        setattr(mode, self._field, register | self._bits)
        self.restore(mode)
        return saved


@functools.cache
def _native_mode() -> _FloatingPointMode | None:
    """The C library's mode functions where they exist and demonstrably work, else None."""
    layout = _MODES.get(platform.machine().lower())
    if sys.platform != "linux" or layout is None:
        return None
    try:
        mode = _FloatingPointMode(ctypes.CDLL("libm.so.6"), *layout)
    except (OSError, AttributeError):  # no glibc libm, or one older than 2.25
        return None
    before = thread_flushes_denormals()
    try:
        mode.set_flush(not before)
        works = thread_flushes_denormals() != before
        mode.set_flush(before)
    except OSError:
        return None
    return mode if works and thread_flushes_denormals() == before else None


def _set_thread_flush(enabled: bool) -> bool:
    """Set or clear FTZ/DAZ on the calling thread; False if this platform offers no way to."""
    native = _native_mode()
    if native is not None:
        native.set_flush(enabled)
        return True
    torch = sys.modules.get("torch")
    return torch is not None and torch.set_flush_denormal(enabled)


def can_flush_denormals() -> bool:
    """Whether onnxtrain can set the calling thread's flags here; leaves them as they are."""
    return _set_thread_flush(thread_flushes_denormals())


def runs_flush_denormals(options: ort.SessionOptions | None, device_type: str) -> bool:
    """Whether runs of a session with ``options`` on a ``device_type`` device ("cpu", "cuda")
    should hold the calling thread's flags (:func:`denormals_flushed`): CPU sessions whose
    options set ``session.set_denormal_as_zero``."""
    return device_type == "cpu" and _asks_for_flushing(options)


def _asks_for_flushing(options: ort.SessionOptions | None) -> bool:
    """Whether ``options`` set ``session.set_denormal_as_zero``."""
    if options is None:
        return False
    try:
        return options.get_session_config_entry(DENORMALS_AS_ZERO) == "1"
    except RuntimeError:  # onnxruntime's answer for an entry never set
        return False


def ask_for_flushing(options: ort.SessionOptions) -> ort.SessionOptions:
    """Set ``session.set_denormal_as_zero`` in ``options`` where the calling thread's flags can follow."""
    if can_flush_denormals():
        options.add_session_config_entry(DENORMALS_AS_ZERO, "1")
    return options


class denormals_flushed:  # noqa: N801  (used as a function: ``with denormals_flushed(): ...``)
    """FTZ/DAZ on the calling thread for the ``with`` block (if ``enabled``); its flags as before
    afterwards. Nothing changes where either flag is set already."""

    __slots__ = ("_enabled", "_restore")

    def __init__(self, enabled: bool = True):
        self._enabled = enabled
        self._restore = None

    def __enter__(self):
        if not self._enabled:
            return self
        native = _native_mode()
        if native is not None:  # the common case, in two C calls
            saved = native.flush_unless_flushing()
            if saved is not None:
                self._restore = functools.partial(native.restore, saved)
        elif not thread_flushes_denormals() and _set_thread_flush(True):
            self._restore = functools.partial(_set_thread_flush, False)
        return self

    def __exit__(self, *exc_info) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()


@contextlib.contextmanager
def creating_thread_kept():
    """Restore the calling thread's flags after a session creation that may have changed them
    (the process's first session sets them as its own options say, on or off)."""
    before = thread_flushes_denormals()
    try:
        yield
    finally:
        if thread_flushes_denormals() != before:
            _set_thread_flush(before)
