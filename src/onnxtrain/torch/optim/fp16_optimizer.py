"""Mixed-precision training of fp16/bf16 parameters: fp32 master weights and loss scaling.

:class:`FP16_Optimizer` wraps any PyTorch optimizer built over half-precision parameters. The
optimizer is re-pointed at fp32 copies of those parameters (the *masters*) and only ever sees
fp32 values; the model keeps its fp16/bf16 parameters for the forward and backward. A step:

1. copy the model's gradients into the masters' (fp32) gradients;
2. unscale them and check them for inf/NaN in one multi-tensor kernel per device and dtype
   (:class:`onnxtrain.torch.amp.GradScaler`, the one implementation of the scaling logic);
3. on overflow: skip. Parameters, masters and the optimizer's state (moments, step counts) are
   untouched, the dynamic scale backs off;
4. else: optionally clip the masters' gradient norm, step the wrapped optimizer on the masters,
   copy the masters back into the model's parameters (rounding to their dtype).

Upstream's ``onnxruntime.training.optim.FP16_Optimizer`` patches the FP16_Optimizer of DeepSpeed,
apex or Megatron-LM (it needs one of them installed); this one is self-contained and takes the
wrapped optimizer itself, with apex's / Megatron's argument names (``static_loss_scale``,
``dynamic_loss_scale``, ``dynamic_loss_args``) and DeepSpeed's ``clip_grad``.
"""

from __future__ import annotations

import math

import torch

from onnxtrain.torch.optim.errors import OptimizerConfigError

_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
_SCALER_ARGS = frozenset({"init_scale", "growth_factor", "backoff_factor", "growth_interval"})
# apex's and Megatron-LM's DynamicLossScaler names: the scale changes by scale_factor, up after
# scale_window good steps in a row, down on an overflow
_APEX_SCALER_ARGS = frozenset({"scale_factor", "scale_window"})


def _keeps_its_own_masters(optimizer) -> bool:
    """Whether ``optimizer`` is a mixed-precision optimizer of DeepSpeed, apex amp or Megatron-LM,
    which keep fp32 master weights and scale the loss themselves."""
    if hasattr(optimizer, "_amp_stash"):  # apex amp's optimizers
        return True
    module = type(optimizer).__module__ or ""
    return module.split(".")[0] in ("deepspeed", "megatron", "apex") and not isinstance(optimizer, torch.optim.Optimizer)


