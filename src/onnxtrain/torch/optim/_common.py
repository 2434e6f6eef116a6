"""Pieces every optimizer of this package shares: the closure call, the gradient checks that
run before any update, grouping by device and dtype, Adam's moment buffers."""

from __future__ import annotations

import numbers
from collections import defaultdict

import torch

from onnxtrain.torch.optim.errors import OptimizerConfigError


def evaluate_closure(closure):
    """``closure()`` with gradients enabled (``step`` runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_gradients(optimizer: str, param_groups: list[dict], sparse_hint: str = "") -> None:
    """Refuse sparse gradients and non-floating-point parameters, naming ``optimizer``."""
    for group in param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise OptimizerConfigError(f"{optimizer} does not support sparse gradients "
                                           f"(parameter of shape {tuple(p.shape)}){sparse_hint}")
            if not p.is_floating_point():
                raise OptimizerConfigError(f"{optimizer} updates floating-point parameters, got {p.dtype}")


def adam_hyperparameter_problems(lr, betas, eps, weight_decay) -> list[str]:
    """What is wrong with Adam-family hyperparameters (learning rate, betas, epsilon, weight
    decay), one message each; empty when they are valid."""
    problems = []
    # any real number (a NumPy scalar from a scheduler's lambda too) or a one-element tensor
    number = isinstance(lr, numbers.Real) or (isinstance(lr, torch.Tensor) and lr.numel() == 1)
    if not (number and float(lr) >= 0):
        problems.append(f"lr must be a number >= 0, got {lr!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        problems.append(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps >= 0:
        problems.append(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0:
        problems.append(f"weight_decay must be >= 0, got {weight_decay!r}")
    return problems


# torch.optim.Adam options that this package's Adam-family optimizers do not implement
UNIMPLEMENTED_ADAM_OPTIONS = ("amsgrad", "maximize")


def refuse_unimplemented_options(optimizer: str, group: dict, what: str) -> None:
    """``OptimizerConfigError`` if parameter group ``group`` (``what``: which one) asks for an
    option in :data:`UNIMPLEMENTED_ADAM_OPTIONS`: it would be ignored, not honoured."""
    asked = [key for key in UNIMPLEMENTED_ADAM_OPTIONS if group.get(key)]
    if asked:
        raise OptimizerConfigError(f"{optimizer}: {what} asks for {asked}, which {optimizer} does not implement")


class RefusesUnimplementedOptions:
    """``add_param_group`` (the constructor's groups too) refuses a group asking for an option in
    :data:`UNIMPLEMENTED_ADAM_OPTIONS`, naming the optimizer class: it would not be honoured."""

    def add_param_group(self, param_group: dict) -> None:
        refuse_unimplemented_options(type(self).__name__, param_group, f"parameter group {len(self.param_groups)}")
        super().add_param_group(param_group)


def by_device_and_dtype(params) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``params`` grouped for multi-tensor kernels (one device and dtype per call)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[(p.device, p.dtype)].append(p)
    return groups


def adam_moments(state: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg`` and ``exp_avg_sq`` of ``p`` in its optimizer ``state``, zero-initialized."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state["exp_avg"], state["exp_avg_sq"]


class GradNoneOnZero:
    """``zero_grad()`` follows the optimizer's ``set_grad_none`` (upstream's argument): gradients
    become ``None`` whatever the call asks, or, with ``set_grad_none=False``, zeros unless the
    call passes ``set_to_none=True``."""

    set_grad_none: bool

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none or bool(set_to_none))
