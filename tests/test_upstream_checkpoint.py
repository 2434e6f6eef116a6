"""Checkpoints written by onnxruntime-training 1.19.2 (flatbuffers, ``ODTC``): read, resumed, converted.

The files in tests/data/upstream were written by upstream itself
(tests/data/upstream/make_checkpoints.py, run in bench/.venv-upstream); ``expected.json`` holds
what upstream computed when it resumed from the same checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.checkpoint import read_checkpoint
from onnxtrain.errors import CheckpointError, ModelError
from onnxtrain.upstream_checkpoint import read_upstream_checkpoint
from tests.upstream_odtc import external_fixture, odtc_bytes, repeated_momentum_bytes

DATA = Path(__file__).parent / "data" / "upstream"
EXPECTED = json.loads((DATA / "expected.json").read_text())
TRAINABLE = ["fc1.weight", "fc1.bias", "fc2.weight"]


def test_parameters_optimizer_state_and_properties_are_read():
    data = read_checkpoint(DATA / "checkpoint_trained")
    assert sorted(data.parameters) == sorted(EXPECTED["saved_parameters"])
    for name, value in EXPECTED["saved_parameters"].items():
        record = data.parameters[name]
        assert record.requires_grad == (name in TRAINABLE), name
        assert record.value.dtype == np.float32 and record.value.flags.writeable
        np.testing.assert_array_equal(record.value, np.array(value, np.float32))
    # upstream writes the trainable parameters first, then the frozen ones
    assert [n for n, r in data.parameters.items() if not r.requires_grad] == ["fc2.bias"]
    assert list(data.parameters)[-1] == "fc2.bias"
    opt = data.optimizer
    assert opt.step == 3 and opt.learning_rate == 0.001  # upstream saves its initial learning rate
    assert opt.states == ["momentum0", "momentum1"]
    assert sorted(opt.values) == sorted(TRAINABLE)
    assert all(np.any(v != 0) for states in opt.values.values() for v in states.values())
    # a float property is float32 on disk: 0.1 reads back as 0.1
    assert data.properties == {"epoch": 7, "best_loss": 0.1, "device": "device-a"}
    assert not data.nominal


def test_training_resumes_from_an_upstream_checkpoint_as_upstream_does(tmp_path):
    """onnxtrain's artifacts of the same model, the state upstream saved: the next steps' losses
    and parameters are upstream's (its AdamW, its step count and moments carried over)."""
    artifacts.generate_artifacts(str(DATA / "model.onnx"), requires_grad=TRAINABLE, frozen_params=["fc2.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(DATA / "checkpoint_trained")
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    assert optimizer.get_learning_rate() == 0.001
    optimizer.set_learning_rate(EXPECTED["learning_rate"])
    x = np.array(EXPECTED["input"], np.float32)
    y = np.array(EXPECTED["labels"], np.int64)
    module.train()
    losses = []
    for _ in range(2):
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    np.testing.assert_allclose(losses, EXPECTED["resumed_losses"], rtol=1e-5)
    for name, value in EXPECTED["resumed_parameters"].items():
        np.testing.assert_allclose(state.parameters[name].data, np.array(value, np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert state.properties["epoch"] == 7


def test_saving_converts_to_onnxtrains_format(tmp_path):
    state = CheckpointState.load_checkpoint(DATA / "checkpoint_trained")
    CheckpointState.save_checkpoint(state, tmp_path / "converted", include_optimizer_state=True)
    assert (tmp_path / "converted").read_bytes()[4:8] != b"ODTC"
    original, converted = read_checkpoint(DATA / "checkpoint_trained"), read_checkpoint(tmp_path / "converted")
    assert converted.properties == original.properties
    assert converted.optimizer.step == 3 and converted.optimizer.learning_rate == 0.001
    for name, record in original.parameters.items():
        np.testing.assert_array_equal(converted.parameters[name].value, record.value)
        assert converted.parameters[name].requires_grad == record.requires_grad
        for state_name, value in original.optimizer.values.get(name, {}).items():
            np.testing.assert_array_equal(converted.optimizer.values[name][state_name], value)


def test_a_nominal_upstream_checkpoint_is_refused_with_the_way_out():
    with pytest.raises(CheckpointError, match="nominal checkpoint.*without shapes.*generate_artifacts"):
        CheckpointState.load_checkpoint(DATA / "nominal_checkpoint")


def test_every_truncation_is_a_checkpoint_error(tmp_path):
    data = (DATA / "checkpoint_trained").read_bytes()
    assert data[-4:] == bytes(4)  # the last string's terminator and padding: nothing reads them
    path = tmp_path / "checkpoint"
    for length in range(len(data) - 4):
        path.write_bytes(data[:length])
        with pytest.raises(CheckpointError):
            read_checkpoint(path)


def test_damaged_bytes_give_a_checkpoint_error_or_a_consistent_state(tmp_path):
    """Flipped bytes anywhere: either a CheckpointError or a record whose arrays match their
    own shapes and types (a flipped value byte is undetectable), never another exception."""
    data = (DATA / "checkpoint_trained").read_bytes()
    path = tmp_path / "checkpoint"
    rng = np.random.default_rng(0)
    errors = 0
    for _ in range(400):
        damaged = bytearray(data)
        for pos in rng.integers(8, len(data), size=int(rng.integers(1, 4))):
            damaged[pos] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(damaged))
        try:
            record = read_checkpoint(path)
        except CheckpointError:
            errors += 1
            continue
        for param in record.parameters.values():
            assert param.value.shape == param.shape and param.value.dtype == param.dtype
    assert errors > 0


def test_a_state_listed_twice_is_refused_before_its_bytes_are_read_again(tmp_path):
    path = tmp_path / "checkpoint"
    path.write_bytes(repeated_momentum_bytes(np.ones(4, np.float32), references=1))
    assert read_checkpoint(path).optimizer.states == ["momentum0"]
    # 20,000 references to one 4 MB tensor: refused at the second, not read 20,000 times
    path.write_bytes(repeated_momentum_bytes(np.ones(2**20, np.float32), references=20_000))
    with pytest.raises(CheckpointError, match="holds optimizer state 'momentum0' of 'w' twice"):
        read_checkpoint(path)


def test_a_garbage_file_with_the_identifier_is_named_corrupt(tmp_path):
    path = tmp_path / "checkpoint"
    path.write_bytes(b"\x08\x00\x00\x00ODTC\xf4\xff\xff\xff\x10\x00\x00\x00" + bytes(64))
    with pytest.raises(CheckpointError, match="onnxruntime-training checkpoint .*(truncated or corrupt|version)"):
        read_checkpoint(path)


def test_read_upstream_checkpoint_names_a_file_of_another_format(tmp_path):
    shutil.copy(DATA / "model.onnx", tmp_path / "model.onnx")
    with pytest.raises(CheckpointError, match="file identifier ODTC"):
        read_upstream_checkpoint(tmp_path / "model.onnx")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_upstream_checkpoint(tmp_path / "empty")


def test_upstream_training_graphs_are_named_with_the_way_out(tmp_path):
    """Upstream's training and optimizer models need its training build: the error says so and
    what to do, instead of onnxruntime's bare 'not a registered function/op'."""
    state = CheckpointState.load_checkpoint(DATA / "checkpoint_trained")
    with pytest.raises(ModelError, match=r"generated by onnxruntime-training.*InPlaceAccumulatorV2.*"
                                         r"SoftmaxCrossEntropyLossGrad.*generate_artifacts"):
        Module(str(DATA / "training_model.onnx"), state)
    artifacts.generate_artifacts(str(DATA / "model.onnx"), requires_grad=TRAINABLE, frozen_params=["fc2.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    module = Module(str(tmp_path / "training_model.onnx"), state)
    with pytest.raises(ModelError, match=r"optimizer model.*generated by onnxruntime-training.*AdamWOptimizer"):
        Optimizer(str(DATA / "optimizer_model.onnx"), module)


# --------------------------------------------------------------------------- external data
# Past ~1.8 GB upstream keeps the tensors' bytes in "<checkpoint>.data": each tensor (of 64
# bytes or more; every tensor when CheckpointState.save_checkpoint writes it) at an absolute
# offset aligned to its element size, dims and type in the flatbuffer, raw_data absent. A
# 2.04 GB checkpoint upstream wrote that way was read back exactly, once (too large for the
# suite); these files are built in upstream's layout (tests/upstream_odtc.py).

def test_tensors_in_the_external_data_file_are_read_at_their_offsets(tmp_path):
    trainable, frozen = external_fixture()
    checkpoint, data = odtc_bytes(trainable, frozen, inline={"b"})
    (tmp_path / "checkpoint").write_bytes(checkpoint)
    (tmp_path / "checkpoint.data").write_bytes(data)
    assert len(data) == 140 + 5 + 7 + 24 + 32 + 72 + 8 + 3  # int8 after float32, then float64 aligned to 8
    record = read_checkpoint(tmp_path / "checkpoint")
    assert list(record.parameters) == [*trainable, *frozen]
    for name, array in [*trainable.items(), *frozen.items()]:
        param = record.parameters[name]
        assert param.requires_grad == (name in trainable)
        assert param.value.dtype == array.dtype and param.value.shape == array.shape
        np.testing.assert_array_equal(param.value, array)


def test_a_missing_or_short_external_data_file_is_named(tmp_path):
    trainable, frozen = external_fixture()
    checkpoint, data = odtc_bytes(trainable, frozen, inline=set())
    (tmp_path / "checkpoint").write_bytes(checkpoint)
    with pytest.raises(CheckpointError, match=r"keeps its tensors in .*checkpoint\.data"):
        read_checkpoint(tmp_path / "checkpoint")
    (tmp_path / "checkpoint.data").write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=r"tensor 'mask' needs bytes .*checkpoint\.data"):
        read_checkpoint(tmp_path / "checkpoint")


def test_load_checkpoint_to_model_takes_an_upstream_checkpoint():
    """onnxblock.load_checkpoint_to_model (upstream's way to an inference model with trained
    weights) accepts upstream's checkpoint as upstream's own function did."""
    import onnx
    from onnx import numpy_helper

    from onnxtrain import onnxblock

    model = onnxblock.load_checkpoint_to_model(DATA / "checkpoint_trained", onnx.load(DATA / "model.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, value in EXPECTED["saved_parameters"].items():
        np.testing.assert_array_equal(weights[name], np.array(value, np.float32))


def test_an_sgd_checkpoint_resumes_at_upstreams_learning_rate_and_step(tmp_path):
    """Upstream's SGD saves an all-zero momentum0 (its SGD keeps none: dropped here, the step
    kept), and resumes at its default learning rate, not the scheduler's initial one it saved."""
    data = read_checkpoint(DATA / "checkpoint_sgd")
    assert data.optimizer.step == 2 and data.optimizer.states == ["momentum0"]
    artifacts.generate_artifacts(str(DATA / "model.onnx"), requires_grad=TRAINABLE, frozen_params=["fc2.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(DATA / "checkpoint_sgd")
    module = Module(str(tmp_path / "training_model.onnx"), state)
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    expected = EXPECTED["sgd"]
    assert optimizer.get_learning_rate() == pytest.approx(expected["resumed_learning_rate"], rel=1e-7)
    assert optimizer.step_count == 2
    module.train()
    loss = float(module(np.array(EXPECTED["input"], np.float32), np.array(EXPECTED["labels"], np.int64)))
    optimizer.step()
    assert loss == pytest.approx(expected["resumed_loss"], rel=1e-5)
    for name, value in expected["resumed_parameters"].items():
        np.testing.assert_allclose(state.parameters[name].data, np.array(value, np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_optimizer_state_the_model_does_not_use_is_refused_unless_it_is_all_zero(tmp_path):
    artifacts.generate_artifacts(str(DATA / "model.onnx"), requires_grad=TRAINABLE, frozen_params=["fc2.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(DATA / "checkpoint_trained")  # AdamW's moments, not zero
    module = Module(str(tmp_path / "training_model.onnx"), state)
    with pytest.raises(CheckpointError, match=r"holds optimizer state \['momentum0', 'momentum1'\] but the optimizer "
                                              r"model uses \[\]"):
        Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
