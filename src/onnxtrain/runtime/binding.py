"""IOBindings built once per buffer arrangement and reused.

Parameters, gradients and optimizer states ping-pong between two buffers, so a session
only ever sees a handful of distinct arrangements. Each gets its own IOBinding with
the state tensors bound once; a run then only binds the user inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import onnxruntime as ort

# Layout changes (a device move, new buffers) make every cached binding stale; the
# number of arrangements alive at once is at most 2 x 2 x 2 (params, grads, states).
MAX_CACHED_BINDINGS = 8


class BindingCache:
    """``get(key)`` returns the IOBinding for ``key``, calling ``setup(binding)`` the first time."""

    def __init__(self, session: ort.InferenceSession, setup: Callable[[ort.IOBinding], None]):
        self.session = session
        self._setup = setup
        self._bindings: dict[Hashable, ort.IOBinding] = {}

    def get(self, key: Hashable) -> ort.IOBinding:
        binding = self._bindings.get(key)
        if binding is None:
            if len(self._bindings) >= MAX_CACHED_BINDINGS:
                self._bindings.clear()
            binding = self.session.io_binding()
            self._setup(binding)
            self._bindings[key] = binding
        return binding
