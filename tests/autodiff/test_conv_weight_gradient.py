"""The Conv weight gradient's three products against PyTorch.

Where the Conv has at least as many output channels as output positions (both static), the
rule sums the batch inside one product; elsewhere it sums per-sample products, with the patches
as the left operand for up to 64 output channels. The gradient table (tests/autodiff/rows/conv.py)
checks them against finite differences at small sizes; these tests check which one each shape
takes and that each gives PyTorch's gradient.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder

torch = pytest.importorskip("torch")

# name: (input shape, weight shape, stride, padding, the product it takes)
CASES = {
    "deep_small_plane": ([8, 16, 4, 4], [64, 16, 3, 3], 1, 1, "one"),
    "strided_to_a_small_plane": ([4, 8, 9, 9], [32, 8, 3, 3], 2, 1, "one"),
    "as_many_channels_as_positions": ([3, 4, 6, 6], [16, 4, 3, 3], 2, 1, "one"),
    "wide_plane": ([4, 8, 12, 12], [16, 8, 3, 3], 1, 1, "patches_first"),
    "symbolic_plane": ([2, 4, "H", "W"], [64, 4, 3, 3], 1, 1, "patches_first"),
    "many_channels_wide_plane": ([2, 8, 12, 12], [96, 8, 3, 3], 1, 1, "per_sample"),
}


def _weight_gradient_model(x_shape, w_shape, stride: int, padding: int) -> ir.Model:
    graph = ir.Graph([], [], nodes=[], opset_imports={"": 18})
    b = GraphBuilder(graph)
    x = b.input("x", ir.DataType.FLOAT, x_shape)
    w = b.input("w", ir.DataType.FLOAT, w_shape)
    y = b.op.Conv(x, w, strides=[stride, stride], pads=[padding] * 4)
    y.name = "y"
    graph.outputs.append(y)
    model = io.load_model(ir.Model(graph, ir_version=8))  # with the shapes onnx infers, as real graphs have
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    y = graph.outputs[0]
    b = GraphBuilder(graph)
    dy = b.input("dy", ir.DataType.FLOAT, None)
    dw = b.op.Identity(build_gradients(graph, y, [inputs["w"]], loss_grad=dy)[inputs["w"]])
    dw.name = "dw"
    graph.outputs.clear()
    graph.outputs.append(dw)
    return model


def _product(model: ir.Model) -> str:
    """Which product the weight gradient runs: none summed after (one over the batch), or the
    per-sample sum transposed after (the patches first), or neither."""
    sums = [n for n in model.graph if n.op_type == "ReduceSum"]
    if not sums:
        return "one"
    def transposed(value: ir.Value) -> bool:  # read by a Transpose, through Reshapes
        return any(use.op_type == "Transpose" or (use.op_type == "Reshape" and transposed(use.outputs[0]))
                   for use, _ in value.uses())

    return "patches_first" if any(transposed(n.outputs[0]) for n in sums) else "per_sample"


@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_gradient_matches_torch(name):
    x_shape, w_shape, stride, padding, product = CASES[name]
    model = _weight_gradient_model(x_shape, w_shape, stride, padding)
    assert _product(model) == product
    concrete = [7 if d == "H" else 6 if d == "W" else d for d in x_shape]
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(concrete).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal(w_shape).astype(np.float32)).requires_grad_()
    y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    dy = torch.from_numpy(rng.standard_normal(list(y.shape)).astype(np.float32))
    y.backward(dy)
    session = ort.InferenceSession(io.serialize(model), providers=["CPUExecutionProvider"])
    (dw,) = session.run(["dw"], {"x": x.numpy(), "w": w.detach().numpy(), "dy": dy.numpy()})
    np.testing.assert_allclose(dw, w.grad.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(w.grad.numpy()).max()))
