"""The fused training step as a Module and its Optimizer share it (graph: :mod:`onnxtrain.fused_step`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import onnxruntime as ort

from onnxtrain.runtime.binding import BindingCache


class FusedStep:
    """One session that runs forward, backward and the optimizer update, and the update it left.

    The Optimizer builds it and hands it to its Module. A training step that starts from fresh
    gradients runs :attr:`session` with :meth:`binding`, then calls :meth:`done`: the update now
    waits in the spare buffers, and ``Optimizer.step()`` asks :meth:`take_update` whether it
    still applies (nothing it depends on changed since) before running the optimizer model
    instead.

    An update that goes unused is work thrown away: with gradient accumulation the first
    micro-batch starts from fresh gradients, but the next ones change them before the step. So
    once an update went unused, :meth:`worth_running` says no, and the Module runs the training
    model alone, until a step again follows a single fresh-gradient run
    (:meth:`would_have_served`) or an update is taken.

    Args:
        session: the fused step's session.
        setup_binding: binds what stays bound between steps (parameters, buffers, states).
        binding_key: the current buffer layout and phases, one cached binding per value.
        bind_step_inputs: binds the per-step inputs (learning rate, step, loss scale).
        step_inputs: what the update depends on besides the state's version.
        version: the checkpoint state's version (parameters or gradients written since).
    """

    def __init__(self, session: ort.InferenceSession, setup_binding: Callable[[ort.IOBinding], None],
                 binding_key: Callable[[], Hashable], bind_step_inputs: Callable[[ort.IOBinding], None],
                 step_inputs: Callable[[], tuple], version: Callable[[], int]):
        self.session = session
        self._bindings = BindingCache(session, setup_binding)
        self._binding_key, self._bind_step_inputs = binding_key, bind_step_inputs
        self._step_inputs, self._version = step_inputs, version
        self._inputs: tuple | None = None   # step inputs of the run in progress
        self._pending: tuple | None = None  # (version, step inputs) of the update in the spare buffers
        self._useful = True  # False once an update it computed went unused

    def binding(self) -> ort.IOBinding:
        """The binding for a run now: current buffers, this step's inputs bound."""
        binding = self._bindings.get(self._binding_key())
        self._bind_step_inputs(binding)
        self._inputs = self._step_inputs()
        if self._pending is not None:  # the last update was never taken
            self._useful = False
        self._pending = None
        return binding

    def worth_running(self) -> bool:
        """Whether a step from fresh gradients should run this session (see the class doc)."""
        return self._useful

    def would_have_served(self) -> None:
        """A step followed a single fresh-gradient run of the training model: run this again."""
        self._useful = True

    def done(self) -> None:
        """The run succeeded: its update is valid until the state or a step input changes."""
        self._pending = (self._version(), *self._inputs)

    def take_update(self) -> bool:
        """Whether the spare buffers hold exactly the update due now; forgets it either way."""
        pending, self._pending = self._pending, None
        taken = pending is not None and pending == (self._version(), *self._step_inputs())
        if pending is not None:
            self._useful = taken
        return taken
