"""ColumnVectorProductPass: ``Transpose(A) @ v`` with a 1-D ``v`` as a product with a column.

onnxruntime 1.32 fuses ``MatMul(Transpose(A), v)`` into ``FusedMatMul(transA=1)``, whose CPU kernel
gets a 1-D ``v`` wrong; the rewritten graph computes ``A^T v`` at every optimization level.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from onnxtrain.passes.column_product import ColumnVectorProductPass
from tests.passes._graphs import model_of

LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


def _run(proto, feeds, level):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _rewritten(proto):
    model = ir.from_proto(proto)
    modified = ColumnVectorProductPass()(model).modified
    return ir.to_proto(model), modified


CASES = {
    "2d": ([3, 4], [1, 0], [3]),
    "batched": ([2, 3, 4], [0, 2, 1], [3]),
    "reversed-2d": ([3, 4], None, [3]),
}


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("case", list(CASES))
def test_a_transposed_matrix_times_a_vector_is_right_at_every_level(case, opset):
    a_shape, perm, v_shape = CASES[case]
    attrs = {} if perm is None else {"perm": perm}
    proto = model_of([helper.make_node("Transpose", ["a"], ["t"], **attrs), helper.make_node("MatMul", ["t", "v"], ["y"])],
                     [("a", a_shape), ("v", v_shape)], ["y"], opset=opset)
    rewritten, modified = _rewritten(proto)
    assert modified
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "v": rng.standard_normal(v_shape).astype(np.float32)}
    expected = np.swapaxes(feeds["a"], -1, -2) @ feeds["v"]
    for level in LEVELS:
        np.testing.assert_allclose(_run(rewritten, feeds, level), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("what", "nodes", "inputs"), [
    ("column operand", [helper.make_node("Transpose", ["a"], ["t"], perm=[1, 0]), helper.make_node("MatMul", ["t", "v"], ["y"])],
     [("a", [3, 4]), ("v", [3, 2])]),
    ("untransposed matrix", [helper.make_node("MatMul", ["a", "v"], ["y"])], [("a", [4, 3]), ("v", [3])]),
    ("other transpose", [helper.make_node("Transpose", ["a"], ["t"], perm=[2, 0, 1]), helper.make_node("MatMul", ["t", "v"], ["y"])],
     [("a", [3, 2, 4]), ("v", [3])]),
])
def test_other_products_stay(what, nodes, inputs):
    proto = model_of(nodes, inputs, ["y"])
    _, modified = _rewritten(proto)
    assert not modified, what


def test_ortmodule_trains_spectral_norm_like_eager():
    """Spectral normalization's power iteration computes ``W^H u``: ORTModule ran it through the
    wrong fused kernel (outputs off by units) before the rewrite."""
    torch = pytest.importorskip("torch")
    from onnxtrain.torch import ORTModule

    spectral_norm = torch.nn.utils.parametrizations.spectral_norm
    for train in (True, False):
        torch.manual_seed(0)
        eager = spectral_norm(torch.nn.Linear(4, 3)).train(train)
        ours = spectral_norm(torch.nn.Linear(4, 3)).train(train)
        ours.load_state_dict(eager.state_dict())
        wrapped = ORTModule(ours)
        for step in range(2):
            x = torch.randn(5, 4)
            expected, got = eager(x), wrapped(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            expected.square().sum().backward()
            got.square().sum().backward()
            torch.testing.assert_close(ours.parametrizations.weight.original.grad,
                                       eager.parametrizations.weight.original.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.parametrizations.weight[0]._u, eager.parametrizations.weight[0]._u)
