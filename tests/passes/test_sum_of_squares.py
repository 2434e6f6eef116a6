"""SumOfSquaresPass: a partial ReduceSumSquare -> ReduceSum(Mul(x, x)), same values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnxtrain.ir import io
from onnxtrain.passes.sum_of_squares import SumOfSquaresPass
from tests.passes._graphs import model_of, run


def _sum_square(axes, keepdims, opset, noop=None):
    """A ReduceSumSquare in the form of ``opset`` (axes an attribute before 18, an input from 18)."""
    attrs = {"keepdims": keepdims}
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    if axes is None:
        return [helper.make_node("ReduceSumSquare", ["x"], ["out"], **attrs)]
    if opset < 18:
        return [helper.make_node("ReduceSumSquare", ["x"], ["out"], axes=axes, **attrs)]
    axes_tensor = helper.make_tensor("axes_value", TensorProto.INT64, [len(axes)], axes)
    return [helper.make_node("Constant", [], ["axes"], value=axes_tensor),
            helper.make_node("ReduceSumSquare", ["x", "axes"], ["out"], **attrs)]


# (x shape, axes, keepdims, opset, rewritten)
CASES = {
    "batch_norm_variance": ([4, 3, 5, 6], [0, 2, 3], 1, 18, True),
    "last_axis_no_keepdims": ([8, 16], [-1], 0, 18, True),
    "symbolic_batch": (["B", 3, 5], [0, 2], 1, 18, True),
    "attribute_axes_sum_input": ([4, 3, 5], [1], 1, 13, True),  # ReduceSum takes an axes input from 13
    "attribute_axes_both": ([4, 3, 5], [0, 2], 0, 11, True),
    "every_axis_listed": ([4, 3, 5], [0, 1, 2], 0, 18, False),  # one element: ReduceSumSquare is faster
    "no_axes": ([4, 3, 5], None, 1, 18, False),
    "one_element_kept": ([4, 1, 5], [0, 2], 1, 18, False),
    "empty_axes_noop": ([4, 3, 5], None, 1, 18, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_partial_sums_of_squares_become_sums_of_products(case):
    shape, axes, keepdims, opset, rewritten = CASES[case]
    original = model_of(_sum_square(axes, keepdims, opset, noop=1 if case == "empty_axes_noop" else None),
                        [("x", shape)], ["out"], opset=opset)
    model = io.load_model(original)
    assert SumOfSquaresPass()(model).modified == rewritten
    RemoveUnusedNodesPass()(model)
    ops = [n.op_type for n in model.graph]
    assert ("ReduceSumSquare" in ops) != rewritten and ("ReduceSum" in ops) == rewritten
    feeds = {"x": np.random.default_rng(0).standard_normal([5 if d == "B" else d for d in shape]).astype(np.float32)}
    (expected,), (got,) = run(original, feeds), run(io.to_proto(model), feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_double_is_rewritten_and_the_output_keeps_its_name():
    original = model_of(_sum_square([1], 0, 18), [("x", [6, 4])], ["out"], elem=TensorProto.DOUBLE)
    model = io.load_model(original)
    assert SumOfSquaresPass()(model).modified
    assert [v.name for v in model.graph.outputs] == ["out"]
    x = np.random.default_rng(1).standard_normal([6, 4])
    (got,) = run(io.to_proto(model), {"x": x})
    np.testing.assert_allclose(got, (x * x).sum(1), rtol=1e-12)


def test_integer_and_run_time_axes_are_left_alone():
    integers = model_of(_sum_square([1], 1, 18), [("x", [4, 3])], ["out"], elem=TensorProto.INT64)
    assert not SumOfSquaresPass()(io.load_model(integers)).modified
    run_time = model_of([helper.make_node("ReduceSumSquare", ["x", "axes"], ["out"])],
                        [("x", [4, 3]), ("axes", [1], TensorProto.INT64)], ["out"])
    assert not SumOfSquaresPass()(io.load_model(run_time)).modified
