"""Optimizers for PyTorch parameters that update every parameter in a few multi-tensor kernels.

:class:`FusedAdam` follows upstream's ``onnxruntime.training.optim.FusedAdam`` (same arguments,
same defaults, same three update modes) so that migrating is a change of import. Where
PyTorch ships a fused Adam kernel for the parameters' device and dtype (``torch._fused_adam_``
/ ``torch._fused_adamw_``: CPU and CUDA), every mode runs through it: one pass over each
parameter, its gradient and its two moments. Elsewhere the update runs as a handful of
``torch._foreach_*`` multi-tensor ops.

Every mode is an update of the form ``p <- A * p - B * m / (sqrt(v) + E)`` after the usual
moment updates, with scalars ``A``, ``B``, ``E`` that depend on the mode and the step, and, in
transformers' mode, a decay of the updated parameter ``p <- p - D * p`` after it; the fused
kernels compute a fixed form of the first part (PyTorch's bias-corrected AdamW), so the
optimizer hands them learning rate, epsilon and weight decay values rescaled to give the
mode's ``A``, ``B`` and ``E`` exactly.

Transformers' decay is applied as ``p - D * p`` (as transformers does), not folded into
``A = 1 - D``: in float32 ``1 - D`` is only known to ~6e-8 absolute, which for a typical
``D = lr * wd = 1e-6`` is a few percent of the decay itself, a bias that adds up over steps
(``torch.optim.AdamW`` multiplies by ``1 - lr * wd``; ``ADAMW_TORCH`` does the same, to match it).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from onnxtrain.torch.optim._common import (GradNoneOnZero, adam_hyperparameter_problems, adam_moments,
                                           RefusesUnimplementedOptions, by_device_and_dtype, check_gradients,
                                           evaluate_closure, refuse_unimplemented_options)
from onnxtrain.torch.optim.errors import OptimizerConfigError

_FUSED_DEVICES = frozenset({"cpu", "cuda"})
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class AdamWMode(enum.IntEnum):
    """How :class:`FusedAdam` applies weight decay (upstream's values and names)."""

    ADAM_L2_REGULARIZATION = 0
    """``torch.optim.Adam`` with ``weight_decay``: the decay is added to the gradient."""
    ADAMW_TRANSFORMERS = 1
    """Hugging Face transformers' ``AdamW``: bias correction folded into the step size, epsilon
    added to ``sqrt(v)``, decoupled decay applied to the updated parameter."""
    ADAMW_TORCH = 2
    """``torch.optim.AdamW``: decoupled decay first, then the bias-corrected Adam update."""


@dataclass(frozen=True)
class _Update:
    """``p <- A * p - B * m / (sqrt(v) + E)``, then ``p <- p - D * p``; ``l2`` is added to the
    gradient as ``l2 * p``."""

    A: float
    B: float
    E: float
    l2: float
    D: float = 0.0


def _update_for(mode: AdamWMode, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                step: int, bias_correction: bool) -> _Update:
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    if mode == AdamWMode.ADAMW_TRANSFORMERS:
        return _Update(A=1.0, B=lr * math.sqrt(bc2) / bc1, E=eps, l2=0.0, D=lr * weight_decay)
    # torch's Adam / AdamW: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
    B, E = lr * math.sqrt(bc2) / bc1, eps * math.sqrt(bc2)
    if mode == AdamWMode.ADAMW_TORCH:
        return _Update(A=1.0 - lr * weight_decay, B=B, E=E, l2=0.0)
    return _Update(A=1.0, B=B, E=E, l2=weight_decay)


class FusedAdam(GradNoneOnZero, RefusesUnimplementedOptions, torch.optim.Optimizer):
    """Adam / AdamW over all parameters at once (upstream's ``FusedAdam``, same defaults).

    Args:
        params: parameters or parameter groups (dicts), as for any ``torch.optim`` optimizer.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta ** step``.
        betas: decay rates of the first and second moments.
        eps: added to the denominator (where depends on ``adam_w_mode``).
        adam_w_mode: an :class:`AdamWMode`; the default is transformers' AdamW, as upstream's.
        weight_decay: L2 coefficient (``ADAM_L2_REGULARIZATION``) or decoupled decay rate.
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` (else zero-fills them).
        fused: ``None`` uses PyTorch's fused kernel where it exists for the parameters' device
            and dtype (CPU, CUDA) and multi-tensor ``foreach`` ops elsewhere; ``False`` always
            uses the ``foreach`` ops; ``True`` requires the fused kernel.

    Each parameter's state holds ``exp_avg``, ``exp_avg_sq`` and ``step`` (an int), the number of
    updates it has had, which its bias correction uses (as ``torch.optim.AdamW`` and transformers' AdamW:
    a parameter without a gradient at some steps, an unused branch or expert, is corrected for
    its own count). ``param_groups[i]["step"]`` counts the group's steps, as upstream's (whose
    bias correction used it for every parameter).

    Example:
        >>> optimizer = FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01)
        >>> loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 adam_w_mode: AdamWMode = AdamWMode.ADAMW_TRANSFORMERS, weight_decay: float = 0.0,
                 set_grad_none: bool = True, *, fused: bool | None = None):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        try:
            mode = AdamWMode(adam_w_mode)
        except ValueError as exc:
            raise OptimizerConfigError(
                f"FusedAdam adam_w_mode must be one of {[m.name for m in AdamWMode]}, got {adam_w_mode!r}") from exc
        if fused and not hasattr(torch, "_fused_adamw_"):
            raise OptimizerConfigError("FusedAdam(fused=True): this PyTorch has no fused Adam kernel")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = mode
        self.set_grad_none = set_grad_none
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient; returns ``closure()``'s loss if given."""
        loss = evaluate_closure(closure)
        self._check_groups()  # before any update: a refused step leaves every parameter as it was
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for step, at_step in self._count_steps(with_grad, group["step"]).items():
                update = _update_for(self.adam_w_mode, float(group["lr"]), beta1, beta2, group["eps"],
                                     group["weight_decay"], step, group["bias_correction"])
                self._apply(update, at_step, beta1, beta2)
        return loss

    def _count_steps(self, params: list[torch.Tensor], group_step: int) -> dict[int, list[torch.Tensor]]:
        """Count this step in each parameter's state (``state["step"]``: the updates it has had,
        for its bias correction) and group the parameters by that count. A parameter whose
        moments come from a state dict without a count (upstream's, which counts per group only)
        continues from the group's count."""
        by_step: dict[int, list[torch.Tensor]] = {}
        for p in params:
            state = self.state[p]
            step = state.get("step")
            # an int (a tensor, as torch.optim.AdamW keeps it, costs ~5 µs per parameter and step)
            step = (group_step - 1 if "exp_avg" in state else 0) if step is None else int(step)
            state["step"] = step = step + 1
            by_step.setdefault(step, []).append(p)
        return by_step

    def _apply(self, update: _Update, with_grad: list[torch.Tensor], beta1: float, beta2: float) -> None:
        for (device, dtype), params in by_device_and_dtype(with_grad).items():
            moments = [adam_moments(self.state[p], p) for p in params]
            tensors = (params, [p.grad for p in params], [m for m, _ in moments], [v for _, v in moments])
            # the fused kernel scales the decay by its learning rate: with a zero step size
            # (B = 0, lr = 0) it cannot shrink p (A != 1 only in ADAMW_TORCH mode)
            expressible = update.B != 0 or update.A == 1.0
            if not (self._use_fused(device, dtype) and expressible):
                _foreach_update(*tensors, update, beta1, beta2)
                continue
            # PyTorch's CPU kernel walks the four tensors as if they had one memory layout: a
            # gradient with other strides (a hand-set .grad of a transposed or channels_last
            # parameter) gets the foreach ops, which index each tensor properly
            unlike = {i for i, (p, *ts) in enumerate(zip(*tensors))
                      if not p.stride() == ts[0].stride() == ts[1].stride() == ts[2].stride()
                      and not all(_same_layout(p, t) for t in ts)}
            if not unlike:
                _fused_update(*tensors, update, beta1, beta2, device)
                continue
            alike = tuple([t for i, t in enumerate(ts) if i not in unlike] for ts in tensors)
            if alike[0]:
                _fused_update(*alike, update, beta1, beta2, device)
            _foreach_update(*(tuple([ts[i] for i in sorted(unlike)] for ts in tensors)), update, beta1, beta2)

    def _check_groups(self) -> None:
        for index, group in enumerate(self.param_groups):
            refuse_unimplemented_options("FusedAdam", group, f"parameter group {index}")
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        check_gradients("FusedAdam", self.param_groups, "; use torch.optim.SparseAdam")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer, of upstream's, or of ``torch.optim.Adam`` /
        ``AdamW`` (whose groups lack ``bias_correction``: this optimizer's defaults fill what a
        group lacks). A group asking for what this optimizer does not do (``amsgrad``,
        ``maximize``) is refused before anything is loaded."""
        for index, group in enumerate(state_dict.get("param_groups", [])):
            refuse_unimplemented_options("FusedAdam", group, f"the state dict's parameter group {index}")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _use_fused(self, device: torch.device, dtype: torch.dtype) -> bool:
        available = hasattr(torch, "_fused_adamw_") and device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES
        if self.fused and not available:
            raise OptimizerConfigError(f"FusedAdam(fused=True): no fused kernel for {dtype} parameters on {device}")
        return available if self.fused is None else bool(self.fused)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same shape) lay their elements out alike (strides of size-1 dims
    do not matter)."""
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    problems = adam_hyperparameter_problems(lr, betas, eps, weight_decay)
    if problems:
        raise OptimizerConfigError("FusedAdam: " + "; ".join(problems))


def _fused_update(params, grads, exp_avgs, exp_avg_sqs, update: _Update, beta1, beta2, device) -> None:
    """PyTorch's fused kernel computes ``(1 - lr*wd) p - lr/c1 * m / (sqrt(v)/sqrt(c2) + eps)``
    with ``c = 1 - beta**step``; choose its lr, eps and wd (and step 1's corrections) to give
    ``A``, ``B`` and ``E``."""
    c1, c2 = 1.0 - beta1, 1.0 - beta2  # the kernel's corrections at step 1
    root_c2 = math.sqrt(c2)
    lr = update.B * c1 / root_c2
    eps = update.E / root_c2
    step = torch.ones((), dtype=torch.float32, device=device)
    steps = [step] * len(params)  # read, not written, by the kernel
    if update.l2:
        torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1,
                           beta2=beta2, weight_decay=update.l2, eps=eps, maximize=False)
    else:
        decay = (1.0 - update.A) / lr if lr else 0.0
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=decay, eps=eps, maximize=False)
    if update.D:
        torch._foreach_add_(params, params, alpha=-update.D)


def _foreach_update(params, grads, exp_avgs, exp_avg_sqs, update: _Update, beta1, beta2) -> None:
    if update.l2:
        grads = torch._foreach_add(grads, params, alpha=update.l2)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, update.E)
    if update.A != 1.0:
        torch._foreach_mul_(params, update.A)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, -update.B)
    if update.D:
        torch._foreach_add_(params, params, alpha=-update.D)