class FP16_Optimizer:  # noqa: N801 (upstream's name)
    """fp32 master weights and loss scaling around any optimizer of fp16/bf16 parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (``torch.optim.AdamW``, ``SGD``, :class:`FusedAdam`,
            :class:`LAMB`, ...) built over the model's parameters and not stepped yet. Its
            fp16/bf16 parameters are replaced, in its ``param_groups``, by fp32 masters; fp32
            parameters stay as they are (they are their own masters).
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is ``False`` (apex's default
            1.0). A step with an inf/NaN gradient is skipped either way.
        dynamic_loss_scale: adapt the scale (:class:`~onnxtrain.torch.amp.GradScaler`'s rules).
        dynamic_loss_args: keyword arguments of the dynamic scaler: ``init_scale`` (2**16),
            ``growth_factor`` (2), ``backoff_factor`` (0.5), ``growth_interval`` (2000), or apex's /
            Megatron's ``scale_factor`` (growth factor ``f`` and backoff ``1 / f``) and
            ``scale_window`` (the growth interval). Ignored with a static scale, as apex.
        clip_grad: if > 0, clip the global L2 norm of the (unscaled) master gradients to it.
        verbose: apex's argument; nothing is printed either way.

    Use ``backward(loss)`` instead of ``loss.backward()``; ``step()`` returns ``None`` and sets
    :attr:`overflow` to whether it skipped. ``optimizer.optimizer`` is the wrapped optimizer
    (for learning-rate schedulers).

    An optimizer that keeps fp32 masters and scales the loss itself (DeepSpeed's ZeRO and FP16
    optimizers, apex amp's, Megatron-LM's FP16_Optimizer: what upstream's ``FP16_Optimizer``
    took, as in its guide's ``optimizer = FP16_Optimizer(optimizer)`` after
    ``deepspeed.initialize``) is returned as it is: upstream swapped fused kernels into it, a
    change of speed, not of numbers.

    Example:
        >>> model = model.half()
        >>> optimizer = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), dynamic_loss_scale=True)
        >>> loss = model(x).float().square().mean()
        >>> optimizer.backward(loss)
        >>> optimizer.step()            # skipped, and the scale halved, if a gradient overflowed
        >>> optimizer.zero_grad()
    """

    def __new__(cls, optimizer, *args, **kwargs):
        if _keeps_its_own_masters(optimizer):
            return optimizer  # __init__ does not run for what __new__ returns of another type
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 clip_grad: float = 0.0, verbose: bool = False):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerConfigError(f"FP16_Optimizer: optimizer must be a torch.optim.Optimizer, "
                                       f"got {type(optimizer).__name__}")
        if any(optimizer.state.values()):
            raise OptimizerConfigError("FP16_Optimizer: the optimizer already has state; wrap it before its "
                                       "first step()")
        if not (isinstance(static_loss_scale, (int, float)) and static_loss_scale > 0):
            raise OptimizerConfigError(f"FP16_Optimizer: static_loss_scale must be a number > 0, "
                                       f"got {static_loss_scale!r}")
        if not (isinstance(clip_grad, (int, float)) and clip_grad >= 0):
            raise OptimizerConfigError(f"FP16_Optimizer: clip_grad must be a number >= 0, got {clip_grad!r}")
        unknown = set(dynamic_loss_args or {}) - _SCALER_ARGS - _APEX_SCALER_ARGS
        if unknown:
            raise OptimizerConfigError(f"FP16_Optimizer: dynamic_loss_args has unknown keys {sorted(unknown)}; "
                                       f"expected some of {sorted(_SCALER_ARGS | _APEX_SCALER_ARGS)}")
        self.optimizer = optimizer
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.static_loss_scale = float(static_loss_scale)
        self.clip_grad = float(clip_grad)
        self.overflow = False

        self._model_params: list[torch.Tensor] = []  # low-precision parameters of the model ...
        self._masters: list[torch.Tensor] = []  # ... and their fp32 masters, in the same order
        devices = set()
        for group in optimizer.param_groups:
            devices.update(p.device.type for p in group["params"])
            self._use_masters(group)
        if len(devices) > 1:
            raise OptimizerConfigError(f"FP16_Optimizer: parameters on several device types {sorted(devices)}; "
                                       "expected one")
        self._device_type = next(iter(devices), "cpu")
        if self._masters:
            _tell_parameters_replaced(optimizer)
        device = self._device_type
        from onnxtrain.torch.amp import GradScaler  # not at the top: amp imports this package's errors
        if self.dynamic_loss_scale:
            scaler_args = _scaler_args(dict(dynamic_loss_args or {}))
        else:
            scaler_args = {"init_scale": self.static_loss_scale}
        self.scaler = GradScaler(device, **scaler_args)

    def _use_masters(self, group: dict) -> None:
        """Put fp32 masters in ``group``'s places of its fp16/bf16 parameters (noted, in order)."""
        for i, p in enumerate(group["params"]):
            if p.dtype in _LOW_PRECISION:
                master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                group["params"][i] = master
                self._model_params.append(p)
                self._masters.append(master)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (layers unfrozen during fine-tuning): its fp16/bf16 parameters
        get fp32 masters, as the first groups' did, and the wrapped optimizer takes the group."""
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        other = sorted({p.device.type for p in group["params"]} - {self._device_type})
        if other:
            raise OptimizerConfigError(f"FP16_Optimizer.add_param_group: parameters on {other}, the others are on "
                                       f"{self._device_type!r}; expected one device type")
        held = {id(p) for p in self._model_params}
        if any(id(p) in held for p in group["params"]):  # (the wrapped optimizer sees its master only)
            raise OptimizerConfigError("FP16_Optimizer.add_param_group: some parameters are in an earlier group "
                                       "already")
        masters_before = len(self._masters)
        self._use_masters(group)
        try:
            self.optimizer.add_param_group(group)
        except BaseException:  # refused (a parameter in two groups, ...): no masters for it
            del self._model_params[masters_before:], self._masters[masters_before:]
            raise

    # -- training loop -------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups (holding the fp32 masters)."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """The current loss scale; assigning one sets it (apex's), for a static scale from then on."""
        return self.scaler.get_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise OptimizerConfigError(f"FP16_Optimizer: loss_scale must be a finite number > 0, got {value!r}")
        if not self.dynamic_loss_scale:
            self.static_loss_scale = float(value)
        self.scaler.set_scale(value)

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``. ``update_master_grads`` (apex's) changes nothing:
        the masters take the model's gradients in :meth:`step`, after any accumulation."""
        self.scaler.scale(loss).backward(retain_graph=retain_graph)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Copy gradients to the masters, unscale and check them, step or skip, update the scale."""
        if closure is not None:
            raise OptimizerConfigError("FP16_Optimizer.step: closures are not supported (call backward(loss) "
                                       "and step() instead)")
        pairs = [(p, m) for p, m in zip(self._model_params, self._masters) if p.grad is not None]
        for p, m in zip(self._model_params, self._masters):
            if p.grad is None:
                m.grad = None
        for p, m in pairs:
            if m.grad is None:
                m.grad = torch.empty_like(m)
        if pairs:
            torch._foreach_copy_([m.grad for _, m in pairs], [p.grad for p, _ in pairs])  # casts to fp32
        self.scaler.unscale_(self.optimizer)
        self.overflow = self.scaler.found_inf(self.optimizer)
        if not self.overflow and self.clip_grad > 0:
            self.clip_master_grads(self.clip_grad)
        try:
            self.scaler.step(self.optimizer)  # calls the wrapped optimizer only without overflow
        except BaseException:
            # the wrapped step failed: end the iteration (same scale) so that the next one can run
            self.scaler.update(self.scaler.get_scale())
            raise
        if not self.overflow and pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])  # rounds to fp16/bf16
        if self.dynamic_loss_scale:
            self.scaler.update()
        else:
            self.scaler.update(self.static_loss_scale)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the masters' (unscaled) gradients to a global norm of ``max_norm``; returns the norm
        before clipping (apex's method)."""
        grads = [m for g in self.optimizer.param_groups for m in g["params"] if m.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type, foreach=True)

    def zero_grad(self, set_to_none: bool = True, *, set_grads_to_None: bool | None = None) -> None:  # noqa: N803
        """Clear the gradients of the model's parameters and of the masters: set them to None
        (PyTorch's default) or, with ``set_to_none=False`` (apex's ``set_grads_to_None=False``,
        apex's default), fill them with zeros."""
        if set_grads_to_None is not None:
            set_to_none = set_grads_to_None
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                _clear(p, set_to_none)
        for p in self._model_params:
            _clear(p, set_to_none)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state, the fp32 masters and the scaler's state."""
        return {"optimizer": self.optimizer.state_dict(), "fp32_masters": [m.detach() for m in self._masters],
                "scaler": self.scaler.state_dict(), "dynamic_loss_scale": self.dynamic_loss_scale,
                "static_loss_scale": self.static_loss_scale, "clip_grad": self.clip_grad, "overflow": self.overflow}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output; the masters are copied in (the model's own
        parameters are not touched: load the model's ``state_dict`` for those)."""
        masters = state_dict["fp32_masters"]
        if len(masters) != len(self._masters) or any(a.shape != b.shape for a, b in zip(masters, self._masters)):
            raise OptimizerConfigError(
                f"FP16_Optimizer.load_state_dict: the checkpoint has {len(masters)} fp32 masters of shapes "
                f"{[tuple(m.shape) for m in masters]}, this optimizer {len(self._masters)} of shapes "
                f"{[tuple(m.shape) for m in self._masters]}")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for mine, saved in zip(self._masters, masters):
                mine.copy_(saved)
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.static_loss_scale = state_dict["static_loss_scale"]
        self.clip_grad = state_dict["clip_grad"]
        self.overflow = state_dict["overflow"]
        self.scaler.load_state_dict(state_dict["scaler"])


def _scaler_args(args: dict) -> dict:
    """``GradScaler``'s arguments from ``dynamic_loss_args`` (apex's names translated)."""
    if "scale_factor" in args:
        factor = args.pop("scale_factor")
        if not (isinstance(factor, (int, float)) and factor > 1):
            raise OptimizerConfigError(f"FP16_Optimizer: dynamic_loss_args scale_factor must be a number > 1, "
                                       f"got {factor!r}")
        args.setdefault("growth_factor", float(factor))
        args.setdefault("backoff_factor", 1.0 / factor)
    if "scale_window" in args:
        args.setdefault("growth_interval", args.pop("scale_window"))
    return args


def _clear(p: torch.Tensor, set_to_none: bool) -> None:
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        p.grad.detach_()
        p.grad.zero_()


def _tell_parameters_replaced(optimizer) -> None:
    """Let ``optimizer`` know that its groups now hold the fp32 masters. An optimizer that keeps
    parameter references of its own beside its groups (onnxtrain's ZeroOptimizer, PyTorch's
    ZeroRedundancyOptimizer) would otherwise go on updating the low-precision tensors and leave
    the masters as they were: ZeroOptimizer rebuilds itself, one that cannot is refused."""
    replaced = getattr(optimizer, "parameters_replaced", None)
    if callable(replaced):
        replaced()
        return
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise OptimizerConfigError("FP16_Optimizer cannot wrap torch's ZeroRedundancyOptimizer (it keeps its own "
                                   "parameter references); use onnxtrain.torch.optim.ZeroOptimizer")
