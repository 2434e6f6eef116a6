"""The numerical checker itself: it must catch a wrong rule and report unsupported ops."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import DEFAULT_REGISTRY, Registry, grad
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.errors import GradientCheckError, UnsupportedOpError


def _model(op_types, shape=(3, 4)):
    nodes, prev = [], "x"
    for k, op in enumerate(op_types):
        nodes.append(helper.make_node(op, [prev], [f"v{k}"], name=f"node{k}"))
        prev = f"v{k}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_wrong_rule_is_caught():
    registry = Registry(rules={k: list(v) for k, v in DEFAULT_REGISTRY.rules.items()})
    registry.rules.pop(("", "Sigmoid"))

    @grad("Sigmoid", registry=registry)
    def wrong(ctx):  # forgets the (1 - y) factor
        return (ctx.op.Mul(ctx.dy, ctx.y),)

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with pytest.raises(GradientCheckError, match="x: analytic"):
        check_gradients(_model(["Sigmoid"]), {"x": x}, registry=registry)
    check_gradients(_model(["Sigmoid"]), {"x": x})  # the real rule passes


def test_unsupported_ops_are_listed_together():
    x = np.ones((3, 4), np.float32)
    registry = Registry(rules={k: v for k, v in DEFAULT_REGISTRY.rules.items() if k[1] not in ("Sin", "Cos")})
    with pytest.raises(UnsupportedOpError) as info:
        check_gradients(_model(["Sin", "Tanh", "Cos", "Sin"]), {"x": x}, registry=registry)
    assert set(info.value.unsupported) == {"Sin", "Cos"}
    assert info.value.unsupported["Sin"] == ["node0", "node3"]


def test_a_rule_that_cannot_handle_a_variant_reports_the_node():
    # Einsum with a repeated label inside an operand that also has '...' is outside its rule
    graph = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], equation="...ii->...i", name="diag")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(UnsupportedOpError, match="repeated label in an operand with '...'") as info:
        check_gradients(model, {"x": np.ones((2, 3, 3), dtype=np.float32)})
    assert info.value.unsupported == {"Einsum": ["diag"]}


@pytest.mark.parametrize(("opset", "statistic"), [(14, "running_mean"), (9, "saved_mean")])
def test_a_gradient_through_batch_norm_statistics_is_refused_not_dropped(opset, statistic):
    """Training-mode BatchNormalization's statistics outputs are buffers; a loss that reads one
    got the normalized output's gradient alone, silently."""
    from onnx import numpy_helper

    outputs = ["y", "running_mean", "running_var"] + (["saved_mean", "saved_var"] if opset < 14 else [])
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outputs, momentum=0.9,
                            **({"training_mode": 1} if opset >= 14 else {}))
    initializers = [numpy_helper.from_array(a, k) for k, a in
                    [("s", np.ones(3)), ("b", np.zeros(3)), ("m", np.zeros(3)), ("v", np.ones(3))]]
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
                              [helper.make_tensor_value_info(o, TensorProto.DOUBLE, None) for o in ("y", statistic)],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    with pytest.raises(UnsupportedOpError, match="statistics outputs"):
        check_gradients(model, {"x": np.random.default_rng(0).standard_normal((4, 3))})
