"""Optimizer: SGD and AdamW updates vs numpy, learning rate, optimizer state save/resume."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.checkpoint import read_checkpoint
from onnxtrain.errors import CheckpointError, ModelError

from .conftest import batch, make_artifacts, ref_adamw, ref_grads, ref_sgd


def _setup(arts, checkpoint=None):
    state = CheckpointState.load_checkpoint(checkpoint or arts.checkpoint)
    module = Module(arts.training, state, arts.eval)
    return state, module, Optimizer(arts.optimizer, module)


def _params(state):
    return {name: p.data for name, p in state.parameters.items()}


def test_sgd_steps_match_numpy(artifacts):
    state, module, optimizer = _setup(artifacts)
    assert optimizer.get_learning_rate() == pytest.approx(1e-3)  # upstream's default
    p = dict(artifacts.params)
    for i, lr in enumerate((0.1, 0.05, 0.2)):
        optimizer.set_learning_rate(lr)
        assert optimizer.get_learning_rate() == lr
        x, t = batch(4, i)
        module(x, t)
        optimizer.step()
        module.lazy_reset_grad()
        p.update(ref_sgd(p, ref_grads(p, x, t), lr))
        for name, value in _params(state).items():
            np.testing.assert_allclose(value, p[name], rtol=1e-5, atol=1e-6)
    assert optimizer.step_count == 3
    np.testing.assert_array_equal(state.parameters["scale"].data, artifacts.params["scale"])


def test_sgd_uses_accumulated_gradient(artifacts):
    state, module, optimizer = _setup(artifacts)
    optimizer.set_learning_rate(0.1)
    (x1, t1), (x2, t2) = batch(4, 1), batch(2, 2)
    module(x1, t1)
    module(x2, t2)
    optimizer.step()
    p = artifacts.params
    g1, g2 = ref_grads(p, x1, t1), ref_grads(p, x2, t2)
    expected = ref_sgd(p, {k: g1[k] + g2[k] for k in g1}, 0.1)
    for name in ("W", "b"):
        np.testing.assert_allclose(state.parameters[name].data, expected[name], rtol=1e-5, atol=1e-6)


def test_adamw_steps_match_numpy(adamw_artifacts):
    state, module, optimizer = _setup(adamw_artifacts)
    optimizer.set_learning_rate(0.01)
    p = dict(adamw_artifacts.params)
    m = {k: np.zeros_like(p[k]) for k in ("W", "b")}
    v = {k: np.zeros_like(p[k]) for k in ("W", "b")}
    for step in range(1, 5):
        x, t = batch(4, step)
        module.lazy_reset_grad()
        module(x, t)
        optimizer.step()
        new_p, m, v = ref_adamw(p, ref_grads(p, x, t), m, v, 0.01, step)
        p.update(new_p)
        for name in ("W", "b"):
            np.testing.assert_allclose(state.parameters[name].data, p[name], rtol=1e-5, atol=1e-6)
    opt = state._optimizer
    for name in ("W", "b"):
        np.testing.assert_allclose(opt.current(name, "momentum0").numpy(), m[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(opt.current(name, "momentum1").numpy(), v[name], rtol=1e-5, atol=1e-9)


def test_step_swaps_buffers_without_copies(adamw_artifacts):
    state, module, optimizer = _setup(adamw_artifacts)
    module(*batch())
    slot = state._slots["W"]
    before = [v.data_ptr() for v in slot.values]
    current = state._value(slot).data_ptr()
    optimizer.step()
    assert [v.data_ptr() for v in slot.values] == before  # the same two buffers...
    assert state._value(slot).data_ptr() != current  # ...with the other one now current
    assert state._slots["scale"].values[0].data_ptr() == state._value(state._slots["scale"]).data_ptr()


def test_failed_step_changes_nothing(adamw_artifacts, monkeypatch):
    state, module, optimizer = _setup(adamw_artifacts)
    module(*batch())
    optimizer.step()
    module(*batch(4, 5))
    params, step = _params(state), optimizer.step_count
    moments = {k: state._optimizer.current("W", k).numpy().copy() for k in ("momentum0", "momentum1")}
    real_run = optimizer._session.run_with_iobinding

    def run_then_fail(binding, *args):
        real_run(binding, *args)
        raise RuntimeError("simulated optimizer failure")

    monkeypatch.setattr(optimizer._session, "run_with_iobinding", run_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.step()
    assert optimizer.step_count == step
    for name, value in _params(state).items():
        np.testing.assert_array_equal(value, params[name])
    for k, value in moments.items():
        np.testing.assert_array_equal(state._optimizer.current("W", k).numpy(), value)


def _train(module, optimizer, steps, start=0):
    for i in range(start, start + steps):
        module.lazy_reset_grad()
        module(*batch(4, 100 + i))
        optimizer.step()


def test_save_and_resume_in_process_is_exact(adamw_artifacts, tmp_path):
    state, module, optimizer = _setup(adamw_artifacts)
    optimizer.set_learning_rate(0.02)
    _train(module, optimizer, 4)
    straight = _params(state)

    state, module, optimizer = _setup(adamw_artifacts)
    optimizer.set_learning_rate(0.02)
    _train(module, optimizer, 2)
    state.properties["epoch"] = 1
    path = tmp_path / "resume" / "checkpoint"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    data = read_checkpoint(path)
    assert data.optimizer.step == 2 and data.optimizer.learning_rate == pytest.approx(0.02)
    assert data.optimizer.states == ["momentum0", "momentum1"] and set(data.optimizer.values) == {"W", "b"}

    state2, module2, optimizer2 = _setup(adamw_artifacts, path)
    assert optimizer2.step_count == 2 and optimizer2.get_learning_rate() == pytest.approx(0.02)
    assert state2.properties["epoch"] == 1
    _train(module2, optimizer2, 2, start=2)
    for name, value in _params(state2).items():
        np.testing.assert_array_equal(value, straight[name])

    # Without the optimizer state, the moments restart from zero: a different trajectory.
    CheckpointState.save_checkpoint(state, path)
    assert read_checkpoint(path).optimizer is None
    state3, module3, optimizer3 = _setup(adamw_artifacts, path)
    optimizer3.set_learning_rate(0.02)
    _train(module3, optimizer3, 2, start=2)
    assert not np.array_equal(_params(state3)["W"], straight["W"])


RESUME_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    from onnxtrain.api import CheckpointState, Module, Optimizer
    art, ckpt, data, out = sys.argv[1:5]
    batches = np.load(data)
    state = CheckpointState.load_checkpoint(ckpt)
    module = Module(f"{art}/training_model.onnx", state, f"{art}/eval_model.onnx")
    optimizer = Optimizer(f"{art}/optimizer_model.onnx", module)
    for i in range(len(batches.files) // 2):
        module.lazy_reset_grad()
        module(batches[f"x{i}"], batches[f"t{i}"])
        optimizer.step()
    CheckpointState.save_checkpoint(state, out, include_optimizer_state=True)
""")


