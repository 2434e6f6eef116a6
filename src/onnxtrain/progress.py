"""Progress bars (tqdm, on stderr) for long operations, with each phase's time logged.

:class:`Phases` shows one bar over the named phases of an operation (building gradient
graphs, writing files, ...) and logs each phase's duration at INFO on the operation's logger,
so a script without a terminal still gets the timings through :mod:`logging`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

# With ``show=None`` a bar appears only for models at least this large (smaller ones finish in
# seconds) and only on a terminal.
BIG_MODEL_BYTES = 100 * 2**20


def tqdm_disable(show: bool | None, model_bytes: int) -> bool | None:
    """tqdm's ``disable`` argument (True hides the bar; None: hidden unless on a terminal) for
    the choice ``show``: True always shows it, False never, None on a terminal for models of
    at least :data:`BIG_MODEL_BYTES`."""
    if show is None:
        return None if model_bytes >= BIG_MODEL_BYTES else True
    return not show


class Phases:
    """A progress bar over ``total`` phases of one operation.

    Example:
        >>> import logging
        >>> with Phases("artifacts", total=2, disable=True, logger=logging.getLogger("demo")) as bar:
        ...     with bar.phase("training graph"):
        ...         pass
        ...     with bar.phase("checkpoint"):
        ...         pass
        >>> [name for name, _ in bar.seconds]
        ['training graph', 'checkpoint']
    """

    def __init__(self, description: str, total: int, disable: bool | None, logger: logging.Logger):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=description, unit="phase", disable=disable, mininterval=0,
                         bar_format="{desc}: {n_fmt}/{total_fmt} {bar} [{elapsed}]{postfix}")
        self._logger = logger
        self._description = description
        self.seconds: list[tuple[str, float]] = []

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name``; the bar shows it while it runs."""
        self._bar.set_postfix_str(name)  # refreshes the bar
        began = time.perf_counter()
        yield
        elapsed = time.perf_counter() - began
        self.seconds.append((name, elapsed))
        self._logger.info("%s: %s took %.2f s", self._description, name, elapsed)
        self._bar.set_postfix_str("done" if self._bar.n + 1 == self._bar.total else "", refresh=False)
        self._bar.update()

    def __enter__(self) -> "Phases":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
