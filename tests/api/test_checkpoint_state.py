"""CheckpointState: parameters, properties, save/load, nominal checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.checkpoint import read_checkpoint, write_checkpoint
from onnxtrain.errors import CheckpointError, InputMismatchError

from .conftest import batch, make_artifacts, ref_forward


def test_parameters_view(artifacts):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    params = state.parameters
    assert len(params) == 3 and "W" in params and "nope" not in params
    assert params.keys() == ["W", "b", "scale"]
    # as upstream's: iterating yields (name, Parameter) pairs
    assert [(name, p.name) for name, p in params] == [("W", "W"), ("b", "b"), ("scale", "scale")]
    assert [(name, p.name) for name, p in params.items()] == [("W", "W"), ("b", "b"), ("scale", "scale")]
    w = params["W"]
    assert w.name == "W" and w.requires_grad and not params["scale"].requires_grad
    assert w.grad is None
    Module(artifacts.training, state)  # as upstream: zero gradients from the Module on
    np.testing.assert_array_equal(w.grad, np.zeros((3, 2), np.float32))
    assert w.grad.dtype == np.float32 and params["scale"].grad is None
    np.testing.assert_array_equal(w.data, artifacts.params["W"])
    assert repr(w) == "Parameter(name=W, requires_grad=True)"
    with pytest.raises(KeyError):
        params["nope"]


def test_data_is_a_copy(artifacts):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    data = state.parameters["W"].data
    data[:] = 123
    np.testing.assert_array_equal(state.parameters["W"].data, artifacts.params["W"])


def test_assign_parameter_checks_shape_and_dtype(artifacts):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    new = np.full((3, 2), 0.5, np.float32)
    state.parameters["W"] = new
    np.testing.assert_array_equal(state.parameters["W"].data, new)
    state.parameters["b"].data = [1.0, 2.0]  # a list takes the parameter's dtype
    np.testing.assert_array_equal(state.parameters["b"].data, [1, 2])
    with pytest.raises(InputMismatchError, match=r"'W' has shape \[3, 2\]"):
        state.parameters["W"] = np.ones((2, 3), np.float32)
    with pytest.raises(InputMismatchError, match="'W' has dtype float32"):
        state.parameters["W"] = np.ones((3, 2), np.float64)
    with pytest.raises(KeyError):
        state.parameters["nope"] = new


def test_assignment_reaches_a_running_module(artifacts):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    module = Module(artifacts.training, state, artifacts.eval)
    x, t = batch()
    module(x, t)
    new = {**artifacts.params, "W": np.ones((3, 2), np.float32)}
    state.parameters["W"] = new["W"]
    loss, _ = module(x, t)
    np.testing.assert_allclose(loss, ref_forward(new, x, t)[0], rtol=1e-5)


def test_properties(artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    props = state.properties
    assert len(props) == 0 and "epoch" not in props
    props["epoch"] = 3
    props["best"] = 0.91
    props["note"] = "text"
    props["np"] = np.float32(0.5)
    assert props["epoch"] == 3 and "epoch" in props and len(props) == 4
    assert dict(props) == {"epoch": 3, "best": 0.91, "note": "text", "np": 0.5}
    del props["np"]
    assert props.keys() == ["epoch", "best", "note"]
    assert list(props) == [("epoch", 3), ("best", 0.91), ("note", "text")]  # upstream: pairs
    props["np"] = np.float32(0.5)
    for bad in (True, [1], None, {"a": 1}):
        with pytest.raises(TypeError):
            props["bad"] = bad
    with pytest.raises(KeyError):
        props["missing"]
    path = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(state, path)
    loaded = CheckpointState.load_checkpoint(path).properties
    assert dict(loaded.items()) == {"epoch": 3, "best": 0.91, "note": "text", "np": 0.5}
    assert type(loaded["epoch"]) is int and type(loaded["best"]) is float
    # dict-like to the end: popitem and clear (MutableMapping's iterate for names; pairs come here)
    assert loaded.popitem() == ("np", 0.5) and loaded.keys() == ["epoch", "best", "note"]
    loaded.clear()
    assert len(loaded) == 0
    with pytest.raises(KeyError, match="no properties"):
        loaded.popitem()


def test_save_load_round_trip(artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    state.parameters["b"] = np.array([7, 8], np.float32)
    path = tmp_path / "out" / "ckpt"
    CheckpointState.save_checkpoint(state, path)
    again = CheckpointState.load_checkpoint(path)
    for name, param in state.parameters.items():
        np.testing.assert_array_equal(again.parameters[name].data, param.data)
        assert again.parameters[name].requires_grad == param.requires_grad
    # Without an optimizer there is no optimizer state to include.
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    assert read_checkpoint(path).optimizer is None


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointState.load_checkpoint(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        CheckpointState.load_checkpoint(tmp_path / "junk")
    with pytest.raises(TypeError):
        CheckpointState("not a checkpoint")


def test_nominal_checkpoint(tmp_path):
    arts = make_artifacts(tmp_path, nominal=True)
    state = CheckpointState.load_checkpoint(arts.checkpoint)
    assert state.nominal
    assert state.parameters["W"].shape == (3, 2)
    with pytest.raises(CheckpointError, match="'W' has no value"):
        _ = state.parameters["W"].data
    module = Module(arts.training, state, arts.eval)
    x, t = batch()
    with pytest.raises(CheckpointError, match="nominal"):
        module(x, t)
    # an update of the placeholders would count a step (AdamW's bias correction then one off)
    optimizer = Optimizer(arts.optimizer, module)
    with pytest.raises(CheckpointError, match="nominal"):
        optimizer.step()
    assert optimizer.step_count == 0
    # Saving an untouched nominal state gives a nominal checkpoint again.
    CheckpointState.save_checkpoint(state, tmp_path / "again")
    assert read_checkpoint(tmp_path / "again").nominal
    # Supplying only the trainable parameters is not enough: scale is still missing.
    module.copy_buffer_to_parameters(np.concatenate([arts.params["W"].ravel(), arts.params["b"]]))
    with pytest.raises(CheckpointError, match="scale"):
        module(x, t)
    with pytest.raises(CheckpointError, match="scale"):
        CheckpointState.save_checkpoint(state, tmp_path / "partial")
    state.parameters["scale"] = arts.params["scale"]
    assert not state.nominal
    loss, _ = module(x, t)
    np.testing.assert_allclose(loss, ref_forward(arts.params, x, t)[0], rtol=1e-5)


def test_nominal_checkpoint_filled_from_a_full_buffer(tmp_path):
    full = make_artifacts(tmp_path / "full")
    nominal = tmp_path / "nominal"
    write_checkpoint(nominal, full.params, {"W", "b"}, nominal=True)
    source = Module(full.training, CheckpointState.load_checkpoint(full.checkpoint))
    state = CheckpointState.load_checkpoint(nominal)
    target = Module(full.training, state)
    target.copy_buffer_to_parameters(source.get_contiguous_parameters(), trainable_only=False)
    for name, value in full.params.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)
