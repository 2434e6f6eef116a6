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


_W = np.random.default_rng(1)
EMPTY_BATCH_CASES = [
    # (op, x shape, attributes, weights): gradients of a batch of 0 rows
    ("Conv", [2, 4, 6, 6], {"pads": [1, 1, 1, 1]}, [_W.standard_normal([3, 4, 3, 3])]),
    ("Conv", [2, 4, 6, 6], {"pads": [1, 1, 1, 1], "group": 2}, [_W.standard_normal([4, 2, 3, 3])]),
    ("Conv", [2, 4, 6, 6], {"group": 4}, [_W.standard_normal([4, 1, 3, 3])]),
    ("Conv", [2, 4, 8], {"strides": [2]}, [_W.standard_normal([3, 4, 3])]),
    ("Conv", [2, 64, 2, 2], {}, [_W.standard_normal([128, 64, 1, 1])]),  # one product over the batch
    ("ConvTranspose", [2, 4, 5, 5], {"group": 2}, [_W.standard_normal([4, 3, 3, 3])]),
    ("MaxPool", [2, 3, 6, 6], {"kernel_shape": [2, 2], "strides": [2, 2]}, []),
    ("MaxPool", [2, 3, 8], {"kernel_shape": [2], "strides": [2]}, []),
    ("GlobalMaxPool", [2, 3, 6, 6], {}, []),
    ("LRN", [2, 4, 5, 5], {"size": 3}, []),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("symbolic_plane", [False, True], ids=["static-plane", "symbolic-plane"])
@pytest.mark.parametrize(("op", "shape", "attrs", "weights"), EMPTY_BATCH_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{i}" for i, c in enumerate(EMPTY_BATCH_CASES)])
def test_gradients_of_an_empty_batch_are_empty_and_zero(op, shape, attrs, weights, symbolic_plane, opset):
    """A batch of 0 rows (the last, empty shard of a dataset) trains like PyTorch's: no input
    gradient, zero weight gradients. A Reshape target with -1 cannot be inferred beside a 0
    dim, and onnxruntime's ReshapeFusion writes a -1 into targets built from the shape."""
    names = [f"w{k}" for k in range(len(weights))]
    dims = ["N", shape[1], *([f"s{k}" for k in range(len(shape) - 2)] if symbolic_plane else shape[2:])]
    graph = helper.make_graph([helper.make_node(op, ["x", *names], ["y"], **attrs)], op,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w.astype(np.float32), n) for n, w in zip(names, weights)])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    graph = model.graph
    wrt = [graph.inputs[0], *(graph.initializers[n] for n in names)]
    loss = GraphBuilder(graph).op.ReduceSum(graph.outputs[0], keepdims=0)
    grads = build_gradients(graph, loss, wrt)
    graph.outputs.clear()
    for k, value in enumerate(wrt):
        graph.outputs.append(grads[value])
        grads[value].name = f"d{k}"
    session = ort.InferenceSession(io.serialize(model))  # onnxruntime's graph optimizations on
    nonempty = session.run(None, {"x": np.ones([2, *shape[1:]], np.float32)})
    empty = session.run(None, {"x": np.zeros([0, *shape[1:]], np.float32)})
    assert empty[0].shape == (0, *shape[1:])
    for k, weight in enumerate(weights, start=1):
        assert empty[k].shape == weight.shape == nonempty[k].shape
        assert not empty[k].any() and nonempty[k].any()
