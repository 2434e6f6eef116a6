"""PoolBeforeReluPass: MaxPool(Relu(x)) -> Relu(MaxPool(x)), same values and same gradients."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradients
from onnxtrain.ir import io
from onnxtrain.passes.pool_first import PoolBeforeReluPass
from tests.passes._graphs import model_of, run

SHAPE = [2, 3, 6, 7]
POOLS = {
    "tiling_2x2": {"kernel_shape": [2, 2], "strides": [2, 2]},
    "overlapping_padded": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    "ceil_mode": {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
}


def _relu_pool(pool_attrs, extra_nodes=(), outputs=("out",), pool_outputs=("out",)):
    nodes = [helper.make_node("Relu", ["x"], ["act"]), helper.make_node("MaxPool", ["act"], list(pool_outputs), **pool_attrs),
             *extra_nodes]
    return model_of(nodes, [("x", SHAPE)], list(outputs))


def _inputs_with_ties(seed=0):
    """Windows that are all negative, all zero, tied at a positive value, and plain random."""
    x = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    x[0, 0] = -np.abs(x[0, 0])         # no positive element anywhere in this plane
    x[0, 1] = 0.0                      # every element 0
    x[1, 0, :, :4] = 0.5               # ties at a positive value
    x[1, 1, :3] = np.where(x[1, 1, :3] > 0, 0.0, x[1, 1, :3])  # zeros tied with negatives
    return x


def _with_input_gradient(model: ir.Model) -> ir.Model:
    """``model`` plus an input ``dy`` (the output's gradient) and an output ``dx``."""
    graph = model.graph
    out = graph.outputs[0]
    dy = ir.Value(name="dy", type=ir.TensorType(ir.DataType.FLOAT), shape=out.shape)
    graph.inputs.append(dy)
    grads = build_gradients(graph, out, [graph.inputs[0]], loss_grad=dy)
    dx = grads[graph.inputs[0]]
    dx.name = "dx"
    graph.outputs.append(dx)
    return model


@pytest.mark.parametrize("pool", list(POOLS))
def test_values_and_gradients_are_unchanged(pool):
    original = _relu_pool(POOLS[pool])
    model = io.load_model(original)
    assert PoolBeforeReluPass()(model).modified
    assert [n.op_type for n in model.graph] == ["MaxPool", "Relu"]
    assert [v.name for v in model.graph.outputs] == ["out"]
    x = _inputs_with_ties()
    (expected,), (got,) = run(original, {"x": x}), run(io.to_proto(model), {"x": x})
    np.testing.assert_array_equal(got, expected)

    dy = np.random.default_rng(1).standard_normal(expected.shape).astype(np.float32)
    feeds = {"x": x, "dy": dy}
    before = run(io.to_proto(_with_input_gradient(io.load_model(original))), feeds)
    after = run(io.to_proto(_with_input_gradient(model)), feeds)
    np.testing.assert_array_equal(after[1], before[1])
    assert np.count_nonzero(before[1]) > 0


def test_a_relu_read_elsewhere_or_returned_stays():
    read_twice = _relu_pool(POOLS["tiling_2x2"], [helper.make_node("Neg", ["act"], ["other"])], outputs=("out", "other"))
    assert not PoolBeforeReluPass()(io.load_model(read_twice)).modified
    returned = _relu_pool(POOLS["tiling_2x2"], outputs=("out", "act"))
    assert not PoolBeforeReluPass()(io.load_model(returned)).modified


def test_a_max_pool_whose_indices_are_read_stays():
    # the indices of MaxPool(x) differ from MaxPool(Relu(x))'s in windows without a positive element
    indices = model_of([helper.make_node("Relu", ["x"], ["act"]),
                        helper.make_node("MaxPool", ["act"], ["out", "idx"], kernel_shape=[2, 2], strides=[2, 2])],
                       [("x", SHAPE)], ["out"])
    indices.graph.output.append(helper.make_tensor_value_info("idx", TensorProto.INT64, None))
    assert not PoolBeforeReluPass()(io.load_model(indices)).modified
    unused = model_of([helper.make_node("Relu", ["x"], ["act"]),
                       helper.make_node("MaxPool", ["act"], ["out", "idx"], kernel_shape=[2, 2], strides=[2, 2])],
                      [("x", SHAPE)], ["out"])
    assert PoolBeforeReluPass()(io.load_model(unused)).modified
