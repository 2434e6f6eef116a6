"""Dropout in training mode: the gradient reuses the forward node's random mask.

Finite differences cannot check a random op, so this compares the gradient exactly
with ``dy * mask / (1 - ratio)`` using the mask from the same session run.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnxtrain.autodiff.builder import build_gradients
from onnxtrain.ir import io
from onnxtrain.ir.builder import GraphBuilder

RATIO = 0.3


def _dropout_gradient_model(with_mask_output: bool, opset: int):
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset})
    b = GraphBuilder(graph)
    x = b.input("x", ir.DataType.FLOAT, ["N", 64])
    dy = b.input("dy", ir.DataType.FLOAT, ["N", 64])
    ratio = b.const(np.array(RATIO, np.float32))
    training = b.const(np.array(True))
    outs = b.op.Dropout(x, ratio, training, _outputs=2 if with_mask_output else 1)
    y = outs[0] if with_mask_output else outs
    grads = build_gradients(graph, y, [x], loss_grad=dy)
    dropout = next(n for n in graph if n.op_type == "Dropout")
    mask = dropout.outputs[1]
    for name, value in (("y", y), ("mask", mask), ("dx", grads[x])):
        out = b.op.Identity(value)
        out.name = name
        graph.outputs.append(out)
    return ir.Model(graph, ir_version=8), graph


@pytest.mark.parametrize("with_mask_output", [False, True])
@pytest.mark.parametrize("opset", [13, 23])
def test_dropout_gradient_uses_forward_mask(with_mask_output, opset):
    model, graph = _dropout_gradient_model(with_mask_output, opset)
    dropouts = [n for n in graph if n.op_type == "Dropout"]
    assert len(dropouts) == 1  # the backward draws no new randomness
    assert len(dropouts[0].outputs) == 2

    session = ort.InferenceSession(io.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    dy = rng.standard_normal((5, 64)).astype(np.float32)
    y, mask, dx = session.run(["y", "mask", "dx"], {"x": x, "dy": dy})

    assert mask.dtype == np.bool_
    assert 0 < mask.sum() < mask.size  # the run really dropped something
    keep = np.float32(1) - np.float32(RATIO)
    np.testing.assert_array_equal(dx, np.where(mask, dy, np.float32(0)) / keep)
    np.testing.assert_allclose(y, np.where(mask, x, 0) / keep, rtol=1e-6)
