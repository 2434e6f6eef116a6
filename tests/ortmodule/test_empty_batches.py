"""ORTModule trains on a batch of 0 as PyTorch does: the outputs keep their shapes and the
gradients are PyTorch's (zeros from an empty batch, NaN where a mean over nothing is). The
gradient of a sum over the empty batch came back as [1, 5] (onnxruntime's optimizer dropped the
Expand to [0, 5]), and the backward graphs of gathers and resizes did not load (a Reshape to a
shape holding a 0): passes/empty_tensors.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

F = torch.nn.functional

CASES = {
    "sum over the batch": (lambda x: x.sum(0), (0, 5)),
    "mean over an empty dim": (lambda x: x.mean(1), (3, 0)),
    "linear and a mean loss": (lambda x: F.linear(x, torch.ones(2, 5)).mean(0), (0, 5)),
    "gather": (lambda x: x[:, torch.tensor([0, 2])], (0, 5)),
    "nearest interpolation": (lambda x: F.interpolate(x, scale_factor=2), (0, 1, 6)),
    "circular pad": (lambda x: F.pad(x, (1, 1), mode="circular"), (0, 2, 5)),
    "layer norm": (lambda x: F.layer_norm(x, (5,)), (0, 5)),
}


class _Scaled(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.function = function

    def forward(self, x):
        return self.function(x * self.scale)


@pytest.mark.parametrize("name", list(CASES))
def test_a_batch_of_zero_trains_as_in_pytorch(name):
    function, shape = CASES[name]
    eager, wrapped = _Scaled(function), ORTModule(_Scaled(function), DebugOptions(fallback=False))
    x = torch.randn(shape)
    ours_input, eager_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = wrapped(ours_input), eager(eager_input)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    weights = torch.randn(theirs.shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_input.grad, eager_input.grad, equal_nan=True)
    torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad, equal_nan=True)


def test_pixel_shuffle_of_a_batch_of_zero():
    # (PyTorch's own backward fails here: the shapes and zero gradients are checked)
    wrapped = ORTModule(_Scaled(lambda x: F.pixel_shuffle(x, 2)), DebugOptions(fallback=False))
    x = torch.randn(0, 4, 2, 2, requires_grad=True)
    out = wrapped(x)
    assert out.shape == (0, 1, 4, 4)
    out.sum().backward()
    assert x.grad.shape == (0, 4, 2, 2)
    assert wrapped.module.scale.grad == 0
