"""What is wrong with a path the user gave for a file to read, in words for an error message."""

from __future__ import annotations

import os
import stat


def unreadable_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a regular file to read (``"does not exist"``, ``"is a directory"``, ...),
    or None. A FIFO would block a reader and a device read without end, so both are refused."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:  # a symbolic link loop, no permission, a name too long
        return f"cannot be read: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, device or socket)"
    return None


def file_path(value, what: str) -> str:
    """``value`` as a path (``os.fspath``), or a ``TypeError`` naming ``what``: ``os.fspath`` takes
    bytes as a path too, so a model's bytes were read as a file name ("embedded null byte")."""
    raw = isinstance(value, (bytes, bytearray, memoryview))
    if raw or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be the path of a file (str or os.PathLike), got {type(value).__name__}"
                        + ("; write the model's bytes to a file first" if raw else ""))
    path = os.fspath(value)
    if isinstance(path, bytes):  # an os.PathLike whose __fspath__ gives bytes
        raise TypeError(f"{what} must be a str path, got a bytes path {path!r}")
    return path
