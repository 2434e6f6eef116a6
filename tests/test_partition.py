"""The forward/backward cut of a gradient graph, without PyTorch: run both halves in
onnxruntime and compare the vector-Jacobian products with finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.partition import FROM_FORWARD_OUTPUT, FROM_INPUT, FROM_OUTPUT_GRAD, build_forward_backward


def _model() -> onnx.ModelProto:
    """y = tanh(x @ W + b); outputs y, y again, x unchanged, and n = the row count (int)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Tanh", ["h"], ["y"]),
        helper.make_node("Shape", ["x"], ["n"], end=1),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _session(model):
    return ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])


def _forward(x, W, b):
    return np.tanh(x @ W + b)


def _backward_feeds(graphs, inputs, outputs, seeds) -> dict:
    """The backward graph's feeds, each from where ``graphs.backward_inputs`` says."""
    sources = {FROM_OUTPUT_GRAD: seeds, FROM_FORWARD_OUTPUT: outputs, FROM_INPUT: inputs}
    return {value.name: sources[source][index]
            for value, (source, index) in zip(graphs.backward.graph.inputs, graphs.backward_inputs)}


def test_forward_and_backward_halves_compute_the_vjp():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    W = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    graphs = build_forward_backward(io.load_model(_model()), ["x", "W", "b"])
    assert graphs.num_model_outputs == 4
    assert graphs.differentiable_outputs == [0, 1, 2]  # not the integer shape

    forward = _session(graphs.forward)
    outputs = forward.run(None, {"x": x, "W": W, "b": b})
    np.testing.assert_allclose(outputs[0], _forward(x, W, b), rtol=1e-6)
    np.testing.assert_array_equal(outputs[2], x)
    np.testing.assert_array_equal(outputs[3], [5])
    # the backward graph reads y (an output) and x/W: nothing else needs to be saved
    assert graphs.saved == []

    seeds = [rng.standard_normal(o.shape).astype(np.float32) for o in outputs[:3]]
    inputs = [x, W, b]
    grads = _session(graphs.backward).run(None, _backward_feeds(graphs, inputs, outputs, seeds))

    # reference: central differences of <seeds, outputs> in float64
    def objective(x_, W_, b_):
        y = _forward(x_, W_, b_)
        return float((seeds[0] * y).sum() + (seeds[1] * y).sum() + (seeds[2] * x_).sum())

    args = [a.astype(np.float64) for a in inputs]
    for k, grad in enumerate(grads):
        numeric = np.zeros_like(args[k])
        for i in np.ndindex(args[k].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[k][i] += 1e-6
            minus[k][i] -= 1e-6
            numeric[i] = (objective(*plus) - objective(*minus)) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-4)


def test_no_grad_outputs_get_no_seed_and_frozen_inputs_no_gradient():
    graphs = build_forward_backward(io.load_model(_model()), ["W"], no_grad_outputs=[1])
    assert graphs.differentiable_outputs == [0]  # output 2 (x) does not depend on W
    assert [o.name for o in graphs.backward.graph.outputs] == ["W_grad"]
    sources = {source for source, _ in graphs.backward_inputs}
    assert sources <= {FROM_OUTPUT_GRAD, FROM_FORWARD_OUTPUT, FROM_INPUT}
    inputs_read = {graphs.forward.graph.inputs[i].name for s, i in graphs.backward_inputs if s == FROM_INPUT}
    assert inputs_read == {"x"}  # dW = x^T (g * (1 - y^2)): b and W are not needed


def test_cheap_ops_whose_inputs_are_saved_anyway_are_recomputed_not_saved():
    """y = gelu(x @ W1) @ W2: the GELU gradient saves h = x @ W1, so the backward graph
    recomputes g = gelu(h) for W2's gradient instead of keeping g alive between the runs."""
    from math import erf

    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Gelu", ["h"], ["g"]),
             helper.make_node("MatMul", ["g", "W2"], ["y"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("W1", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("W2", TensorProto.FLOAT, [4, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    graphs = build_forward_backward(io.load_model(model), ["W1", "W2"])
    assert graphs.saved == ["h"]
    assert "Gelu" in [n.op_type for n in graphs.backward.graph]

    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (3, 4), (4, 2)]]
    outputs = _session(graphs.forward).run(None, dict(zip(["x", "W1", "W2"], inputs)))
    seed = rng.standard_normal(outputs[0].shape).astype(np.float32)
    d_w1, d_w2 = _session(graphs.backward).run(None, _backward_feeds(graphs, inputs, outputs, [seed]))

    x, w1, w2 = (a.astype(np.float64) for a in inputs)
    h = x @ w1
    cdf = 0.5 * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    g = h * cdf
    dg = seed @ w2.T
    dh = dg * (cdf + h * np.exp(-h * h / 2) / np.sqrt(2 * np.pi))
    np.testing.assert_allclose(d_w2, g.T @ seed, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_w1, x.T @ dh, rtol=1e-4, atol=1e-5)

