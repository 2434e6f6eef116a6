"""CheckpointState: parameters, gradients, optimizer state and user properties.

Mirrors ``onnxruntime.training.api.checkpoint_state``. Every tensor lives as an
``onnxruntime.OrtValue`` so that sessions bind it without copies. Trainable parameters,
gradients and optimizer states each have two buffers once a Module/Optimizer uses them:
a session writes the new value into the spare buffer and the state flips which one is
current, so a failed run never leaves a half-written tensor behind.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxtrain import checkpoint as ckpt
from onnxtrain.errors import CheckpointError, InputMismatchError
from onnxtrain.runtime.device import Device
from onnxtrain.runtime.values import from_numpy, to_numpy, zeros

DEFAULT_LEARNING_RATE = 1e-3  # upstream's default when neither checkpoint nor user set one


def exclusive(method):
    """Run ``method`` (of a CheckpointState, or of an object with a ``_state``) holding the
    state's lock: steps, and the reads and writes of the state between them, take turns across
    threads (onnxruntime releases the GIL while it runs; a step flips buffers others read)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        state = self if isinstance(self, CheckpointState) else self._state
        with state._lock:
            return method(self, *args, **kwargs)
    return run


class _Slot:
    """Storage of one parameter: value buffers (1, or 2 with an optimizer) and gradient buffers."""

    __slots__ = ("name", "requires_grad", "dtype", "shape", "values", "grads", "has_value", "has_grad")

    def __init__(self, name: str, requires_grad: bool, dtype: np.dtype, shape: tuple[int, ...]):
        self.name, self.requires_grad, self.dtype, self.shape = name, requires_grad, np.dtype(dtype), tuple(shape)
        self.values: list[ort.OrtValue] = []
        self.grads: list[ort.OrtValue] = []
        self.has_value = False
        self.has_grad = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _OptimizerState:
    """Step count, learning rate and the state tensors of every trainable parameter.

    ``buffers[param][state]`` is a pair of OrtValues; ``buffers[..][..][phase]`` is current.
    Loaded from a checkpoint, ``pending`` holds numpy values until an Optimizer adopts them.
    """

    def __init__(self, step: int = 0, learning_rate: float = DEFAULT_LEARNING_RATE, states=()):
        self.step = int(step)
        self.learning_rate = float(learning_rate)
        self.initial_lr = float(learning_rate)
        self.states = list(states)
        self.pending: dict[str, dict[str, np.ndarray]] = {}
        self.buffers: dict[str, dict[str, list[ort.OrtValue]]] = {}
        self.phase = 0

    def current(self, param: str, state: str) -> ort.OrtValue:
        return self.buffers[param][state][self.phase]

    def spare(self, param: str, state: str) -> ort.OrtValue:
        return self.buffers[param][state][1 - self.phase]

    def values(self) -> dict[str, dict[str, np.ndarray]]:
        if self.buffers:
            return {p: {s: to_numpy(self.current(p, s)) for s in per} for p, per in self.buffers.items()}
        return {p: dict(per) for p, per in self.pending.items()}


class Parameter:
    """A model parameter held by a :class:`CheckpointState` (not created directly).

    Attributes: ``name``, ``data`` (a numpy copy; assign an array to update it in place;
    reading it raises ``CheckpointError`` for a parameter of a nominal checkpoint that was never
    set, as upstream), ``requires_grad``, ``grad`` (a numpy copy of the accumulated gradient:
    zeros from a Module's creation to its first training step, as upstream; None for a frozen
    parameter or before any Module), ``shape`` and ``dtype`` (known without a value).
    """

    def __init__(self, state: CheckpointState, name: str):
        self._state, self._name = state, name

    @property
    def name(self) -> str:
        return self._name

    @property
    @exclusive
    def data(self) -> np.ndarray:
        slot = self._state._slots[self._name]
        if not slot.has_value:
            raise CheckpointError(f"parameter {self._name!r} has no value (it came from a nominal checkpoint): "
                                  f"set it first, e.g. state.parameters[{self._name!r}] = array")
        return to_numpy(self._state._value(slot))

    @data.setter
    def data(self, value) -> None:
        self._state._assign(self._name, value)

    @property
    @exclusive
    def grad(self) -> np.ndarray | None:
        slot = self._state._slots[self._name]
        if slot.has_grad:
            return to_numpy(self._state._grad(slot))
        # a Module over the state gave the parameter gradient buffers: zeros until a step, as upstream
        return np.zeros(slot.shape, slot.dtype) if slot.grads else None

    @property
    def requires_grad(self) -> bool:
        return self._state._slots[self._name].requires_grad

    @property
    def shape(self) -> tuple[int, ...]:
        return self._state._slots[self._name].shape

    @property
    def dtype(self) -> np.dtype:
        return self._state._slots[self._name].dtype

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, requires_grad={self.requires_grad})"


