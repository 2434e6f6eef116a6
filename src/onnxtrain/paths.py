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
