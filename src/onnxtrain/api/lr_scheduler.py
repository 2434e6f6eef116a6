"""LinearLRScheduler: linear warmup to the initial learning rate, then linear decay to 0."""

from __future__ import annotations

import math
import numbers

from onnxtrain.api.optimizer import Optimizer


class LinearLRScheduler:
    """Sets the optimizer's learning rate from its step count ``t`` (updates done so far).

    ``lr(t) = initial_lr * t / warmup_step_count`` while ``t < warmup_step_count`` (a linear
    warmup from 0 that reaches ``initial_lr`` at ``t = warmup_step_count``), then
    ``initial_lr * (total_step_count - t) / (total_step_count - warmup_step_count)``, a linear
    decay that reaches 0 at ``t = total_step_count`` and stays there. The learning rate is set
    when the scheduler is created and again by every :meth:`step`, which belongs after
    ``optimizer.step()``; so update ``k`` (1-based) uses ``lr(k - 1)`` and, with a warmup, the
    first update uses a learning rate of 0 (like the Hugging Face linear schedule).

    Upstream's C++ scheduler (``orttraining/training_api/lr_scheduler.cc``) computes this
    factor, with the same ``max(1, ...)`` guards, and its Python docstring describes this
    shape; but onnxruntime-training 1.19.2's Python ``LinearLRScheduler`` hands the two counts
    to it swapped, so there ``warmup_step_count=3, total_step_count=8`` warms up over 8 updates
    and then drops to 0, and ``warmup_step_count=0`` warms up instead of decaying (measured
    side by side). This class follows the documentation: a migrated script's schedule changes
    where it relied on 1.19.2's behaviour (docs/artifacts.md, "Differences from upstream").
    Because ``t`` is the optimizer's count, a state resumed from a checkpoint saved with
    ``include_optimizer_state=True`` continues the schedule where it stopped.

    Args:
        optimizer: the :class:`Optimizer` whose learning rate is driven.
        warmup_step_count: number of warmup steps (0 for none).
        total_step_count: step count at which the learning rate reaches 0.
        initial_lr: the peak learning rate.

    Example:
        >>> from onnxtrain.api import LinearLRScheduler
        >>> class _Opt:  # stands in for an Optimizer: a step count and a learning-rate setter
        ...     def __init__(self): self.lr, self.step_count = None, 0
        ...     def set_learning_rate(self, lr): self.lr = lr
        >>> opt = _Opt()
        >>> scheduler = LinearLRScheduler(opt, warmup_step_count=2, total_step_count=6, initial_lr=0.1)
        >>> lrs = []
        >>> for _ in range(7):
        ...     lrs.append(round(opt.lr, 4)); opt.step_count += 1; scheduler.step()
        >>> lrs
        [0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0]
    """

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int,
                 initial_lr: float) -> None:
        counts = {"warmup_step_count": warmup_step_count, "total_step_count": total_step_count}
        for name, count in counts.items():  # a whole number (numpy's too), not 1.5 truncated to 1 (as JS refuses)
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) and not (
                    isinstance(count, numbers.Real) and float(count).is_integer()):
                raise ValueError(f"{name} must be a whole number of steps, got {count!r}")
        if warmup_step_count < 0 or total_step_count < 0:
            raise ValueError(f"step counts must be >= 0, got warmup_step_count={warmup_step_count}, "
                             f"total_step_count={total_step_count}")
        if not math.isfinite(float(initial_lr)) or float(initial_lr) < 0:
            raise ValueError(f"initial_lr must be a finite number >= 0, got {initial_lr!r}")
        self._optimizer = optimizer
        self.warmup_step_count = int(warmup_step_count)
        self.total_step_count = int(total_step_count)
        self.initial_lr = float(initial_lr)
        self.step()

    def factor(self, step: int) -> float:
        """The multiplier of ``initial_lr`` after ``step`` optimizer updates."""
        warmup, total = self.warmup_step_count, self.total_step_count
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    def step(self) -> None:
        """Set the optimizer's learning rate for its next update (call after ``optimizer.step()``)."""
        self._optimizer.set_learning_rate(self.initial_lr * self.factor(self._optimizer.step_count))
