"""LinearLRScheduler: warmup to initial_lr, linear decay to 0 at total_step_count."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer

from .conftest import batch, ref_grads


def _setup(arts, checkpoint=None):
    state = CheckpointState.load_checkpoint(checkpoint or arts.checkpoint)
    module = Module(arts.training, state)
    return state, module, Optimizer(arts.optimizer, module)


@pytest.mark.parametrize("warmup, total, expected", [
    (2, 6, [0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0]),
    (0, 4, [0.1, 0.075, 0.05, 0.025, 0.0, 0.0]),
    (4, 4, [0.0, 0.025, 0.05, 0.075, 0.0, 0.0]),
    (3, 7, [0.0, 0.1 / 3, 0.2 / 3, 0.1, 0.075, 0.05, 0.025, 0.0]),
])
def test_learning_rate_schedule(artifacts, warmup, total, expected):
    _, module, optimizer = _setup(artifacts)
    scheduler = LinearLRScheduler(optimizer, warmup, total, initial_lr=0.1)
    seen = []
    for _ in expected:
        seen.append(optimizer.get_learning_rate())
        module(*batch())
        optimizer.step()
        scheduler.step()
    np.testing.assert_allclose(seen, expected, atol=1e-12)


def test_scheduled_rate_is_the_one_the_update_uses(artifacts):
    state, module, optimizer = _setup(artifacts)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=2, total_step_count=10, initial_lr=0.2)
    p = {k: state.parameters[k].data for k in ("W", "b", "scale")}
    for k, lr in enumerate([0.0, 0.1, 0.2, 0.175]):
        x, t = batch(4, k)
        module.lazy_reset_grad()
        module(x, t)
        optimizer.step()
        scheduler.step()
        g = ref_grads(p, x, t)
        for name in ("W", "b"):
            p[name] = p[name] - lr * g[name]
            np.testing.assert_allclose(state.parameters[name].data, p[name], rtol=1e-5, atol=1e-6)


def test_schedule_resumes_from_checkpointed_step(artifacts, tmp_path):
    state, module, optimizer = _setup(artifacts)
    scheduler = LinearLRScheduler(optimizer, 2, 6, 0.1)
    for _ in range(3):
        module(*batch())
        optimizer.step()
        scheduler.step()
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)
    _, _, optimizer2 = _setup(artifacts, tmp_path / "ckpt")
    LinearLRScheduler(optimizer2, 2, 6, 0.1)
    assert optimizer2.get_learning_rate() == pytest.approx(0.075)


def test_invalid_counts(artifacts):
    _, _, optimizer = _setup(artifacts)
    with pytest.raises(ValueError):
        LinearLRScheduler(optimizer, -1, 10, 0.1)
    before = optimizer.get_learning_rate()
    for initial_lr in (-1e-3, float("nan")):  # refused at once, not at the first step past warmup
        with pytest.raises(ValueError, match="initial_lr must be a finite number >= 0"):
            LinearLRScheduler(optimizer, 2, 10, initial_lr)
    assert optimizer.get_learning_rate() == before
    for warmup, total in ((1.5, 10), (2, "10"), (True, 10)):  # refused, not truncated (as the JS runtime)
        with pytest.raises(ValueError, match="whole number of steps"):
            LinearLRScheduler(optimizer, warmup, total, 0.1)
    np = pytest.importorskip("numpy")
    LinearLRScheduler(optimizer, np.int64(2), 10.0, 0.1)  # whole numbers of other types are steps
