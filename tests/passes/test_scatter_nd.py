"""Reducing scatters are exact in a multi-threaded onnxruntime session (passes/scatter_nd.py,
ir/scatter.py): onnxruntime's CPU ScatterND adds repeated rows from several threads at once and
loses some of them, so gradients of gathers (embeddings) and models' own accumulating scatters
came out wrong, and differently from run to run."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradients
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.passes.scatter_nd import ReducingScatterNDPass

_REPEATS = 4


def _threaded_session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 4  # more threads than rows per repeated index: the kernel splits them
    return ort.InferenceSession(io.serialize(model), options, providers=["CPUExecutionProvider"])


def _numpy_scatter_nd(data, indices, updates, reduction):
    out = data.astype(np.float64).copy()
    combine = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction]
    depth = indices.shape[-1]
    for index, update in zip(indices.reshape(-1, depth), updates.reshape(-1, *data.shape[depth:])):
        position = tuple(int(i) for i in index)
        out[position] = combine(out[position], update)
    return out


def _scatter_nd_model(data_shape, indices_shape, updates_shape, reduction, opset=18):
    graph = helper.make_graph(
        [helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"], reduction=reduction)], "scatter",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape),
         helper.make_tensor_value_info("indices", TensorProto.INT64, indices_shape),
         helper.make_tensor_value_info("updates", TensorProto.FLOAT, updates_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, data_shape)])
    return io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_reducing_scatter_nd_is_rewritten_and_exact_with_threads(reduction):
    rng = np.random.default_rng(0)
    # 4000 rows of 128 onto 12 distinct positions: enough work for onnxruntime to split the rows
    # over threads (its ScatterND then lost ~2/3 of the sum)
    data = rng.uniform(0.5, 1.5, (3, 4, 128)).astype(np.float32)
    indices = np.stack([rng.integers(-3, 3, (4000,)), rng.integers(0, 2, (4000,))], axis=-1)
    updates = rng.uniform(0.9999, 1.0001 if reduction == "mul" else 2.0, (4000, 128)).astype(np.float32)
    model = _scatter_nd_model([3, 4, 128], ["N", 2], ["N", 128], reduction)
    assert ReducingScatterNDPass()(model).modified
    assert [n.op_type for n in model.graph if n.op_type.startswith("Scatter")] == ["ScatterElements"]
    session = _threaded_session(model)
    expected = _numpy_scatter_nd(data, indices, updates, reduction)
    for _ in range(_REPEATS):
        y, = session.run(None, {"data": data, "indices": indices, "updates": updates})
        np.testing.assert_allclose(y, expected, rtol=1e-4)


def test_scatter_nd_of_whole_elements_and_of_nothing():
    rng = np.random.default_rng(1)
    data = rng.standard_normal((4, 5)).astype(np.float32)
    model = _scatter_nd_model([4, 5], ["N", 2], ["N"], "add")
    ReducingScatterNDPass()(model)
    session = _threaded_session(model)
    indices = np.array([[0, 1], [3, -1], [0, 1], [-4, 1]], np.int64)
    updates = rng.standard_normal(4).astype(np.float32)
    y, = session.run(None, {"data": data, "indices": indices, "updates": updates})
    np.testing.assert_allclose(y, _numpy_scatter_nd(data, indices, updates, "add"), rtol=1e-6)
    y, = session.run(None, {"data": data, "indices": np.zeros((0, 2), np.int64), "updates": np.zeros(0, np.float32)})
    np.testing.assert_array_equal(y, data)


def test_a_scatter_nd_without_reduction_is_left_alone():
    model = _scatter_nd_model([4, 5], ["N", 1], ["N", 5], "none")
    assert not ReducingScatterNDPass()(model).modified


def test_embedding_gradient_over_repeated_tokens_is_exact_with_threads():
    """The gradient of a Gather (an embedding lookup) adds the rows of repeated tokens: exact
    in a session with several threads, on every run."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((5, 128)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["rows"])], "embedding",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["B", "T", 128])],
                              [numpy_helper.from_array(table, "table")])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    graph = model.graph
    weight = graph.initializers["table"]
    b = GraphBuilder(graph)
    seed = b.input("seed", weight.dtype, ["B", "T", 128])
    loss = b.op.ReduceSum(b.op.Mul(graph.outputs[0], seed), keepdims=0)
    gradient = build_gradients(graph, loss, [weight])[weight]
    assert not [n for n in graph if n.op_type == "ScatterND" and n.attributes.get_string("reduction", "none") != "none"]
    graph.outputs.clear()
    graph.outputs.append(gradient)
    session = _threaded_session(model)
    ids = rng.integers(0, 5, (400, 40))
    seed_value = rng.standard_normal((400, 40, 128)).astype(np.float32)
    expected = np.zeros((5, 128))
    np.add.at(expected, ids.reshape(-1), seed_value.reshape(-1, 128).astype(np.float64))
    for _ in range(_REPEATS):
        dx, = session.run(None, {"ids": ids, "seed": seed_value})
        np.testing.assert_allclose(dx, expected, rtol=1e-4, atol=1e-3)


def test_a_position_embeddings_gradient_folds_quietly(caplog):
    """Constant indices (a position embedding's arange): the folder cannot fold the sort's
    two-output TopK and warned once per embedding on every export; it is left to onnxruntime."""
    import logging

    from onnxtrain.passes import pipeline

    table = np.arange(24, dtype=np.float32).reshape(6, 4)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "positions"], ["rows"])], "positions", [],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [3, 4])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(np.array([0, 1, 1], np.int64), "positions")])
    model = io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    weight = model.graph.initializers["table"]
    loss = GraphBuilder(model.graph).op.ReduceSum(model.graph.outputs[0], keepdims=0)
    gradient = build_gradients(model.graph, loss, [weight])[weight]
    model.graph.outputs.clear()
    model.graph.outputs.append(gradient)
    with caplog.at_level(logging.WARNING):
        pipeline.run(model, pipeline.after_autodiff())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    dx, = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"]).run(None, {})
    np.testing.assert_array_equal(dx, [[1] * 4, [2] * 4] + [[0] * 4] * 4)
