"""onnxblock.save_checkpoint / load_checkpoint_to_model round trip (upstream's offline helpers)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain import onnxblock
from onnxtrain.api import CheckpointState
from onnxtrain.errors import CheckpointError
from tests.test_artifacts import regression_model


class _Train(onnxblock.TrainingBlock):
    def __init__(self):
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()

    def build(self, output_name):
        return self.loss(output_name)


def test_save_checkpoint_of_training_block_parameters_and_load_back_into_a_model(tmp_path):
    block = _Train()
    block.requires_grad("w1")
    block.requires_grad("b1")
    block.requires_grad("w2", False)
    with onnxblock.base(regression_model()):
        block("y")
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert state.parameters.keys() == ["w1", "b1", "w2"]
    assert state.parameters["w1"].requires_grad and not state.parameters["w2"].requires_grad

    state.parameters["w1"] = np.full((3, 8), 0.25, np.float32)
    CheckpointState.save_checkpoint(state, tmp_path / "checkpoint")
    model = regression_model()
    assert onnxblock.load_checkpoint_to_model(tmp_path / "checkpoint", model) is model
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    np.testing.assert_array_equal(values["w1"], np.full((3, 8), 0.25, np.float32))


def test_load_checkpoint_to_model_checks_shapes(tmp_path):
    onnxblock.save_checkpoint(([("w1", np.zeros((2, 2), np.float32))], []), tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match="w1"):
        onnxblock.load_checkpoint_to_model(tmp_path / "checkpoint", regression_model())
