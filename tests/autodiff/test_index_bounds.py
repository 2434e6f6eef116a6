"""Indices that cannot be negative (clamped at 0, as DeBERTa's relative positions are; sizes;
ArgMax's) skip the wrap of negative indices (a Less and a Where over all the indices) in a
gather's gradient; others keep it. The gradients are exact either way."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.autodiff.rules.index import never_negative
from onnxtrain.ir import io


def _gather_model(index_ops: list, op_type: str = "GatherElements"):
    """loss = sum(GatherElements(x, index, axis=1) * w), the index computed from the int64 graph
    input ``raw`` by ``index_ops`` (helper.make_node arguments, each reading the last output)."""
    nodes, last, initializers = [], "raw", []
    for k, (kind, extra, attrs) in enumerate(index_ops):
        for j, value in enumerate(extra):
            initializers.append(helper.make_tensor(f"c{k}_{j}", TensorProto.INT64, np.shape(value),
                                                   np.reshape(value, -1).tolist()))
        nodes.append(helper.make_node(kind, [last, *[f"c{k}_{j}" for j in range(len(extra))]], [f"i{k}"], **attrs))
        last = f"i{k}"
    nodes += [helper.make_node(op_type, ["x", last], ["g"], axis=1), helper.make_node("Mul", ["g", "w"], ["m"]),
              helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5]), helper.make_tensor_value_info("raw", TensorProto.INT64, [3, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


CLAMPED = [("Clip", [0, 4], {})]  # torch.clamp(raw, 0, 4)
CASES = {
    "clamped": (CLAMPED, True),
    "clamped-expanded": ([("Clip", [0, 4], {}), ("Reshape", [[3, 4]], {}), ("Expand", [[3, 4]], {})], True),
    "max-with-zero": ([("Max", [0], {}), ("Min", [4], {})], True),
    "clamped-plus-clamped": ([("Clip", [0, 2], {}), ("Add", [[[0, 1, 2, 2]]], {})], True),
    "bounded-above-only": ([("Clip", [np.iinfo(np.int64).min, 4], {})], False),
    "raw": ([("Identity", [], {})], False),
    "clamped-minus-one": ([("Clip", [0, 4], {}), ("Sub", [1], {})], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_gather_gradient_wraps_only_indices_that_may_be_negative(case):
    index_ops, non_negative = CASES[case]
    model = _gather_model(index_ops)
    graph = model.graph
    x, index_value = graph.inputs[0], graph.node(len(index_ops) - 1).outputs[0]
    assert never_negative(index_value) == non_negative
    before = len(list(graph))
    dx = build_gradients(graph, graph.outputs[0], [x])[x]
    added = [node.op_type for node in list(graph)[before:]]
    assert ("Less" in added) != non_negative
    graph.outputs.extend([index_value, dx])
    rng = np.random.default_rng(0)
    # raw in [-5, 5): every case's ops keep the indices valid for x's 5 columns
    feeds = {"x": rng.standard_normal((3, 5)).astype(np.float32), "raw": rng.integers(-5, 5, (3, 4)),
             "w": rng.standard_normal((3, 4)).astype(np.float32)}
    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    index, got = session.run([index_value.name, dx.name], feeds)
    expected = np.zeros((3, 5), np.float32)
    np.add.at(expected, (np.arange(3)[:, None].repeat(4, 1), index % 5), feeds["w"])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
