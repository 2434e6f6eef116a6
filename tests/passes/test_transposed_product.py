"""TransposedProductPass: Transpose(A @ B) -> B^T @ A^T for 2-D products, same values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxtrain.ir import io
from onnxtrain.passes.transposed_product import TransposedProductPass
from tests.passes._graphs import model_of, run

T = dict(perm=[1, 0])
MATMUL = helper.make_node("MatMul", ["a", "b"], ["p"])
TRANSPOSE_P = helper.make_node("Transpose", ["p"], ["out"], **T)
AB = [("a", [4, 6]), ("b", [6, 3])]
CASES = {
    # the weight gradient of x @ W^T: Transpose(X^T @ dY) -> dY^T @ X, no transpose left of X
    "weight_grad": ([helper.make_node("Transpose", ["x"], ["xt"], **T), helper.make_node("MatMul", ["xt", "dy"], ["p"]),
                     TRANSPOSE_P], [("x", ["N", 5]), ("dy", ["N", 3])], True),
    "plain_inputs": ([MATMUL, TRANSPOSE_P], AB, True),
    # the product is read twice: transposing it once is cheaper than a second product
    "product_reused": ([MATMUL, TRANSPOSE_P, helper.make_node("Relu", ["p"], ["out2"])], AB, False),
    "batched": ([MATMUL, helper.make_node("Transpose", ["p"], ["out"], perm=[0, 2, 1])],
                [("a", [2, 4, 6]), ("b", [2, 6, 3])], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transposed_products(case):
    nodes, inputs, rewritten = CASES[case]
    outputs = ["out", "out2"] if case == "product_reused" else ["out"]
    original = model_of(nodes, inputs, outputs)
    model = io.load_model(original)
    assert TransposedProductPass()(model).modified == rewritten
    if rewritten:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
        ops = [n.op_type for n in model.graph]
        assert ops.count("MatMul") == 1 and ops[-1] == "MatMul"
        if case == "weight_grad":  # X^T^T cancelled: only dY is transposed (ORT folds it into FusedMatMul)
            assert ops == ["Transpose", "MatMul"]
            flipped = model.graph.node(0)
            assert flipped.inputs[0].name == "dy"
            assert [str(d) for d in flipped.outputs[0].shape] == ["3", "N"]  # sized for the memory planner
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal([7 if d == "N" else d for d in s]).astype(np.float32) for n, s in inputs}
    for expected, got in zip(run(original, feeds), run(io.to_proto(model), feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