class Parameters(Mapping):
    """Dict-like view of the parameters, by name, in checkpoint order.

    ``params[name]`` is a :class:`Parameter`; ``params[name] = array`` copies ``array`` into
    the parameter (same shape and dtype required). As upstream's, iterating yields
    ``(name, Parameter)`` pairs (``for name, param in state.parameters``); ``keys()``,
    ``values()`` and ``items()`` behave as a dict's.
    """

    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self._state._slots:
            raise KeyError(f"Parameter {name} not found.")
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value) -> None:
        if name not in self._state._slots:
            raise KeyError(f"Parameter {name} not found.")
        self._state._assign(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._state._slots

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        return iter([(name, Parameter(self._state, name)) for name in self._state._slots])

    def keys(self) -> list[str]:
        return list(self._state._slots)

    def values(self) -> list[Parameter]:
        return [Parameter(self._state, name) for name in self._state._slots]

    def items(self) -> list[tuple[str, Parameter]]:
        return list(self)

    def __len__(self) -> int:
        return len(self._state._slots)

    def __repr__(self) -> str:
        return f"Parameters({list(self._state._slots)})"


class Properties(MutableMapping):
    """Dict-like user properties (int, float or str values), saved with the checkpoint.

    As upstream's, iterating yields ``(name, value)`` pairs; ``keys()``, ``values()`` and
    ``items()`` behave as a dict's.
    """

    def __init__(self, state: CheckpointState):
        self._state = state

    def __getitem__(self, name: str) -> int | float | str:
        if name not in self._state._properties:
            raise KeyError(f"Property {name} not found.")
        return self._state._properties[name]

    def __setitem__(self, name: str, value: int | float | str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"property names are str, got {type(name).__name__}")
        try:
            self._state._properties[name] = ckpt._check_property(name, value)  # noqa: SLF001
        except CheckpointError as exc:
            raise TypeError(str(exc)) from None

    def __delitem__(self, name: str) -> None:
        del self._state._properties[name]

    def __contains__(self, name: object) -> bool:
        return name in self._state._properties

    def __iter__(self) -> Iterator[tuple[str, int | float | str]]:
        return iter(list(self._state._properties.items()))

    def keys(self) -> list[str]:
        return list(self._state._properties)

    def values(self) -> list[int | float | str]:
        return list(self._state._properties.values())

    def items(self) -> list[tuple[str, int | float | str]]:
        return list(self._state._properties.items())

    def __len__(self) -> int:
        return len(self._state._properties)

    # MutableMapping's own popitem/clear iterate expecting names: iteration yields pairs here
    def popitem(self) -> tuple[str, int | float | str]:
        """Remove and return the last ``(name, value)`` set, as a dict's; ``KeyError`` if none."""
        if not self._state._properties:
            raise KeyError("popitem(): no properties")
        return self._state._properties.popitem()

    def clear(self) -> None:
        self._state._properties.clear()

    def __repr__(self) -> str:
        return f"Properties({self._state._properties!r})"


class CheckpointState:
    """The training state: parameters (with gradients), optimizer state and user properties.

    Create it with :meth:`load_checkpoint`; a :class:`~onnxtrain.api.Module` and an
    :class:`~onnxtrain.api.Optimizer` then read and update it in place.

    Example:
        >>> import numpy as np, os, tempfile
        >>> from onnxtrain.checkpoint import write_checkpoint
        >>> from onnxtrain.api import CheckpointState
        >>> path = os.path.join(tempfile.mkdtemp(), "checkpoint")
        >>> write_checkpoint(path, {"w": np.zeros((2, 2), np.float32)}, requires_grad={"w"})
        >>> state = CheckpointState.load_checkpoint(path)
        >>> state.parameters["w"] = np.eye(2, dtype=np.float32)
        >>> state.properties["epoch"] = 3
        >>> CheckpointState.save_checkpoint(state, path)
        >>> again = CheckpointState.load_checkpoint(path)
        >>> again.parameters["w"].data.tolist(), again.properties["epoch"]
        ([[1.0, 0.0], [0.0, 1.0]], 3)
    """

    def __init__(self, data: ckpt.CheckpointData):
        if not isinstance(data, ckpt.CheckpointData):
            raise TypeError(f"Invalid argument for CheckpointState received {type(data)}; "
                            f"use CheckpointState.load_checkpoint(path)")
        self._device = Device("cpu")
        self._lock = threading.RLock()  # see exclusive()
        self._slots: dict[str, _Slot] = {}
        for name, rec in data.parameters.items():
            slot = _Slot(name, rec.requires_grad, rec.dtype, rec.shape)
            if rec.value is not None:
                slot.values = [from_numpy(np.array(rec.value, dtype=slot.dtype, copy=True), self._device)]
                slot.has_value = True
            else:  # a nominal checkpoint: placeholders of the declared size
                try:
                    slot.values = [zeros(slot.shape, slot.dtype, self._device)]
                except (MemoryError, RuntimeError, ValueError) as exc:
                    raise CheckpointError(f"nominal parameter {name!r} of shape {list(rec.shape)} {rec.dtype} could not "
                                          f"be allocated ({np.prod(rec.shape, dtype=float) * rec.dtype.itemsize / 2**30:.3g} "
                                          f"GiB): {type(exc).__name__}") from exc
            self._slots[name] = slot
        self._properties: dict[str, Any] = dict(data.properties)
        self._optimizer: _OptimizerState | None = None
        if data.optimizer is not None:
            opt = data.optimizer
            self._optimizer = _OptimizerState(opt.step, opt.learning_rate, opt.states)
            self._optimizer.pending = {p: dict(v) for p, v in opt.values.items()}
        self._param_phase = 0  # which of a trainable parameter's two buffers is current
        self._grad_phase = 0
        self._layout = 0  # bumped whenever a buffer object is created or replaced: cached bindings go stale
        # bumped whenever a parameter value or gradient changes outside an optimizer step: an update a
        # fused step computed ahead (api/optimizer.py) is valid only for the version it was computed at
        self._version = 0
        self._parameters = Parameters(self)
        self._property_view = Properties(self)

    # -- upstream API -------------------------------------------------------------------

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Load a checkpoint file (complete or nominal; onnxtrain's, or a complete one that
        onnxruntime-training saved). Raises CheckpointError if unusable."""
        return cls(ckpt.read_checkpoint(os.fspath(checkpoint_uri)))

    @classmethod
    def save_checkpoint(cls, state: CheckpointState, checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Save ``state`` atomically; with ``include_optimizer_state`` also the optimizer's
        state tensors, step count and learning rate (when there is optimizer state)."""
        if not isinstance(state, CheckpointState):
            raise TypeError(f"expected a CheckpointState, got {type(state).__name__}")
        ckpt.save_checkpoint_data(checkpoint_uri, state._to_data(include_optimizer_state))

    @property
    def parameters(self) -> Parameters:
        """The model parameters, by name."""
        return self._parameters

    @property
    def properties(self) -> Properties:
        """User properties (int, float, str), saved with the checkpoint."""
        return self._property_view

    @property
    def nominal(self) -> bool:
        """True while some parameter has no value (loaded from a nominal checkpoint)."""
        return any(not s.has_value for s in self._slots.values())

    def __repr__(self) -> str:
        return (f"CheckpointState(parameters={list(self._slots)}, properties={self._properties!r}, "
                f"optimizer_state={self._optimizer is not None})")

    # -- internal: buffers --------------------------------------------------------------

    def _value(self, slot: _Slot) -> ort.OrtValue:
        return slot.values[self._param_phase] if len(slot.values) == 2 else slot.values[0]

    def _spare_value(self, slot: _Slot) -> ort.OrtValue:
        return slot.values[1 - self._param_phase]

    def _grad(self, slot: _Slot) -> ort.OrtValue:
        return slot.grads[self._grad_phase]

    def _spare_grad(self, slot: _Slot) -> ort.OrtValue:
        return slot.grads[1 - self._grad_phase]

    def _missing_values(self) -> list[str]:
        return [n for n, s in self._slots.items() if not s.has_value]

    def _require_values(self) -> None:
        """``CheckpointError`` naming the parameters a nominal checkpoint left without a value."""
        missing = self._missing_values()
        if missing:
            raise CheckpointError(f"parameters {missing[:8]} have no value (nominal checkpoint): set them with "
                                  f"copy_buffer_to_parameters or state.parameters[name] = array first")

    def _to_device(self, device: Device) -> None:
        """Move every buffer to ``device`` (once, when a Module on another device adopts the state)."""
        if device == self._device:
            return
        for slot in self._slots.values():
            slot.values = [from_numpy(to_numpy(v), device) for v in slot.values]
            slot.grads = [from_numpy(to_numpy(g), device) for g in slot.grads]
        if self._optimizer is not None:
            for per in self._optimizer.buffers.values():
                for state, pair in per.items():
                    per[state] = [from_numpy(to_numpy(v), device) for v in pair]
        self._device = device
        self._layout += 1
        self._version += 1

    def _ensure_grads(self) -> None:
        """Two zeroed gradient buffers per trainable parameter (the training model ping-pongs them)."""
        changed = False
        for slot in self._slots.values():
            if slot.requires_grad and not slot.grads:
                slot.grads = [zeros(slot.shape, slot.dtype, self._device) for _ in range(2)]
                changed = True
        if changed:
            self._layout += 1

    def _ensure_spare_values(self) -> None:
        """A second buffer per trainable parameter, which the optimizer writes the update into."""
        changed = False
        for slot in self._slots.values():
            if slot.requires_grad and len(slot.values) == 1:
                current = slot.values[0]
                spare = zeros(slot.shape, slot.dtype, self._device)
                slot.values = [current, spare] if self._param_phase == 0 else [spare, current]
                changed = True
        if changed:
            self._layout += 1

    @exclusive
    def _assign(self, name: str, value) -> None:
        slot = self._slots[name]
        if isinstance(value, ort.OrtValue):
            value = value.numpy()
        if isinstance(value, np.ndarray):
            if value.dtype != slot.dtype:
                raise InputMismatchError(f"parameter {name!r} has dtype {slot.dtype}; got an array of {value.dtype}")
        else:
            value = np.asarray(value, dtype=slot.dtype)
        if tuple(value.shape) != slot.shape:
            raise InputMismatchError(f"parameter {name!r} has shape {list(slot.shape)}; "
                                     f"got an array of shape {list(value.shape)}")
        self._value(slot).update_inplace(np.ascontiguousarray(value))
        slot.has_value = True
        self._version += 1

    # -- internal: serialization ---------------------------------------------------------

    @exclusive
    def _to_data(self, include_optimizer_state: bool) -> ckpt.CheckpointData:
        missing = self._missing_values()
        nominal = len(missing) == len(self._slots) and bool(missing)
        if missing and not nominal:
            raise CheckpointError(f"cannot save: parameters {missing[:8]} have no value (they came from a nominal "
                                  f"checkpoint and were never set)")
        params = {}
        for name, slot in self._slots.items():
            value = None if nominal else to_numpy(self._value(slot))
            params[name] = ckpt.ParameterRecord(name, slot.requires_grad, slot.dtype, slot.shape, value)
        optimizer = None
        if include_optimizer_state and self._optimizer is not None:
            opt = self._optimizer
            optimizer = ckpt.OptimizerRecord(opt.step, opt.learning_rate, list(opt.states), opt.values())
        return ckpt.CheckpointData(params, nominal, optimizer, dict(self._properties))
