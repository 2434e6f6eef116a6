"""LAMB: Adam moments with a per-tensor trust ratio, over all parameters in multi-tensor ops.

The update follows the LAMB paper (You et al., "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes") as NVIDIA's ``apex.optimizers.FusedLAMB`` implements it, with
the trust-ratio bounds of upstream's ``LambOptimizer`` (``ratio_min`` / ``ratio_max``):

1. ``g <- g / (||G|| / max_grad_norm)`` where ``||G||``, the L2 norm of all gradients of all
   groups together, exceeds ``max_grad_norm`` (skipped when ``max_grad_norm`` is ``None``; a
   NaN norm clips nothing, as in apex, so a NaN gradient spoils its own tensor only);
2. L2 mode only (``adam_w_mode=False``): ``g <- g + weight_decay * p``;
3. ``m <- beta1 m + beta3 g`` (``beta3 = 1 - beta1``, or 1 with ``grad_averaging=False``),
   ``v <- beta2 v + (1 - beta2) g^2``;
4. ``u <- (m / c1) / (sqrt(v / c2) + eps)`` (``c = 1 - beta**step``, 1 without bias correction),
   plus ``weight_decay * p`` in decoupled mode (``adam_w_mode=True``, the default);
5. ``r <- clamp(||p|| / ||u||, ratio_min, ratio_max)`` per tensor, ``r = 1`` where either norm
   is 0 (and, with ``use_nvlamb=False``, for groups whose ``weight_decay`` is 0);
   norms accumulate in float32, float64 for float64 tensors;
6. ``p <- p - lr * r * u``.

Every step is a handful of ``torch._foreach_*`` kernels per (group, device, dtype), whatever
the number of tensors: norms by ``torch._foreach_norm``, the trust ratios as one vector.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from onnxtrain.torch.optim._common import (GradNoneOnZero, adam_hyperparameter_problems, adam_moments,
                                           RefusesUnimplementedOptions, by_device_and_dtype, check_gradients,
                                           evaluate_closure, refuse_unimplemented_options)
from onnxtrain.torch.optim.errors import OptimizerConfigError


class LAMB(GradNoneOnZero, RefusesUnimplementedOptions, torch.optim.Optimizer):
    """LAMB over all parameters at once (apex ``FusedLAMB``'s arguments, upstream's trust-ratio bounds).

    Args:
        params: parameters or parameter groups (dicts), as for any ``torch.optim`` optimizer.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta ** step``.
        betas: decay rates of the first and second moments (upstream's ``alpha``, ``beta``).
        eps: added to ``sqrt(v)`` (upstream's ``epsilon``; default 1e-6 as upstream and apex).
        weight_decay: decoupled decay added to the update (upstream's ``lambda_coef``; default 0
            as upstream's ``LambConfig``; apex's default is 0.01).
        amsgrad: apex's argument, in apex's place; only ``False`` (apex refuses ``True`` too).
        adam_w_mode: ``True``: decoupled decay (LAMB); ``False``: decay added to the gradient (L2).
        grad_averaging: scale the gradient by ``1 - beta1`` in the first moment (else by 1).
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` (else zero-fills them).
        max_grad_norm: clip the global gradient norm to this before the update (apex's default
            1.0); ``None`` disables clipping.
        use_nvlamb: apply the trust ratio to groups with ``weight_decay == 0`` too. ``True`` (the
            paper and upstream's ``LambOptimizer``) is the default; apex's default is ``False``,
            which makes such groups plain Adam.
        ratio_min, ratio_max: bounds of the trust ratio (upstream's names and defaults: unbounded).

    The step count is kept per parameter group (``param_groups[i]["step"]``) and, as in apex,
    counts every step that updates anything, in every group (a group whose parameters had no
    gradient at some steps is bias-corrected for them too); each parameter's state holds
    ``exp_avg`` and ``exp_avg_sq``. Gradients are not modified.

    Example:
        >>> optimizer = LAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float | None = 1.0, use_nvlamb: bool = True,
                 ratio_min: float = float("-inf"), ratio_max: float = float("inf")):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, ratio_min=ratio_min, ratio_max=ratio_max)
        _check_group(defaults)
        if amsgrad:
            raise OptimizerConfigError("LAMB does not implement the AMSGrad variant (amsgrad=True), as apex's FusedLAMB")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise OptimizerConfigError(f"LAMB: max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none
        self.max_grad_norm = max_grad_norm
        self.use_nvlamb = bool(use_nvlamb)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient; returns ``closure()``'s loss if given."""
        loss = evaluate_closure(closure)
        self._check_groups()  # before any update: a refused step leaves every parameter as it was
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group in self.param_groups:  # every group counts every step, with gradients or not (apex)
            group["step"] = group.get("step", 0) + 1
        if not grads:
            return loss
        clip = self._clip_divisors(grads)
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            for (device, _), params in by_device_and_dtype(with_grad).items():
                for p in params:
                    adam_moments(self.state[p], p)
                self._update(group, params, clip[device] if clip else None)
        return loss

    def _clip_divisors(self, grads: list[torch.Tensor]) -> dict[torch.device, torch.Tensor] | None:
        """``||G|| / max_grad_norm`` where ``||G|| > max_grad_norm``, else 1 (a NaN norm too, as
        apex), on each device; norms accumulate in fp32 (an fp16 norm overflows at 65504), fp64
        for fp64 gradients."""
        if self.max_grad_norm is None:
            return None
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        first = grads[0].device
        wide = _accumulation_dtype(grads)
        squares = [torch.stack(_norms(gs)).square().sum().to(first, wide) for gs in by_device.values()]
        total = torch.stack(squares).sum().sqrt()
        divisor = torch.where(total > self.max_grad_norm, total / self.max_grad_norm, torch.ones_like(total))
        return {device: divisor.to(device) for device in by_device}

    def _update(self, group: dict, params: list[torch.Tensor], clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        step, wd = group["step"], group["weight_decay"]
        c1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
        c2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]

        grads = [p.grad for p in params]
        if clip is not None:
            # a 0-dim gradient divided by the 0-dim divisor takes the divisor's type (fp32, or fp64
            # beside fp64 gradients): back to its own, as the moments it updates
            grads = [q if q.dtype == g.dtype else q.to(g.dtype) for q, g in zip(torch._foreach_div(grads, clip), grads)]
        else:
            grads = list(grads)
        if wd and not self.adam_w_mode:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if beta3 == 1.0 - beta1:
            torch._foreach_lerp_(exp_avgs, grads, beta3)  # beta1 m + (1 - beta1) g in one pass
        else:
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads, alpha=beta3)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)

        # u = (m / c1) / (sqrt(v / c2) + eps) = (sqrt(c2) / c1) * m / (sqrt(v) + eps * sqrt(c2))
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denominators, group["eps"] * math.sqrt(c2))
        updates = torch._foreach_div(exp_avgs, denominators)
        torch._foreach_mul_(updates, math.sqrt(c2) / c1)
        if wd and self.adam_w_mode:
            torch._foreach_add_(updates, params, alpha=wd)

        if self.use_nvlamb or wd != 0:
            p_norms, u_norms = torch.stack(_norms(params)), torch.stack(_norms(updates))
            ratios = (p_norms / u_norms).clamp(group["ratio_min"], group["ratio_max"])
            # as apex: 1 where a norm is 0; a NaN norm gives a NaN ratio (the tensor is spoiled)
            ratios = torch.where((p_norms != 0) & (u_norms != 0), ratios, torch.ones_like(ratios))
            torch._foreach_mul_(updates, list(ratios.unbind()))
        torch._foreach_add_(params, updates, alpha=-float(group["lr"]))

    def _check_groups(self) -> None:
        for group in self.param_groups:
            _check_group(group)
        check_gradients("LAMB", self.param_groups)


def _accumulation_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """What norms of ``tensors`` accumulate in: float32 (an fp16 norm overflows at 65504), float64
    if any tensor is float64 (a float32 norm of it would be a narrowing torch refuses)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _norms(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """L2 norm of each tensor, accumulated in :func:`_accumulation_dtype`."""
    return torch._foreach_norm(tensors, 2, dtype=_accumulation_dtype(tensors))


def _check_group(group: dict) -> None:
    refuse_unimplemented_options("LAMB", group, "a parameter group")
    problems = adam_hyperparameter_problems(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    if not group["ratio_min"] <= group["ratio_max"]:
        problems.append(f"ratio_min must be <= ratio_max, got ratio_min={group['ratio_min']!r}, "
                        f"ratio_max={group['ratio_max']!r}")
    if problems:
        raise OptimizerConfigError("LAMB: " + "; ".join(problems))
