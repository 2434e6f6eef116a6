"""LeadingAxesSumPass: ReduceSum over leading axes -> a product with a row of ones, same values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnxtrain.ir import io
from onnxtrain.passes.leading_sum import LeadingAxesSumPass
from tests.passes._graphs import model_of, run


def _sum(axes, keepdims, opset, x="x", out="out"):
    """A ReduceSum node list in the form of ``opset`` (axes an attribute before 13, an input after)."""
    if opset < 13:
        return [helper.make_node("ReduceSum", [x], [out], axes=axes, keepdims=keepdims)]
    axes_tensor = helper.make_tensor("axes_value", TensorProto.INT64, [len(axes)], axes)
    return [helper.make_node("Constant", [], ["axes"], value=axes_tensor),
            helper.make_node("ReduceSum", [x, "axes"], [out], keepdims=keepdims)]


# (x shape, axes, keepdims, opset, rewritten)
CASES = {
    "bias_grad": (["B", 64, 24], [0, 1], 0, 18, True),  # symbolic batch: ones built at run time
    "bias_grad_static": ([8, 16, 24], [0, 1], 0, 18, True),
    "keepdims": ([8, 16, 24], [1, 0], 1, 18, True),  # any order of the leading axes
    "negative_axis": (["B", 16, 24], [-3], 0, 17, True),
    "attribute_axes": ([8, 16, 24], [0, 1], 0, 11, True),
    "symbolic_before_opset_15": (["B", 16, 24], [0, 1], 0, 13, False),  # Shape(x, end=k) needs 15
    "inner_axis": ([8, 16, 24], [1], 0, 18, False),
    "all_axes": ([8, 16, 24], [0, 1, 2], 0, 18, False),
    "symbolic_trailing_dim": ([8, 16, "F"], [0], 0, 18, False),
    "few_rows": ([2, 4, 24], [0, 1], 0, 18, False),  # 8 rows: ReduceSum is as fast
    "no_columns": (["B", 0], [0], 0, 18, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_leading_sums_become_products(case):
    shape, axes, keepdims, opset, rewritten = CASES[case]
    original = model_of(_sum(axes, keepdims, opset), [("x", shape)], ["out"], opset=opset)
    model = io.load_model(original)
    assert LeadingAxesSumPass()(model).modified == rewritten
    RemoveUnusedNodesPass()(model)
    ops = [n.op_type for n in model.graph]
    assert ("ReduceSum" in ops) != rewritten and ("MatMul" in ops) == rewritten
    rng = np.random.default_rng(0)
    for batch in (5, 0) if "B" in shape else (None,):
        feeds = {"x": rng.standard_normal([batch if d == "B" else 7 if d == "F" else d for d in shape]).astype(np.float32)}
        (expected,), (got,) = run(original, feeds), run(io.to_proto(model), feeds)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_summed_graph_output_keeps_its_name_and_double_is_rewritten():
    nodes = _sum([0], 0, 18, out="grad")
    original = model_of(nodes, [("x", [32, 3])], ["grad"], elem=TensorProto.DOUBLE)
    model = io.load_model(original)
    assert LeadingAxesSumPass()(model).modified
    assert [v.name for v in model.graph.outputs] == ["grad"]
    x = np.random.default_rng(1).standard_normal([32, 3])
    (got,) = run(io.to_proto(model), {"x": x})
    np.testing.assert_allclose(got, x.sum(0), rtol=1e-12)


def test_integer_sums_are_left_alone():
    original = model_of(_sum([0, 1], 0, 18), [("x", [8, 16, 4])], ["out"], elem=TensorProto.INT64)
    assert not LeadingAxesSumPass()(io.load_model(original)).modified


def test_sums_over_the_same_symbolic_rows_share_one_row_of_ones():
    """The rows are read off a graph input carrying the symbolic dims (the first one the summed
    value is computed from), so the sums' rows of ones are the same nodes, which the cleanup
    after autodiff merges into one."""
    from onnxtrain.passes import pipeline

    axes = helper.make_tensor("axes_value", TensorProto.INT64, [2], [0, 1])
    nodes = [helper.make_node("Constant", [], ["axes"], value=axes), helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["x", "axes"], ["sx"], keepdims=0),
             helper.make_node("Constant", [], ["last"], value=helper.make_tensor("last_value", TensorProto.INT64, [1], [2])),
             helper.make_node("ReduceMean", ["x", "last"], ["xm"], keepdims=1),
             helper.make_node("Mul", ["y2", "xm"], ["y3"]),
             helper.make_node("ReduceSum", ["y3", "axes"], ["sy"], keepdims=0)]
    original = model_of(nodes, [("x", ["B", "T", 24]), ("y", ["B", "T", 8])], ["sx", "sy"])
    model = io.load_model(original)
    for p in pipeline.after_autodiff():
        p(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMul") == 2 and ops.count("ConstantOfShape") == 1 and ops.count("ReduceProd") == 1
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal([3, 5, 24]).astype(np.float32), "y": rng.standard_normal([3, 5, 8]).astype(np.float32)}
    for got, expected in zip(run(io.to_proto(model), feeds), run(original, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_leading_dim_no_graph_input_carries_is_read_off_the_summed_tensor():
    shape = helper.make_tensor("flat", TensorProto.INT64, [2], [-1, 24])
    nodes = [helper.make_node("Constant", [], ["flat_shape"], value=shape),
             helper.make_node("Reshape", ["x", "flat_shape"], ["rows"]), *_sum([0], 0, 18, x="rows")]
    original = model_of(nodes, [("x", ["B", 4, 24])], ["out"])
    original.graph.value_info.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["N", 24]))
    model = io.load_model(original)
    assert LeadingAxesSumPass()(model).modified
    shapes = [n for n in model.graph if n.op_type == "Shape"]
    assert [n.inputs[0].name for n in shapes] == ["rows"]
    x = np.random.default_rng(3).standard_normal([3, 4, 24]).astype(np.float32)
    (got,) = run(io.to_proto(model), {"x": x})
    np.testing.assert_allclose(got, x.reshape(-1, 24).sum(0), rtol=1e-5, atol=1e-5)


def test_rows_are_read_off_inputs_the_sum_is_computed_from():
    """A forward sum over flattened rows ``[B*T]`` whose dim only another input carries (an output
    gradient's, after autodiff) reads its rows off the summed value: reading them off that input
    made the forward depend on the gradient, and the graph could not be cut (Hugging Face MoE
    models' router loss, ``logits.reshape(-1, E)`` returned and summed over its rows)."""
    axes = helper.make_tensor("axes_value", TensorProto.INT64, [1], [0])
    shape = helper.make_tensor("shape_value", TensorProto.INT64, [2], [-1, 8])
    nodes = [helper.make_node("Constant", [], ["axes"], value=axes), helper.make_node("Constant", [], ["shape"], value=shape),
             helper.make_node("Reshape", ["x", "shape"], ["rows"]),
             helper.make_node("ReduceSum", ["rows", "axes"], ["s"], keepdims=0),
             helper.make_node("Mul", ["g", "g"], ["g2"])]
    original = model_of(nodes, [("x", ["B", "T", 8]), ("g", ["BT", 8])], ["s", "g2"])
    original.graph.value_info.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["BT", 8]))
    model = io.load_model(original)
    assert LeadingAxesSumPass()(model).modified
    summed = next(o for o in model.graph.outputs if o.name == "s")
    upstream, pending = set(), [summed]
    while pending:
        producer = pending.pop().producer()
        if producer is not None:
            upstream.update(producer.inputs)
            pending.extend(v for v in producer.inputs if v is not None)
    assert "g" not in {v.name for v in upstream if v is not None}
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal([3, 5, 8]).astype(np.float32), "g": rng.standard_normal([15, 8]).astype(np.float32)}
    for got, expected in zip(run(io.to_proto(model), feeds), run(original, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
