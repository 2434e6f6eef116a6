"""RemoveUnusedNodesPass: dead nodes removed in one batch (and by onnx_ir's pass for the rest),
the live ones and graph outputs kept."""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxtrain.ir import io
from onnxtrain.passes.dce import RemoveUnusedNodesPass
from tests.passes._graphs import model_of, run


def test_dead_chains_go_and_live_values_and_outputs_stay():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),  # live: read by the output's producer
             helper.make_node("Neg", ["a"], ["dead1"]),  # a dead chain of three
             helper.make_node("Exp", ["dead1"], ["dead2"]),
             helper.make_node("Add", ["dead2", "a"], ["dead3"]),
             helper.make_node("Abs", ["a"], ["kept"]),  # an output read by nothing
             helper.make_node("Mul", ["a", "a"], ["y"])]
    model = model_of(nodes, [("x", [3])], ["y", "kept"])
    graph_model = io.load_model(model)
    assert RemoveUnusedNodesPass()(graph_model).modified
    assert [n.op_type for n in graph_model.graph] == ["Relu", "Abs", "Mul"]
    assert all(use.node.graph is graph_model.graph for use in graph_model.graph.inputs[0].uses())
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    got = run(io.to_proto(graph_model), {"x": x})
    np.testing.assert_array_equal(got[0], np.maximum(x, 0) ** 2)
    assert not RemoveUnusedNodesPass()(graph_model).modified


def test_many_outputs_and_dead_nodes_take_one_removal(monkeypatch):
    """A graph with a thousand outputs and a thousand dead nodes: one Graph.remove call."""
    nodes = [helper.make_node("Neg", ["x"], ["o0"])]
    nodes += [helper.make_node("Neg", [f"o{i}"], [f"o{i + 1}"]) for i in range(1000)]
    nodes += [helper.make_node("Exp", [f"o{i}"], [f"d{i}"]) for i in range(1000)]
    graph_model = io.load_model(model_of(nodes, [("x", [2])], [f"o{i}" for i in range(1001)]))
    graph = graph_model.graph
    calls = []
    original = type(graph).remove
    monkeypatch.setattr(type(graph), "remove", lambda self, *a, **k: (calls.append(a), original(self, *a, **k))[1])
    RemoveUnusedNodesPass()(graph_model)
    assert len(calls) == 1 and len(graph) == 1001
