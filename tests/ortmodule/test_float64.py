"""float64 models train with float64 accuracy (gradcheck-style comparisons, precision debugging)."""

from __future__ import annotations

import copy

import pytest

from tests.torch_models import torch

from onnxtrain.torch import DebugOptions, ORTModule


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_statistics_are_float64_for_a_float64_model(with_bias):
    """onnxruntime keeps LayerNormalization's statistics in float32 (it has no float64-stash
    kernel): the gradients of a float64 model were accurate to ~1e-8 only."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16, bias=with_bias),
                                torch.nn.Tanh()).double()
    with torch.no_grad():
        eager[1].weight.uniform_(0.5, 1.5)
    model = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x = (torch.randn(4, 16, dtype=torch.float64) * 3 + 1).requires_grad_()
    x_eager = x.detach().clone().requires_grad_()
    weights = torch.randn(4, 16, dtype=torch.float64)
    out, ref = model(x), eager(x_eager)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


class _Scalars(torch.nn.Module):
    """Python numbers in a float64 forward: a product, a sum, clamp and hardtanh bounds, BatchNorm's
    momentum and eps; and a tanh-approximate GELU (onnxruntime's float64 kernel has float32 constants)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8, momentum=0.3, eps=1e-3)

    def forward(self, x):
        h = self.norm(self.linear(x)) * 0.7978845608028654 + 0.1
        return (torch.clamp(h, -0.3, 0.7) + torch.nn.functional.hardtanh(h, -0.45, 0.35) + h * h
                + torch.nn.functional.gelu(h, approximate="tanh"))


def test_python_numbers_of_a_float64_forward_are_float64():
    # the exporter writes a Python number as a float32 constant cast to double: 0.1 was float32's 0.1
    torch.manual_seed(0)
    eager = _Scalars().double()
    model = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x = torch.randn(6, 8, dtype=torch.float64) * 2
    out, ref = model(x), eager(x)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-11, msg=name)
    torch.testing.assert_close(model.norm.running_var, eager.norm.running_var, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("function", [torch.lgamma, torch.digamma, lambda t: torch.polygamma(1, t)],
                         ids=["lgamma", "digamma", "trigamma"])
def test_the_gamma_family_is_float64_accurate(function):
    """A float64 lgamma/digamma/trigamma (torch.distributions' log-probabilities of a float64
    model) failed to load (float32 constants in float64 arithmetic), and their float32 series
    stop at ~1e-10: float64 takes a series to 1e-17. lgamma and digamma and their gradients
    match PyTorch's to ~1e-14 (PyTorch's own float64 trigamma is accurate to ~1e-9 only, so
    trigamma is compared to the derivative of PyTorch's digamma by finite differences)."""
    class Gamma(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.points = torch.nn.Parameter(torch.tensor([-3.3, -0.7, 0.2, 0.5, 1.0, 2.5, 5.9, 6.1, 11.7, 40.0],
                                                          dtype=torch.float64))

        def forward(self, x):
            return function(self.points * x)

    eager = Gamma()
    model = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    x = torch.ones(10, dtype=torch.float64)
    out = model(x)
    out.sum().backward()
    if function in (torch.lgamma, torch.digamma):
        ref = eager(x)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
        if function is torch.lgamma:
            torch.testing.assert_close(model.module.points.grad, eager.points.grad, rtol=1e-13, atol=1e-13)
    else:
        points, step = eager.points.detach(), 1e-6
        derivative = (torch.digamma(points + step) - torch.digamma(points - step)) / (2 * step)
        torch.testing.assert_close(out, derivative, rtol=1e-8, atol=1e-8)
