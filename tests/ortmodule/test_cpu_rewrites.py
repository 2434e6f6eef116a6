"""ORTModule's CPU sessions get the Conv weight gradients' patch Conv and Convs in onnxruntime's
blocked layout; the graph it keeps does not."""

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnxtrain.ir import io  # noqa: E402
from onnxtrain.passes.nchwc_conv import NCHWC_DOMAIN  # noqa: E402
from onnxtrain.runtime import fusions  # noqa: E402
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


class _BlockedConvNet(torch.nn.Module):
    """Convs that CPU sessions move to the blocked layout: ungrouped (its input gradient a
    stride-1 ConvTranspose), depthwise, a stride-1 ConvTranspose layer, and a deep one over a
    small plane (weight gradient as one product over the batch)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.up = torch.nn.ConvTranspose2d(32, 16, 3, padding=1)
        self.deep = torch.nn.Conv2d(16, 64, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(64 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.conv(torch.relu(self.stem(x))))
        x = torch.nn.functional.gelu(self.up(torch.relu(self.depthwise(x))))
        return self.head(torch.relu(self.deep(x)).flatten(1))


@pytest.mark.skipif(fusions.nchwc_block_size() is None, reason="no blocked Conv kernels for this CPU")
def test_blocked_layout_convs_train_like_eager():
    torch.manual_seed(0)
    net = _BlockedConvNet()
    x = torch.randn(6, 3, 8, 8)
    reference = [p.grad.clone() for p in _backward(net, x)]
    wrapped = ORTModule(net)
    ours = [p.grad.clone() for p in _backward(wrapped, x)]
    assert wrapped.fallback_reason is None
    for (name, _), a, b in zip(net.named_parameters(), ours, reference):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4 * float(b.abs().max()), err_msg=name)
    # the sessions ran blocked Convs: the forward's and the backward's
    sessions = list(_sessions(wrapped))
    assert len(sessions) == 2 and all(any(n.domain == NCHWC_DOMAIN for n in g.node) for g in sessions)


def _sessions(wrapped):
    """The graphs of the forward and backward sessions' bytes, from the graphs ORTModule built."""
    for variants in wrapped._variants.values():
        for variant in variants:
            for programs in variant.training.values():
                for graph in (programs.graphs.forward, programs.graphs.backward):
                    yield onnx.load_from_string(_session_bytes(graph, ["CPUExecutionProvider"])).graph


def _backward(module, x):
    for p in module.parameters():
        p.grad = None
    module(x).square().sum().backward()
    return list(module.parameters())
