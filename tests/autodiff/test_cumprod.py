"""CumProd's gradient where the input holds exact zeros (the gradient table samples away from
them): against torch.cumprod's gradient, for every placement of one or two zeros and every
combination of ``exclusive`` and ``reverse``."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradients
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder

torch = pytest.importorskip("torch")

_N = 5


def _onnx_gradient(x: np.ndarray, dy: np.ndarray, axis: int, exclusive: int, reverse: int) -> np.ndarray:
    graph = helper.make_graph(
        [helper.make_node("CumProd", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)], "cumprod",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(x.shape))],
        [numpy_helper.from_array(np.array(axis, np.int64), "axis"), numpy_helper.from_array(dy, "dy")])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)]))
    graph = model.graph
    b = GraphBuilder(graph)
    dy_value = next(v for name, v in graph.initializers.items() if name == "dy")
    loss = b.op.ReduceSum(b.op.Mul(graph.outputs[0], dy_value), keepdims=0)
    x_value = graph.inputs[0]
    grads = build_gradients(graph, loss, [x_value])
    graph.outputs.clear()
    graph.outputs.append(grads[x_value])
    return ort.InferenceSession(io.serialize(model)).run(None, {"x": x})[0]


def _torch_gradient(x: np.ndarray, dy: np.ndarray, axis: int, exclusive: int, reverse: int) -> np.ndarray:
    t = torch.tensor(x, requires_grad=True)
    source = t.flip(axis) if reverse else t
    y = torch.cumprod(source, axis)
    if exclusive:  # products of the elements strictly before: shift right, a 1 first
        ones = torch.ones_like(y.narrow(axis, 0, 1))
        y = torch.cat([ones, y.narrow(axis, 0, y.shape[axis] - 1)], axis)
    if reverse:
        y = y.flip(axis)
    y.backward(torch.tensor(dy))
    return t.grad.numpy()


_ZERO_PLACES = [(), (0,), (2,), (_N - 1,), (1, 3), (2, 2 + 1)]


@pytest.mark.parametrize(("exclusive", "reverse"), list(itertools.product([0, 1], [0, 1])),
                         ids=lambda v: str(v))
@pytest.mark.parametrize("zeros", _ZERO_PLACES, ids=lambda z: "zeros-at-" + "-".join(map(str, z)) if z else "none")
def test_cumprod_gradient_at_zeros_matches_torch(zeros, exclusive, reverse):
    rng = np.random.default_rng(len(zeros) * 7 + exclusive * 2 + reverse)
    x = rng.uniform(0.5, 1.5, size=(3, _N)) * rng.choice([-1.0, 1.0], size=(3, _N))
    x[1, list(zeros)] = 0.0  # row 0 and 2 stay zero-free: rows are independent
    x[2, -1] = 0.0
    dy = rng.standard_normal((3, _N))
    expected = _torch_gradient(x, dy, 1, exclusive, reverse)
    np.testing.assert_allclose(_onnx_gradient(x, dy, 1, exclusive, reverse), expected, rtol=1e-10, atol=1e-12)


def test_cumprod_gradient_along_a_leading_axis():
    rng = np.random.default_rng(3)
    x = rng.uniform(-1.5, 1.5, size=(_N, 2))
    x[1, 0] = x[3, 0] = x[4, 1] = 0.0
    dy = rng.standard_normal(x.shape)
    np.testing.assert_allclose(_onnx_gradient(x, dy, 0, 0, 0), _torch_gradient(x, dy, 0, 0, 0), rtol=1e-10,
                               atol=1e-12)
