"""Dynamic loss scaling for PyTorch gradients, with ``torch.amp.GradScaler``'s semantics.

:class:`GradScaler` multiplies the loss by a scale before ``backward()`` so that small fp16
gradients do not flush to zero, divides the gradients by it before the optimizer step, skips
the step when a gradient holds an inf or a NaN, and adapts the scale: halve it after a skipped
step, double it after ``growth_interval`` good steps in a row. Same arguments, defaults, call
order and ``state_dict()`` as PyTorch's, on CPU and CUDA, for gradients of any floating dtype
(PyTorch's refuses fp16 gradients; this one unscales them in place in their own dtype).

It works with :class:`onnxtrain.torch.ORTModule` models unchanged: their gradients come out of
ONNX Runtime into ``param.grad`` like eager PyTorch's. :class:`onnxtrain.torch.optim.FP16_Optimizer`
uses it for its own loss scaling.
"""

from __future__ import annotations

import enum
import warnings
from collections import abc, defaultdict
from dataclasses import dataclass, field

import torch

from onnxtrain.torch.optim.errors import OptimizerConfigError, ScalerStateError

__all__ = ["GradScaler"]


class _Stage(enum.Enum):
    READY = 0  # nothing done to this optimizer since the last update()
    UNSCALED = 1  # its gradients are unscaled and checked
    STEPPED = 2  # step() was called (and maybe skipped)


@dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)


