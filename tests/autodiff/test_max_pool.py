"""MaxPool's gradient by windows (no ``Indices`` output) against the ``Indices`` rule and PyTorch.

Windows that tile the input (strides == kernel, no pads, no dilation, floor mode) take the
window path of ``rules/conv.py``: finite differences (tests/autodiff/rows/conv.py) cannot
check ties, so these tests compare it exactly with the scatter-by-``Indices`` rule, with a
NumPy scatter of onnxruntime's own ``Indices``, and with ``torch.nn.functional.max_pool2d``'s
gradient, on inputs full of ties (every window of an all-zero input is one big tie).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.autodiff.registry import DEFAULT_REGISTRY, GradRule, Registry
from onnxtrain.autodiff.rules.conv import _max_pool_by_indices
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder


def _indices_registry() -> Registry:
    """onnxtrain's rules, except that MaxPool always scatters by its ``Indices``."""
    registry = Registry()
    for rule in DEFAULT_REGISTRY.registered():
        if rule.op_type == "MaxPool" and rule.domain == "":
            rule = GradRule("MaxPool", "", rule.since, rule.until, lambda ctx: (_max_pool_by_indices(ctx),))
        registry.add(rule)
    return registry


INDICES_RULE = _indices_registry()


def _gradient_model(attrs: dict, x_shape: list, opset: int, registry: Registry = DEFAULT_REGISTRY,
                    dtype: ir.DataType = ir.DataType.FLOAT):
    """x -> MaxPool -> y, and dx for a given dy (graph inputs x and dy; outputs y and dx)."""
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset})
    b = GraphBuilder(graph)
    x = b.input("x", dtype, x_shape)
    y = b.op.MaxPool(x, **attrs)
    dy = b.input("dy", dtype, None)
    grads = build_gradients(graph, y, [x], loss_grad=dy, registry=registry)
    for name, value in (("y", y), ("dx", grads[x])):
        out = b.op.Identity(value)
        out.name = name
        graph.outputs.append(out)
    return ir.Model(graph, ir_version=8)


def _run(model: ir.Model, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, dx) of a :func:`_gradient_model`."""
    session = ort.InferenceSession(io.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    y, dx = session.run(["y", "dx"], {"x": x, "dy": dy})
    return y, dx


def _ort_max_pool(attrs: dict, x: np.ndarray, opset: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's own MaxPool outputs (Y, Indices) for ``x``; Indices in row-major order
    whatever ``attrs``' storage_order (which changes Indices, not the gradient)."""
    attrs = {name: value for name, value in attrs.items() if name != "storage_order"}
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset})
    b = GraphBuilder(graph)
    xv = b.input("x", ir.DataType.from_numpy(x.dtype), list(x.shape))
    y, indices = b.op.MaxPool(xv, _outputs=2, **attrs)
    indices.type = ir.TensorType(ir.DataType.INT64)
    graph.outputs.extend([y, indices])
    session = ort.InferenceSession(io.to_proto(ir.Model(graph, ir_version=8)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    y, indices = session.run(None, {"x": x})
    return y, indices


def _random_dy(attrs: dict, x: np.ndarray, opset: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(_ort_max_pool(attrs, x, opset)[0].shape).astype(np.float32)


def _scatter_of_ort_indices(attrs: dict, x: np.ndarray, dy: np.ndarray, opset: int) -> np.ndarray:
    """dx from onnxruntime's own MaxPool ``Indices``: a NumPy scatter-add of dy at them."""
    _, flat_indices = _ort_max_pool(attrs, x, opset)
    dx = np.zeros(x.size, dy.dtype)
    np.add.at(dx, flat_indices.reshape(-1), dy.reshape(-1))
    return dx.reshape(x.shape)


def _op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def _tie_heavy(rng: np.random.Generator, shape) -> np.ndarray:
    """Values from {0, 1, 2} after a ReLU-like clamp: most windows hold equal largest values."""
    return np.maximum(rng.integers(-2, 3, size=shape), 0).astype(np.float32)


# windows that tile the input: the window path
TILING = [
    pytest.param({"kernel_shape": [3], "strides": [3]}, [2, 3, 11], id="1d-k3-remainder-2"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2]}, [2, 3, 7, 9], id="2d-k2-7x9"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2]}, [3, 2, 8, 6], id="2d-k2-divisible"),
    pytest.param({"kernel_shape": [2, 3], "strides": [2, 3], "auto_pad": "VALID"}, [2, 2, 7, 8], id="2d-k2x3-valid"),
    pytest.param({"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "pads": [0] * 6, "dilations": [1, 1, 1],
                  "storage_order": 1}, [2, 2, 5, 4, 7], id="3d-k2-explicit-defaults"),
]

