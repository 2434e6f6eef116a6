"""Gradients that broadcast: reductions' ``Broadcast`` gradients added without an Expand, and
Sub/Div un-broadcasting before their minus sign and division.

The numerical checker covers each rule alone (tests/autodiff/rows); these graphs make a value
fan out into a reduction and a full-sized use, as a decomposed batch norm does, so the
builder's broadcasting sum is what is checked, and count the full-sized passes it saves.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.ir import io

SHAPE = [4, 3, 5, 2]
AXES = [0, 2, 3]


def _node(op, inputs, output, **attrs):
    return helper.make_node(op, inputs, [output], name=f"n_{output}", **attrs)


def _batch_norm_like(shape=SHAPE):
    """y = (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * w, reduced over AXES; loss = sum(y * t)."""
    axes = helper.make_tensor("axes", TensorProto.INT64, [len(AXES)], AXES)
    eps = helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-3])
    nodes = [
        _node("ReduceMean", ["x", "axes"], "mean", keepdims=1),
        _node("Sub", ["x", "mean"], "centered"),
        _node("Mul", ["centered", "centered"], "squared"),
        _node("ReduceMean", ["squared", "axes"], "var", keepdims=1),
        _node("Add", ["var", "eps"], "var_eps"),
        _node("Sqrt", ["var_eps"], "std"),
        _node("Div", ["centered", "std"], "normed"),
        _node("Mul", ["normed", "w"], "scaled"),
        _node("Mul", ["scaled", "t"], "weighted"),
        _node("ReduceSum", ["weighted"], "loss", keepdims=0),
    ]
    channels = [1, shape[1], 1, 1]
    graph = helper.make_graph(
        nodes, "bn_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, channels),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [axes, eps])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _inputs(shape=SHAPE):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal(shape).astype(np.float32),
            "w": rng.uniform(0.5, 1.5, [1, shape[1], 1, 1]).astype(np.float32),
            "t": rng.standard_normal(shape).astype(np.float32)}


def _gradient_graph(model, wrt=("x", "w")) -> ir.Graph:
    """The model's graph with the gradient nodes of ``wrt`` added."""
    graph = io.load_model(model).graph
    inputs = {v.name: v for v in graph.inputs}
    build_gradients(graph, graph.outputs[0], [inputs[name] for name in wrt])
    return graph


def test_batch_norm_like_gradients_match_finite_differences():
    check_gradients(_batch_norm_like(), _inputs(), wrt=["x", "w"])


def _count(graph: ir.Graph, op_type: str) -> int:
    return sum(node.op_type == op_type for node in graph)


def test_reductions_join_the_sum_without_expanding():
    graph = _gradient_graph(_batch_norm_like())
    # the loss's ReduceSum and the variance's ReduceMean give their inputs' only gradients:
    # expanded; the mean's gradient is a [1, C, 1, 1] operand of the sum that gathers x's
    assert _count(graph, "Expand") == 2
    # the builder's accumulations (Adds in its own scope): centered's two contributions (the
    # Div's and the square's, one 2 * c * dy) take one Add, x's full-sized one and the mean's one
    sums = [n for n in graph if n.op_type == "Add" and n.name.startswith("grad/Add_")]
    assert len(sums) == 2
    assert not [i for n in sums for i in n.inputs if i.producer().op_type == "Expand"]
    assert any(i.producer().name.startswith("grad/n_mean/") for i in sums[-1].inputs)


def test_minus_sign_and_division_fall_on_the_summed_gradients():
    """Sub's subtrahend and Div's divisor are [1, C, 1, 1]: their Neg and Div run after the sum."""
    graph = _gradient_graph(_batch_norm_like())
    negs = [n for n in graph if n.op_type == "Neg"]
    assert {n.name.split("/")[1] for n in negs} == {"n_centered", "n_normed"}
    for neg in negs:
        source = neg.inputs[0].producer()
        if source.op_type == "Div":  # Div's divisor: -(sum(dy * y)) / b
            source = source.inputs[0].producer()
        assert source.op_type == "ReduceSum", neg.name


@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_value_read_only_by_reductions_gets_an_expanded_gradient(keepdims):
    """x feeds two reductions and nothing else: one Broadcast is expanded to x's shape, the
    other joins it by broadcasting (the loss's ReduceSum has the other Expand)."""
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2])
    nodes = [
        _node("ReduceMean", ["x", "axes"], "mean", keepdims=keepdims),
        _node("ReduceSum", ["x", "axes"], "total", keepdims=keepdims),
        _node("Mul", ["mean", "total"], "product"),
        _node("ReduceSum", ["product"], "loss", keepdims=0),
    ]
    graph = helper.make_graph(nodes, "two_reductions", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(1).standard_normal([2, 3, 4]).astype(np.float32)
    check_gradients(model, {"x": x})
    assert _count(_gradient_graph(model, wrt=["x"]), "Expand") == 2


def _square_model(op: str):
    """loss = sum(square(x) * t), the square written as Mul(x, x) or Pow(x, 2)."""
    nodes = [_node("Mul", ["x", "x"], "sq") if op == "Mul" else _node("Pow", ["x", "two"], "sq"),
             _node("Mul", ["sq", "t"], "weighted"), _node("ReduceSum", ["weighted"], "loss", keepdims=0)]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph(
        nodes, "square",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [two])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["Mul", "Pow"])
def test_a_square_costs_two_passes(op):
    """d(x * x) = dy * (x + x): one product and one sum, no Pow and no accumulation of two products."""
    inputs = _inputs()
    check_gradients(_square_model(op), {"x": inputs["x"], "t": inputs["t"]}, wrt=["x"])
    graph = _gradient_graph(_square_model(op), wrt=("x",))
    square = [n for n in graph if n.name.startswith("grad/n_sq/")]
    assert sorted(n.op_type for n in square) == ["Add", "Mul"]
    assert not [n for n in graph if n.name.startswith("grad/Add_")]  # x has a single contribution
