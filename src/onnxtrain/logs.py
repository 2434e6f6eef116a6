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
    WARNING = 2
    ERROR = 3
    FATAL = 4

    @property
    def logging_level(self) -> int:
        """The :mod:`logging` level with the same meaning."""
        return {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}[self]


_NAMES = {**{level.name: level.logging_level for level in LogLevel}, "DEBUG": logging.DEBUG,
          "CRITICAL": logging.CRITICAL}


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
