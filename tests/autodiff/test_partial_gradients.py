"""Gradients given in parts (autodiff/partial.py) summed into one input.

``Region`` (a Slice's, a Gather's of constant contiguous indices): regions that do not overlap
are written side by side with one Concat, not each padded to the input's size and added.
``Rows`` (a Gather's along axis 0, a GatherND's): every lookup's rows are sorted and summed
together, not each scattered into zeros of the input's size.

Each graph reads pieces of ``x`` (an expert's ``W[e]`` taken in a loop, RoPE's two halves, a
recurrence's ``x[:, t]``, each expert's tokens) and multiplies each piece by its own weight, so
x's gradient is known exactly: each weight written at its piece's positions, summed where
pieces overlap.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.ir import io


def _pieces_model(x_shape, pieces, full_use=False):
    """loss = sum_k sum(piece_k(x) * w_k) (+ sum(x * x) with ``full_use``); ``pieces`` are
    ("gather", axis, index) or ("slice", axis, start, end). The weights are graph inputs w0, w1, ..."""
    nodes, inputs, initializers, terms = [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)], [], []
    for k, piece in enumerate(pieces):
        if piece[0] == "gather":
            _, axis, index = piece
            initializers.append(helper.make_tensor(f"i{k}", TensorProto.INT64, np.shape(index),
                                                   np.reshape(index, -1).tolist()))
            nodes.append(helper.make_node("Gather", ["x", f"i{k}"], [f"p{k}"], axis=axis, name=f"piece{k}"))
        else:
            _, axis, start, end = piece
            for name, value in (("s", start), ("e", end), ("a", axis)):
                initializers.append(helper.make_tensor(f"{name}{k}", TensorProto.INT64, [1], [value]))
            nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", f"a{k}"], [f"p{k}"], name=f"piece{k}"))
        inputs.append(helper.make_tensor_value_info(f"w{k}", TensorProto.FLOAT, None))
        nodes += [helper.make_node("Mul", [f"p{k}", f"w{k}"], [f"m{k}"]),
                  helper.make_node("ReduceSum", [f"m{k}"], [f"t{k}"], keepdims=0)]
        terms.append(f"t{k}")
    if full_use:
        nodes += [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["tsq"], keepdims=0)]
        terms.append("tsq")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "pieces", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds_and_expected(x_shape, pieces, full_use=False, seed=0):
    """Random x and weights, and x's exact gradient."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    feeds, expected = {"x": x}, 2 * x if full_use else np.zeros_like(x)
    for k, piece in enumerate(pieces):
        where = [slice(None)] * x.ndim
        where[piece[1]] = piece[2] if piece[0] == "gather" else slice(piece[2], piece[3])
        feeds[f"w{k}"] = rng.standard_normal(x[tuple(where)].shape).astype(np.float32)
        expected[tuple(where)] += feeds[f"w{k}"]
    return feeds, expected


def _x_gradient_model(model):
    """``model`` with x's gradient as its output ``dx``."""
    model = io.load_model(model)
    graph = model.graph
    x = graph.inputs[0]
    dx = build_gradients(graph, graph.outputs[0], [x])[x]
    dx.name = "dx"
    graph.outputs.append(dx)
    return model


def _x_gradient_graph(model):
    return _x_gradient_model(model).graph


def _x_gradient(model, feeds):
    session = ort.InferenceSession(io.to_proto(_x_gradient_model(model)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(["dx"], feeds)[0]


def _count(graph, op_type):
    return sum(node.op_type == op_type for node in graph)


EXPERTS = [("gather", 0, 0), ("gather", 0, 2), ("gather", 0, 3), ("gather", 0, 5)]
ROTATE_HALF = [("slice", 2, 0, 3), ("slice", 2, 3, 2 ** 62)]
STEPS = [("gather", 1, t) for t in range(4)]


@pytest.mark.parametrize(("x_shape", "pieces", "pads"), [
    ([6, 3, 4], EXPERTS, 0),  # W[e] per expert, experts 1 and 4 idle: zeros between
    (["B", 2, 6], ROTATE_HALF, 0),  # x[..., :3], x[..., 3:]: no zeros at all
    ([2, 4, 3], STEPS, 0),  # x[:, t] for every t of a recurrence
    # x[2] overlaps x[1:3]: x[0], x[1:3] and x[-1] joined, x[2] padded and added
    ([5, 2], [("gather", 0, 0), ("slice", 0, 1, 3), ("gather", 0, 2), ("gather", 0, -1)], 1),
])
def test_disjoint_regions_are_joined_by_one_concat(x_shape, pieces, pads):
    shape = [3 if isinstance(d, str) else d for d in x_shape]
    model = _pieces_model(x_shape, pieces)
    feeds, expected = _feeds_and_expected(shape, pieces)
    np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)
    graph = _x_gradient_graph(model)
    joined = [n for n in graph if n.op_type == "Concat" and n.outputs[0].dtype == ir.DataType.FLOAT]
    assert len(joined) == 1
    assert _count(graph, "Pad") == pads
    # the builder adds nothing but the lists (and no reducing scatter stands in for the pieces)
    assert _count(graph, "Add") == pads
    assert _count(graph, "ScatterND") == _count(graph, "ScatterElements") == 0
    check_gradients(model, feeds, wrt=["x"])


def test_an_axis_of_unknown_size_ends_with_zeros_of_the_remaining_length():
    """x[0], x[1] of x with a dynamic first axis: the zeros after them are Shape(x)[0] - 2 long
    (none when x has two rows)."""
    pieces = [("gather", 0, 0), ("gather", 0, 1)]
    model = _pieces_model(["N", 3], pieces, full_use=True)
    assert [n for n in _x_gradient_graph(model) if n.op_type == "Concat" and n.outputs[0].dtype == ir.DataType.FLOAT]
    for rows in (2, 5):
        feeds, expected = _feeds_and_expected([rows, 3], pieces, full_use=True, seed=rows)
        np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)