# overlapping, padded, dilated or ceil-mode windows: the Indices path
NOT_TILING = [
    pytest.param({"kernel_shape": [3, 3], "strides": [2, 2]}, [2, 2, 7, 7], id="overlap"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 0, 0, 0]}, [2, 2, 7, 6], id="pads"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1]}, [2, 2, 8, 6], id="dilations"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, [2, 2, 7, 7], id="ceil"),
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, [2, 2, 7, 7], id="same"),
    pytest.param({"kernel_shape": [2, 2], "strides": [1, 2]}, [2, 2, 6, 6], id="stride-unlike-kernel"),
]


@pytest.mark.parametrize("attrs, shape", TILING)
def test_tiling_windows_need_neither_indices_nor_scatter(attrs, shape):
    ops = _op_types(_gradient_model(attrs, shape, 18))
    assert "ScatterElements" not in ops and "ArgMax" in ops
    assert ops.count("MaxPool") == 1  # the forward node alone


@pytest.mark.parametrize("attrs, shape", NOT_TILING)
def test_other_windows_keep_the_indices_rule(attrs, shape):
    model = _gradient_model(attrs, shape, 18)
    assert "ScatterElements" in _op_types(model) and "ArgMax" not in _op_types(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = _random_dy(attrs, x, 18, rng)
    _, dx = _run(model, x, dy)
    np.testing.assert_array_equal(dx, _scatter_of_ort_indices(attrs, x, dy, 18))


@pytest.mark.parametrize("opset", [13, 18, 23])
@pytest.mark.parametrize("attrs, shape", TILING)
def test_window_gradient_equals_indices_rule_with_ties(attrs, shape, opset):
    rng = np.random.default_rng(opset)
    for x in (_tie_heavy(rng, shape), rng.standard_normal(shape).astype(np.float32), np.zeros(shape, np.float32)):
        dy = _random_dy(attrs, x, opset, rng)
        y, dx = _run(_gradient_model(attrs, shape, opset), x, dy)
        _, by_indices = _run(_gradient_model(attrs, shape, opset, INDICES_RULE), x, dy)
        np.testing.assert_array_equal(dx, by_indices)
        np.testing.assert_array_equal(dx, _scatter_of_ort_indices(attrs, x, dy, opset))
        # one winner per window: as many nonzero input gradients as outputs
        assert np.count_nonzero(dx) == np.count_nonzero(dy) == y.size


def test_symbolic_dims_take_their_sizes_at_run_time():
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    model = _gradient_model(attrs, ["N", "C", "H", "W"], 18)
    assert "ScatterElements" not in _op_types(model)
    rng = np.random.default_rng(3)
    for shape in ([2, 3, 7, 9], [1, 2, 8, 6], [3, 1, 2, 5]):
        x = _tie_heavy(rng, shape)
        dy = _random_dy(attrs, x, 18, rng)
        _, dx = _run(model, x, dy)
        assert dx.shape == x.shape
        np.testing.assert_array_equal(dx, _scatter_of_ort_indices(attrs, x, dy, 18))


@pytest.mark.parametrize("dtype", [ir.DataType.DOUBLE, ir.DataType.FLOAT16])
def test_other_float_types(dtype):
    """float64 spreads dy by Expand (no float64 Resize in onnxruntime's CPU provider); float16 by Resize."""
    attrs = {"kernel_shape": [2, 3], "strides": [2, 3]}
    rng = np.random.default_rng(5)
    x = _tie_heavy(rng, [2, 3, 5, 7]).astype(dtype.numpy())
    dy = rng.standard_normal([2, 3, 2, 2]).astype(dtype.numpy())
    model = _gradient_model(attrs, list(x.shape), 18, dtype=dtype)
    spread_by = "Expand" if dtype == ir.DataType.DOUBLE else "Resize"
    assert spread_by in _op_types(model) and "ScatterElements" not in _op_types(model)
    _, dx = _run(model, x, dy)
    assert dx.dtype == dtype.numpy()
    np.testing.assert_array_equal(dx, _scatter_of_ort_indices(attrs, x, dy, 18))


def test_ties_go_where_pytorch_sends_them():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = _tie_heavy(rng, [2, 3, 7, 9])
    x[0, 0] = 0.0  # whole channels of all-equal windows, as after a ReLU
    x[1, 2] = 1.0
    x_torch = torch.from_numpy(x.copy()).requires_grad_(True)
    y_torch = torch.nn.functional.max_pool2d(x_torch, kernel_size=2, stride=2)
    dy = rng.standard_normal(tuple(y_torch.shape)).astype(np.float32)
    y_torch.backward(torch.from_numpy(dy))
    y, dx = _run(_gradient_model({"kernel_shape": [2, 2], "strides": [2, 2]}, list(x.shape), 18), x, dy)
    np.testing.assert_array_equal(y, y_torch.detach().numpy())
    np.testing.assert_array_equal(dx, x_torch.grad.numpy())
    assert np.count_nonzero(dx[0, 0]) == dy[0, 0].size  # an all-zero channel: one element per window
