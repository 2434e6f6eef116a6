"""EmptyTensorsPass: values of a static shape with a zero-sized dim read empty constants, so
onnxruntime's optimizer (which dropped an Expand from [1, 5] to [0, 5] as a no-op) computes the
shapes the graph states; graph outputs keep their names."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxtrain.ir import io
from onnxtrain.passes.empty_tensors import EmptyTensorsPass


def _expand_of_a_row() -> ir.Model:
    """``grad = Expand(Unsqueeze(dy), [0, 5]) * p`` and ``total = ReduceSum(x)``: a sum's gradient over an empty batch."""
    dy = ir.Value(name="dy", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([5]))
    p = ir.Value(name="p", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([0, 5]))
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0], np.int64))})
    target = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0, 5], np.int64))})
    row = ir.node("Unsqueeze", [dy, axes.outputs[0]])
    spread = ir.node("Expand", [row.outputs[0], target.outputs[0]])
    scaled = ir.node("Mul", [spread.outputs[0], p])
    total = ir.node("ReduceSum", [x, axes.outputs[0]], attributes={"keepdims": 0})
    for node, name, shape in ((row, "row", [1, 5]), (spread, "spread", [0, 5]), (scaled, "grad", [0, 5]),
                              (total, "total", [5])):
        node.outputs[0].name, node.outputs[0].shape = name, ir.Shape(shape)
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([dy, p, x], [scaled.outputs[0], total.outputs[0]],
                     nodes=[axes, target, row, spread, scaled, total], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model) -> list[np.ndarray]:
    session = ort.InferenceSession(io.serialize(model))
    return session.run(None, {"dy": np.ones(5, np.float32), "p": np.array(2.0, np.float32),
                              "x": np.zeros((0, 5), np.float32)})


def test_an_empty_gradient_keeps_its_shape_through_onnxruntimes_optimizer():
    model = _expand_of_a_row()
    assert _run(model)[0].shape == (1, 5)  # onnxruntime's own optimizer drops the Expand
    result = EmptyTensorsPass()(model)
    assert result.modified
    grad, total = _run(model)
    assert grad.shape == (0, 5)
    np.testing.assert_array_equal(total, np.zeros(5, np.float32))  # a non-empty value still computed
    assert [o.name for o in model.graph.outputs] == ["grad", "total"]
    assert not any(n.op_type in ("Expand", "Mul") for n in model.graph)


def test_a_graph_without_empty_values_is_left_alone():
    model = _expand_of_a_row()
    model.graph.inputs[2].shape = ir.Shape(["batch", 5])
    for node in model.graph:
        if node.outputs[0].shape is not None and 0 in tuple(node.outputs[0].shape):
            node.outputs[0].shape = ir.Shape(["batch", 5])
    assert not EmptyTensorsPass()(model).modified