def test_regions_along_different_axes_are_summed_separately():
    pieces = [("gather", 0, 1), ("gather", 0, 2), ("slice", 1, 0, 2), ("slice", 1, 2, 4)]
    model = _pieces_model([3, 4], pieces, full_use=True)
    feeds, expected = _feeds_and_expected([3, 4], pieces, full_use=True)
    np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)
    assert _count(_x_gradient_graph(model), "Pad") == 0


def test_an_empty_slice_joins_as_nothing():
    pieces = [("slice", 0, 1, 1), ("slice", 0, 2, 4), ("gather", 0, 0)]
    model = _pieces_model([4, 2], pieces)
    feeds, expected = _feeds_and_expected([4, 2], pieces)
    np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)


def _rows_model(x_shape, index_shapes, gather_nd_depth=None):
    """loss = sum_k sum(Gather(x, i_k, axis=0) * w_k) (+ sum(GatherND(x, j) * v)): several
    lookups of one table with indices given at run time (each expert's tokens)."""
    nodes, terms = [], []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    for k, shape in enumerate(index_shapes):
        inputs += [helper.make_tensor_value_info(f"i{k}", TensorProto.INT64, shape),
                   helper.make_tensor_value_info(f"w{k}", TensorProto.FLOAT, None)]
        nodes += [helper.make_node("Gather", ["x", f"i{k}"], [f"p{k}"], axis=0),
                  helper.make_node("Mul", [f"p{k}", f"w{k}"], [f"m{k}"]),
                  helper.make_node("ReduceSum", [f"m{k}"], [f"t{k}"], keepdims=0)]
        terms.append(f"t{k}")
    if gather_nd_depth:
        inputs += [helper.make_tensor_value_info("j", TensorProto.INT64, ["K", gather_nd_depth]),
                   helper.make_tensor_value_info("v", TensorProto.FLOAT, None)]
        nodes += [helper.make_node("GatherND", ["x", "j"], ["q"]), helper.make_node("Mul", ["q", "v"], ["mq"]),
                  helper.make_node("ReduceSum", ["mq"], ["tq"], keepdims=0)]
        terms.append("tq")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "rows", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_rows_gathered_by_several_lookups_are_summed_by_one_sort():
    """Three lookups of x's rows (indices repeated within and across them, negative ones
    counted from the end) and a GatherND of single elements: one sort for the lookups, one
    for the GatherND (its rows are x's elements), one scatter each and one Add."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal([6, 4]).astype(np.float32)
    indices = [np.array([0, 5, 0, 2]), np.array([[5, -1], [3, 0]]), np.array([1])]
    element_index = np.array([[0, 1], [5, 3], [0, 1]])
    feeds, expected = {"x": x}, np.zeros_like(x)
    for k, index in enumerate(indices):
        feeds[f"i{k}"] = index
        feeds[f"w{k}"] = rng.standard_normal([*index.shape, 4]).astype(np.float32)
        np.add.at(expected, index % 6, feeds[f"w{k}"])
    feeds["j"], feeds["v"] = element_index, rng.standard_normal([3]).astype(np.float32)
    np.add.at(expected, (element_index[:, 0], element_index[:, 1]), feeds["v"])
    model = _rows_model([6, 4], [[4], [2, 2], [1]], gather_nd_depth=2)
    np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)
    graph = _x_gradient_graph(model)
    assert _count(graph, "TopK") == 2
    assert _count(graph, "ScatterND") == 2
    assert sum(n.op_type == "Add" and n.outputs[0].dtype == ir.DataType.FLOAT for n in graph) == 1
    check_gradients(model, feeds, wrt=["x"])


def test_windows_computed_from_constants_are_summed_from_a_table_built_with_the_graph():
    """as_strided's windows as torchlib writes them: Gather(x, Add(starts [3, 1], offsets [1, 4]))
    over overlapping windows. The index is evaluated when the gradient is built: no sort, no
    prefix sums, each row's sources gathered and summed; the windows cover every row of x, so
    the sums are its gradient, with no scatter."""
    starts = helper.make_tensor("starts", TensorProto.INT64, [3, 1], [0, 2, 4])
    offsets = helper.make_tensor("offsets", TensorProto.INT64, [1, 4], [0, 1, 2, 3])
    nodes = [helper.make_node("Add", ["starts", "offsets"], ["windows"]),
             helper.make_node("Gather", ["x", "windows"], ["p"], axis=0),
             helper.make_node("Mul", ["p", "w"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "windows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
                                                 helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [starts, offsets])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal([8]).astype(np.float32), "w": rng.standard_normal([3, 4]).astype(np.float32)}
    expected = np.zeros([8], np.float32)
    np.add.at(expected, np.add([[0], [2], [4]], [[0, 1, 2, 3]]), feeds["w"])
    np.testing.assert_allclose(_x_gradient(model, feeds), expected, rtol=1e-6, atol=1e-6)
    graph = _x_gradient_graph(model)
    assert _count(graph, "TopK") == _count(graph, "CumSum") == _count(graph, "NonZero") == 0
    assert _count(graph, "ReduceSum") == 2  # the loss's and the windows' sums
    assert _count(graph, "ScatterND") == 0
    check_gradients(model, feeds, wrt=["x"])
