"""onnxtrain's log messages go through :mod:`logging`, under the ``onnxtrain`` logger.

Upstream's log levels (:class:`LogLevel`, ``VERBOSE`` to ``FATAL``) map onto logging's.
:func:`set_verbosity` is the one-call switch for scripts; applications that configure
:mod:`logging` themselves need nothing from here.

Example:
    >>> import onnxtrain
    >>> onnxtrain.set_verbosity(onnxtrain.LogLevel.INFO)   # phase timings, exports, ...
    >>> onnxtrain.set_verbosity("warning")                  # back to warnings only
"""

from __future__ import annotations

import enum
import logging

from onnxtrain.errors import OnnxTrainError

ROOT_LOGGER = "onnxtrain"


class LogLevel(enum.IntEnum):
    """Upstream's log levels. ``DebugOptions(log_level=...)`` sets onnxruntime's own log
    severity for ORTModule's sessions; :func:`set_verbosity` takes them for onnxtrain's messages."""

    VERBOSE = 0
    INFO = 1
    DEVINFO = 1  # upstream's level between VERBOSE and INFO: onnxruntime's INFO (an alias of INFO)
    WARNING = 2
    ERROR = 3
    FATAL = 4

    @property
    def onnxruntime_severity(self) -> int:
        """onnxruntime's log severity for this level: INFO (and DEVINFO) is onnxruntime's
        WARNING, as upstream's ORTModule mapped it (onnxruntime's INFO writes thousands of lines
        per session); VERBOSE is onnxruntime's VERBOSE, where its INFO lines show too."""
        return 2 if self is LogLevel.INFO else int(self)

    @property
    def logging_level(self) -> int:
        """The :mod:`logging` level with the same meaning."""
        return {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}[self]


_NAMES = {**{name: level.logging_level for name, level in LogLevel.__members__.items()}, "DEBUG": logging.DEBUG,
          "CRITICAL": logging.CRITICAL}


def as_log_level(level: LogLevel | int | str, what: str) -> LogLevel:
    """``level`` as a :class:`LogLevel`: one, or its name (any case); else a ``TypeError``
    naming ``what`` (not a number: upstream's LogLevel numbers its levels from 0 with DEVINFO
    1 and INFO 2, onnxruntime's severities have INFO 1, so a number is ambiguous)."""
    if isinstance(level, LogLevel):
        return level
    if isinstance(level, str) and level.upper() in LogLevel.__members__:
        return LogLevel[level.upper()]
    raise TypeError(f"{what} must be an onnxtrain LogLevel ({', '.join(LogLevel.__members__)}), got {level!r}")


def logging_level(level: LogLevel | int | str) -> int:
    """The :mod:`logging` level for an upstream :class:`LogLevel`, a level name (either
    vocabulary, any case) or a :mod:`logging` level number."""
    if isinstance(level, LogLevel):
        return level.logging_level
    if isinstance(level, str) and level.upper() in _NAMES:
        return _NAMES[level.upper()]
    if isinstance(level, int) and not isinstance(level, bool) and level >= logging.DEBUG:
        return level
    raise OnnxTrainError(f"log level must be an onnxtrain.LogLevel, one of {sorted(_NAMES)} or a logging level "
                         f"number (>= {logging.DEBUG}), got {level!r}")


def set_verbosity(level: LogLevel | int | str) -> None:
    """Show onnxtrain's messages at ``level`` and above on stderr: sets the ``onnxtrain``
    logger's level and, unless it or the root logger already has one, gives it a handler."""
    logger = logging.getLogger(ROOT_LOGGER)
    logger.setLevel(logging_level(level))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
