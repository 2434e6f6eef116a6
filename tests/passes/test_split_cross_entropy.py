"""SplitCrossEntropyPass: SoftmaxCrossEntropyLoss as LogSoftmax + NegativeLogLikelihoodLoss.

The rewritten graph must compute what onnxruntime computes for the original op (its ONNX
function body), for every attribute combination and rank, both outputs included.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.split_cross_entropy import SplitCrossEntropyPass


def _model(rank: int, weights: bool, attrs: dict, both_outputs: bool) -> onnx.ModelProto:
    shape = ["N", 7] + [3] * (rank - 2)
    inputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("labels", TensorProto.INT64, [shape[0], *shape[2:]])]
    names = ["scores", "labels"]
    if weights:
        inputs.append(helper.make_tensor_value_info("weights", TensorProto.FLOAT, [7]))
        names.append("weights")
    outputs = ["loss", "log_prob"] if both_outputs else ["loss"]
    node = helper.make_node("SoftmaxCrossEntropyLoss", names, outputs, name="sce", **attrs)
    # a consumer of the loss inside the graph, so uses as well as graph outputs are rewired
    doubled = helper.make_node("Add", ["loss", "loss"], ["doubled"])
    graph = helper.make_graph([node, doubled], "g", inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in [*outputs, "doubled"]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("attrs", [{}, {"reduction": "sum"}, {"reduction": "none", "ignore_index": 2}])
@pytest.mark.parametrize("both_outputs", [False, True])
def test_split_matches_the_op(rank, weights, attrs, both_outputs):
    original = _model(rank, weights, attrs, both_outputs)
    model = io.load_model(original)
    assert SplitCrossEntropyPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert ops == ["LogSoftmax", "NegativeLogLikelihoodLoss", "Add"]
    assert [o.name for o in model.graph.outputs] == [o.name for o in original.graph.output]

    rng = np.random.default_rng(rank)
    extra = [3] * (rank - 2)
    feeds = {"scores": rng.standard_normal([5, 7, *extra]).astype(np.float32),
             "labels": rng.integers(0, 7, [5, *extra]).astype(np.int64)}
    if weights:
        feeds["weights"] = rng.uniform(0.5, 2.0, 7).astype(np.float32)
    expected = _run(original, feeds)
    got = _run(io.to_proto(model), feeds)
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)


def test_graphs_without_the_op_are_untouched():
    graph = helper.make_graph([helper.make_node("LogSoftmax", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert not SplitCrossEntropyPass()(model).modified