class GradScaler:
    """Dynamic loss scaler (``torch.amp.GradScaler``'s arguments, defaults and semantics).

    Args:
        device: ``"cuda"`` or ``"cpu"``; as PyTorch's, a CUDA scaler without CUDA warns and
            disables itself (then :meth:`step` only calls ``optimizer.step()``).
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` consecutive good steps
            (must be > 1).
        backoff_factor: multiplies the scale after a step with an inf/NaN gradient (in (0, 1)).
        growth_interval: number of consecutive good steps before the scale grows (>= 1).
        enabled: ``False`` makes every method a no-op (``scale`` returns its input).

    The scale and the growth counter live on the device of the first tensor passed to
    :meth:`scale`; nothing synchronizes with the device except :meth:`step`'s skip decision
    and :meth:`get_scale`.

    Example:
        >>> scaler = GradScaler("cpu")
        >>> loss = model(x).square().mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(optimizer)      # unscales, skips the step if a gradient is inf/NaN
        >>> scaler.update()             # backs off or grows the scale
        >>> optimizer.zero_grad()
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("GradScaler(device='cuda') is enabled, but CUDA is not available: disabling it.",
                          stacklevel=2)
            self._enabled = False
        _check_arguments(init_scale, growth_factor, backoff_factor, growth_interval)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None  # created by the first scale(), on its device
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)

    # -- the training-loop calls --------------------------------------------------------------
    def scale(self, outputs):
        """``outputs * scale`` for a tensor, or for every tensor of a (nested) list/tuple/iterable."""
        if not self._enabled:
            return outputs
        copies: dict[torch.device, torch.Tensor] = {}

        def apply(value):
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=value.device)
                    self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32,
                                                      device=value.device)
                if value.device not in copies:
                    copies[value.device] = self._scale.to(device=value.device, non_blocking=True)
                return value * copies[value.device]
            if isinstance(value, abc.Iterable):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise OptimizerConfigError(f"GradScaler.scale: outputs must be a tensor or an iterable of tensors, "
                                       f"got {type(value).__name__}")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and record
        whether any is inf/NaN. At most once per optimizer between two :meth:`update` calls
        (call it before clipping gradients; :meth:`step` calls it if you have not)."""
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.UNSCALED:
            raise ScalerStateError("GradScaler.unscale_() has already been called on this optimizer since the "
                                   "last update()")
        if state.stage is _Stage.STEPPED:
            raise ScalerStateError("GradScaler.unscale_() is being called after step() on this optimizer; "
                                   "call update() first")
        # the reciprocal in float64: float32 division can be inexact under some compile options
        inv_scale = scale.double().reciprocal().float()
        found = _unscale_grads(optimizer, inv_scale)
        agree = getattr(optimizer, "agree_on_found_inf", None)  # ZeroOptimizer: ranks check local gradients
        state.found_inf_per_device = agree(found) if agree is not None else found
        state.stage = _Stage.UNSCALED

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gradients unscaled by :meth:`unscale_` for ``optimizer`` in this iteration
        held an inf or a NaN (an onnxtrain addition; synchronizes with the device)."""
        state = self._per_optimizer.get(id(optimizer))
        if state is None or state.stage is _Stage.READY:
            raise ScalerStateError("GradScaler.found_inf(): call unscale_(optimizer) first in this iteration")
        return bool(sum(v.item() for v in state.found_inf_per_device.values()))

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless :meth:`unscale_` already did), then call ``optimizer.step(*args, **kwargs)``
        unless a gradient is inf/NaN; returns what ``optimizer.step`` returned, else ``None``."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise ScalerStateError("GradScaler.step: a closure is not supported while the scaler is enabled")
        self._require_scale("step")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.STEPPED:
            raise ScalerStateError("GradScaler.step() has already been called on this optimizer since the last "
                                   "update()")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if not state.found_inf_per_device:
            raise ScalerStateError("GradScaler.step: no inf checks were recorded for this optimizer "
                                   "(none of its parameters has a gradient)")
        result = None
        if not self.found_inf(optimizer):
            result = optimizer.step(*args, **kwargs)
        state.stage = _Stage.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off the scale if any optimizer saw an inf/NaN gradient, grow it
        after ``growth_interval`` good iterations in a row; or set it to ``new_scale``."""
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise OptimizerConfigError("GradScaler.update: new_scale must be a float or a one-element "
                                               "tensor that does not require grad")
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(float(new_scale))
        else:
            found = [f.to(device=scale.device, non_blocking=True)
                     for state in self._per_optimizer.values() for f in state.found_inf_per_device.values()]
            if not found:
                raise ScalerStateError("GradScaler.update: no inf checks were recorded since the last update() "
                                       "(call step(optimizer) or unscale_(optimizer) first)")
            total = found[0]
            for f in found[1:]:
                total = total + f
            # one kernel, CPU or CUDA: backoff on inf, else count and grow every growth_interval
            torch._amp_update_scale_(scale, self._growth_tracker, total, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        self._per_optimizer = defaultdict(_OptimizerState)

    # -- queries and settings -----------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale (``init_scale`` before the first :meth:`scale`; 1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def set_scale(self, new_scale: float) -> None:
        """Set the scale from now on (before the first :meth:`scale`: the scale it starts with)."""
        _check_arguments(new_scale, self._growth_factor, self._backoff_factor, self._growth_interval)
        if self._scale is None:
            self._init_scale = float(new_scale)
        else:
            self._scale.fill_(float(new_scale))

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_arguments(1.0, new_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_arguments(1.0, self._growth_factor, new_factor, self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_arguments(1.0, self._growth_factor, self._backoff_factor, new_interval)
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict:
        """PyTorch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) as Python numbers; ``{}`` when disabled."""
        if not self._enabled:
            return {}
        tracker = self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise OptimizerConfigError("GradScaler.load_state_dict: the state dict is empty (saved from a "
                                       "disabled scaler?)")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise OptimizerConfigError(f"GradScaler.load_state_dict: missing entries {sorted(missing)}")
        _check_arguments(state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"],
                         state_dict["growth_interval"])
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)

    def _require_scale(self, method: str) -> torch.Tensor:
        if self._scale is None:
            raise ScalerStateError(f"GradScaler.{method}() before any scale(loss): scale the loss (or outputs) "
                                   "and call backward() first in each iteration")
        return self._scale


def _check_arguments(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    problems = []
    if not (isinstance(init_scale, (int, float)) and init_scale > 0):
        problems.append(f"init_scale must be a number > 0, got {init_scale!r}")
    if not (isinstance(growth_factor, (int, float)) and growth_factor > 1.0):
        problems.append(f"growth_factor must be > 1.0, got {growth_factor!r}")
    if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
        problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not (isinstance(growth_interval, int) and growth_interval >= 1):
        problems.append(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if problems:
        raise OptimizerConfigError("GradScaler: " + "; ".join(problems))


@torch.no_grad()
def _unscale_grads(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient by ``inv_scale`` in place, one multi-tensor kernel per (device,
    dtype); returns a found-inf flag (0 or 1, float32) per device."""
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                # duplicate indices would be summed later: check the summed values
                param.grad = param.grad.coalesce()
                values = param.grad._values()
            else:
                values = param.grad
            by_device[values.device][values.dtype].append(values)
    found: dict[torch.device, torch.Tensor] = {}
    for device, by_dtype in by_device.items():
        found[device] = torch.zeros((), dtype=torch.float32, device=device)
        device_inv_scale = inv_scale.to(device=device, non_blocking=True)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], device_inv_scale)
    return found
