"""Gradients of shape ops on tensors with a zero-sized dim: a 0 in a reshape target is a size, not
"copy the dim" (Tile's repeats of 0, Squeeze/Flatten/Reshape of an empty tensor, at opset 13
where Reshape has no allowzero too)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradients
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder

CASES = [
    # (op, x shape, constant inputs, attributes, opset)
    ("Tile", [2, 3], [np.array([1, 0], np.int64)], {}, 13),
    ("Tile", [2, 3], [np.array([1, 0], np.int64)], {}, 18),
    ("Tile", [0, 3], [np.array([2, 1], np.int64)], {}, 13),
    ("Tile", [0, 3], [np.array([2, 1], np.int64)], {}, 18),
    ("Tile", [2, 0, 3], [np.array([0, 2, 1], np.int64)], {}, 13),
    ("Squeeze", [1, 0, 3], [np.array([0], np.int64)], {}, 13),
    ("Squeeze", [1, 0, 3], [np.array([0], np.int64)], {}, 14),
    ("Flatten", [2, 0, 3], [], {"axis": 2}, 13),
    ("Reshape", [0, 2, 0], [np.array([2, 0], np.int64)], {"allowzero": 1}, 14),
    ("Unsqueeze", [0, 3, 0], [np.array([1], np.int64)], {}, 13),
]


def _model(op, shape, constants, attrs, opset):
    names = [f"c{k}" for k in range(len(constants))]
    graph = helper.make_graph([helper.make_node(op, ["x", *names], ["y"], **attrs)], op,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(c, n) for n, c in zip(names, constants)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(("op", "shape", "constants", "attrs", "opset"), CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-opset{c[4]}" for c in CASES])
def test_gradient_of_zero_size_tensor_has_the_input_shape(op, shape, constants, attrs, opset):
    model = io.load_model(_model(op, shape, constants, attrs, opset))
    graph = model.graph
    x = graph.inputs[0]
    b = GraphBuilder(graph)
    loss = b.op.ReduceSum(graph.outputs[0], keepdims=0)
    grads = build_gradients(graph, loss, [x])
    graph.outputs.clear()
    graph.outputs.append(grads[x])
    graph.outputs[0].name = "dx"
    dx, = ort.InferenceSession(io.serialize(model)).run(None, {"x": np.zeros(shape, np.float32)})
    assert dx.shape == tuple(shape)


@pytest.mark.parametrize("opset", [13, 18])
def test_tile_gradient_still_sums_the_copies(opset):
    x = np.random.default_rng(0).standard_normal((2, 1, 3)).astype(np.float32)
    check_gradients(_model("Tile", [2, 1, 3], [np.array([1, 4, 2], np.int64)], {}, opset), {"x": x})
