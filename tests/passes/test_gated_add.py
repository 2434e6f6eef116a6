"""GatedAddFusionPass: X + Y * r and X - Y * r (r constant per row) -> com.microsoft.GatedAdd, same values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.gated_add import GatedAddFusionPass
from onnxtrain.runtime import fusions
from tests.passes._graphs import model_of, run

F16, F64 = TensorProto.FLOAT16, TensorProto.DOUBLE


def _node(op, inputs, output):
    return helper.make_node(op, inputs, [output])


XY = [("x", [3, 5]), ("y", [3, 5])]
MUL_YR = _node("Mul", ["y", "r"], "p")
# name: (nodes, inputs, fused?)
CASES = {
    "add_scalar": ([MUL_YR, _node("Add", ["x", "p"], "out")], XY + [("r", [])], True),
    "add_product_first": ([_node("Mul", ["r", "y"], "p"), _node("Add", ["p", "x"], "out")], XY + [("r", [1])], True),
    "sub_scalar": ([MUL_YR, _node("Sub", ["x", "p"], "out")], XY + [("r", [])], True),
    "row_gate": ([MUL_YR, _node("Add", ["x", "p"], "out")], XY + [("r", [3, 1])], True),
    "row_gate_sub_3d": ([MUL_YR, _node("Sub", ["x", "p"], "out")],
                        [("x", [2, 3, 5]), ("y", [2, 3, 5]), ("r", [2, 1, 1])], True),
    "symbolic_rows": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", ["N", 5]), ("y", ["N", 5]), ("r", [])], True),
    "symbolic_row_gate": ([MUL_YR, _node("Sub", ["x", "p"], "out")],
                          [("x", ["N", 4, 5]), ("y", ["N", 4, 5]), ("r", ["N", 4, 1])], True),
    "vector": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", [7]), ("y", [7]), ("r", [])], True),
    # both addends are products: one of them is fused, the other stays a Mul
    "two_products": ([MUL_YR, _node("Mul", ["x", "s"], "q"), _node("Add", ["q", "p"], "out")],
                     XY + [("r", []), ("s", [])], True),
    # not fusable
    "r_varies_along_last_axis": ([MUL_YR, _node("Add", ["x", "p"], "out")], XY + [("r", [5])], False),
    "y_broadcasts": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", [3, 5]), ("y", [1, 5]), ("r", [])], False),
    "x_broadcasts": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", [1, 5]), ("y", [3, 5]), ("r", [])], False),
    "product_read_twice": ([MUL_YR, _node("Add", ["x", "p"], "out"), _node("Relu", ["p"], "out2")],
                           XY + [("r", [])], False),
    "product_minus": ([MUL_YR, _node("Sub", ["p", "x"], "out")], XY + [("r", [])], False),
    "different_symbols": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", ["N", 5]), ("y", ["M", 5]), ("r", [])],
                          False),
    "unknown_rank": ([MUL_YR, _node("Add", ["x", "p"], "out")], [("x", None), ("y", None), ("r", [])], False),
}


def _feeds(inputs, dtype, rng):
    sizes = {"N": 4, "M": 4}
    return {n: rng.standard_normal([sizes.get(d, d) for d in ([3, 5] if s is None else s)]).astype(dtype) for n, s in inputs}


@pytest.mark.parametrize("case", list(CASES))
def test_fusion_keeps_values(case):
    nodes, inputs, fused = CASES[case]
    outputs = ["out", "out2"] if case == "product_read_twice" else ["out"]
    original = model_of(nodes, inputs, outputs)
    model = io.load_model(original)
    assert GatedAddFusionPass()(model).modified == fused
    ops = [n.op_type for n in model.graph]
    assert ops.count("GatedAdd") == int(fused)
    if fused:
        assert "Add" not in ops and "Sub" not in ops
        assert ops.count("Mul") == (1 if case == "two_products" else 0)
        assert model.opset_imports["com.microsoft"] == 1
    feeds = _feeds(inputs, np.float32, np.random.default_rng(0))
    for expected, got in zip(run(original, feeds), run(io.to_proto(model), feeds)):
        # float32: the product is rounded before the add, exactly as Mul then Add
        np.testing.assert_array_equal(got, expected)


def test_float16_fused_and_close():
    nodes, inputs, _ = CASES["row_gate"]
    original = model_of(nodes, inputs, ["out"], elem=F16)
    model = io.load_model(original)
    assert GatedAddFusionPass()(model).modified
    feeds = _feeds(inputs, np.float16, np.random.default_rng(1))
    (expected,), (got,) = run(original, feeds), run(io.to_proto(model), feeds)
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_double_is_left_alone():
    nodes, inputs, _ = CASES["add_scalar"]
    model = io.load_model(model_of(nodes, inputs, ["out"], elem=F64))
    assert not GatedAddFusionPass()(model).modified


def test_symbolic_rows_need_opset_15():
    """The gate of a symbolic shape is read with Shape(end=-1), which opset 15 introduced."""
    nodes, inputs, _ = CASES["symbolic_rows"]
    model = io.load_model(model_of(nodes, inputs, ["out"], opset=14))
    assert not GatedAddFusionPass()(model).modified
    static = io.load_model(model_of(*CASES["add_scalar"][:2], ["out"], opset=14))
    assert GatedAddFusionPass()(static).modified


def test_for_session_only_rewrites_for_cpu_alone():
    nodes, inputs, _ = CASES["add_scalar"]
    model = io.load_model(model_of(nodes, inputs, ["out"]))
    assert not fusions.for_session(model, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert [n.op_type for n in model.graph] == ["Mul", "Add"]
    assert fusions.for_session(model, [("CPUExecutionProvider", {})])
    assert [n.op_type for n in model.graph if n.op_type != "Constant"] == ["Expand", "GatedAdd"]


def test_shapes_are_inferred_first():
    """Intermediate values without declared shapes (as onnxblock writes them) are fused after inference."""
    nodes = [_node("Relu", ["x"], "xr"), _node("Mul", ["y", "r"], "p"), _node("Sub", ["xr", "p"], "out")]
    model = io.load_model(model_of(nodes, XY + [("r", [])], ["out"]))
    model.graph.node(0).outputs[0].shape = None
    assert not GatedAddFusionPass()(model).modified  # the pass itself needs the shape
    assert fusions.for_session(model, ["CPUExecutionProvider"])
    assert "GatedAdd" in [n.op_type for n in model.graph]


def test_session_model_of_an_optimizer_file(tmp_path):
    """An AdamW optimizer model from the artifacts gets one fusion per moment and one per parameter update;
    the file on disk keeps standard ops."""
    from onnxtrain import onnxblock

    with onnxblock.empty_base():
        block = onnxblock.optim.AdamW()
        block([("w", np.ones((4, 3), np.float32)), ("b", np.ones(3, np.float32))])
    path = tmp_path / "optimizer_model.onnx"
    io.save_model(block.to_ir_model(), path)
    rewritten = fusions.session_model(path, ["CPUExecutionProvider"])
    assert isinstance(rewritten, bytes)
    assert all(n.domain in ("", "ai.onnx") for n in io.load_model(path).graph)
    fused = [n for n in io.load_model(onnx.load_from_string(rewritten)).graph if n.op_type == "GatedAdd"]
    assert len(fused) == 6  # 2 parameters x (first moment, second moment, update)
    assert fusions.session_model(path, ["CUDAExecutionProvider"]) == str(path)