def test_resume_in_a_fresh_process_is_exact(adamw_artifacts, tmp_path):
    state, module, optimizer = _setup(adamw_artifacts)
    optimizer.set_learning_rate(0.05)
    _train(module, optimizer, 3)
    path = tmp_path / "mid"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    _train(module, optimizer, 3, start=3)

    batches = {}
    for i in range(3):
        batches[f"x{i}"], batches[f"t{i}"] = batch(4, 103 + i)
    np.savez(tmp_path / "batches.npz", **batches)
    out = tmp_path / "final"
    proc = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(adamw_artifacts.dir), str(path),
                           str(tmp_path / "batches.npz"), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    final = read_checkpoint(out)
    assert final.optimizer.step == 6
    for name, value in _params(state).items():
        np.testing.assert_array_equal(final.parameters[name].value, value)
    for name in ("W", "b"):
        for s in ("momentum0", "momentum1"):
            np.testing.assert_array_equal(final.optimizer.values[name][s], state._optimizer.current(name, s).numpy())


def test_optimizer_state_must_match(adamw_artifacts, tmp_path):
    state, module, optimizer = _setup(adamw_artifacts)
    _train(module, optimizer, 1)
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    sgd = make_artifacts(tmp_path / "sgd", "sgd")
    state2 = CheckpointState.load_checkpoint(path)
    module2 = Module(sgd.training, state2)
    with pytest.raises(CheckpointError, match=r"momentum0.*optimizer model uses \[\]"):
        Optimizer(sgd.optimizer, module2)


def test_a_plain_sgd_checkpoint_does_not_resume_adamw(adamw_artifacts, tmp_path):
    """SGD saves no state: AdamW's moments would start from zero at step 5, its bias correction
    then halving the first updates (accepted silently before). Saved after no step, it starts."""
    sgd = make_artifacts(tmp_path / "sgd", "sgd")
    state = CheckpointState.load_checkpoint(sgd.checkpoint)
    module = Module(sgd.training, state)
    sgd_optimizer = Optimizer(sgd.optimizer, module)
    fresh = tmp_path / "fresh"
    CheckpointState.save_checkpoint(state, fresh, include_optimizer_state=True)
    _train(module, sgd_optimizer, 5)
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    with pytest.raises(CheckpointError, match=r"optimizer model uses \['momentum0', 'momentum1'\].*from zero after 5"):
        Optimizer(adamw_artifacts.optimizer, Module(adamw_artifacts.training, CheckpointState.load_checkpoint(path)))
    Optimizer(adamw_artifacts.optimizer, Module(adamw_artifacts.training, CheckpointState.load_checkpoint(fresh)))


def test_optimizer_model_must_match_module(adamw_artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(adamw_artifacts.checkpoint)
    module = Module(adamw_artifacts.training, state)
    with pytest.raises(ModelError, match="first inputs must be"):
        Optimizer(adamw_artifacts.eval, module)
    with pytest.raises(ModelError, match="does not exist"):
        Optimizer(tmp_path / "missing.onnx", module)


@pytest.mark.parametrize("learning_rate", [-0.1, float("nan"), float("inf")])
def test_a_learning_rate_that_is_negative_or_not_finite_is_refused(adamw_artifacts, learning_rate):
    _, _, optimizer = _setup(adamw_artifacts)
    before = optimizer.get_learning_rate()
    with pytest.raises(ValueError, match="learning rate must be a finite number >= 0"):
        optimizer.set_learning_rate(learning_rate)
    assert optimizer.get_learning_rate() == before
    optimizer.set_learning_rate(0)  # zero is a learning rate (a frozen phase)
    assert optimizer.get_learning_rate() == 0.0
