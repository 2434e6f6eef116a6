"""ORTModule's CPU sessions get the Conv weight gradients' patch Conv; the graph it keeps does not."""

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnxtrain.ir import io  # noqa: E402
from onnxtrain.torch import ORTModule  # noqa: E402
from onnxtrain.torch._bridge import _session_bytes  # noqa: E402
from tests.passes.test_conv_patches import _weight_gradient_model  # noqa: E402


def test_session_bytes_rewrite_a_copy_for_cpu():
    model, _ = _weight_gradient_model("3x3_pads")
    kept = [n.op_type for n in model.graph]
    cpu = onnx.load_from_string(_session_bytes(model, ["CPUExecutionProvider"]))
    assert not [n for n in cpu.graph.node if n.op_type == "Slice" and len(n.input) == 5]  # no tap Slices
    assert any(n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute) for n in cpu.graph.node)
    assert [n.op_type for n in model.graph] == kept  # ORTModule's graph keeps standard ops
    other = onnx.load_from_string(_session_bytes(model, ["CUDAExecutionProvider"]))
    assert [n for n in other.graph.node if n.op_type == "Slice" and len(n.input) == 5]
    assert io.serialize(model) == _session_bytes(model, ["CUDAExecutionProvider"])


def test_conv_net_gradients_match_eager():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(4, 3, 3, stride=2), torch.nn.Flatten(), torch.nn.Linear(27, 5))
    x = torch.randn(6, 2, 8, 8)
    reference = [p.grad.clone() for p in _backward(net, x)]
    wrapped = ORTModule(net)
    ours = [p.grad.clone() for p in _backward(wrapped, x)]
    assert wrapped.fallback_reason is None
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def _backward(module, x):
    for p in module.parameters():
        p.grad = None
    module(x).square().sum().backward()
    return list(module.parameters())
