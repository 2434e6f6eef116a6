"""Complex parameters, arguments and buffers train in ONNX Runtime as in eager.

The exporter holds a complex tensor as a real one with a last axis of 2 (real and imaginary
parts). ORTModule hands the graphs such tensors as their real views (``torch.view_as_real``),
through which autograd returns PyTorch's complex gradients; before, a complex parameter or
argument failed the run (onnxruntime takes no complex tensor through DLPack). A Fourier neural
operator's spectral layer as published (``out_ft[:, :, :modes1, :modes2] = einsum(...)`` with
``cfloat`` weights) failed to export (PyTorch's ``slice_scatter`` has no complex derivative);
the capture assigns into the real parts instead. Complex buffers and arguments the forward
changes in place come back complex."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402


class SpectralConv2d(torch.nn.Module):
    """The Fourier neural operator's spectral convolution, as its reference implementation."""

    def __init__(self, in_channels=2, out_channels=3, modes1=3, modes2=3):
        super().__init__()
        self.out_channels, self.modes1, self.modes2 = out_channels, modes1, modes2
        scale = 1 / (in_channels * out_channels)
        self.weights1 = torch.nn.Parameter(scale * torch.rand(in_channels, out_channels, modes1, modes2,
                                                              dtype=torch.cfloat))
        self.weights2 = torch.nn.Parameter(scale * torch.rand(in_channels, out_channels, modes1, modes2,
                                                              dtype=torch.cfloat))
        self.mix = torch.nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], self.out_channels, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat)
        out_ft[:, :, :self.modes1, :self.modes2] = torch.einsum(
            "bixy,ioxy->boxy", x_ft[:, :, :self.modes1, :self.modes2], self.weights1)
        out_ft[:, :, -self.modes1:, :self.modes2] = torch.einsum(
            "bixy,ioxy->boxy", x_ft[:, :, -self.modes1:, :self.modes2], self.weights2)
        return torch.nn.functional.gelu(torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1))) + self.mix(x))


class Assignments(torch.nn.Module):
    """Assignments into a complex tensor, and reads of it, of every indexing kind."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(0.3 * torch.randn(3, 8, dtype=torch.cfloat))

    def forward(self, x):
        z = torch.fft.fft(x) * self.weight        # [B, 3, 8]
        out = torch.zeros_like(z)
        out[..., :4] = z[..., :4] * self.weight[:, :4]
        out[:, 1, 5:7] = 1 + 2j
        out[0] = out[0] + z[0].conj()
        out[:, torch.tensor([2, 0]), 7] = z[:, :2, 7] * 2j
        out[z.real > 0.7] = 0.5
        picked = z[:, -1].unsqueeze(1) * z.select(-1, 2).unsqueeze(-1) + 0.1 * z[z.imag > 0].sum()
        return torch.tanh(torch.view_as_real(out + picked)).sum(-1)


class ComplexArguments(torch.nn.Module):
    """A complex argument (read, and scaled in place) and a complex weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat))

    def forward(self, x, z):
        z.mul_(2)
        return (z @ self.weight).abs() + x.sum(-1, keepdim=True), torch.angle(z.sum(-1))


class SpectrumAverage(torch.nn.Module):
    """A complex buffer updated in place under no_grad (a running spectrum)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("spectrum", torch.zeros(5, dtype=torch.cfloat))

    def forward(self, x):
        z = torch.fft.rfft(self.linear(x))
        with torch.no_grad():
            self.spectrum.mul_(0.9).add_(z.mean(0) * 0.1)
        return torch.view_as_real(z * self.spectrum).sum(-1)


def _step(model, args):
    for p in model.parameters():
        p.grad = None
    outputs = model(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.square().sum() for o in outputs).backward()
    return [o.detach() for o in outputs], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("factory, make_args", [
    (SpectralConv2d, lambda: (torch.randn(2, 2, 8, 8),)),
    (Assignments, lambda: (torch.randn(2, 3, 8),)),
    (ComplexArguments, lambda: (torch.randn(5, 2), torch.randn(5, 4, dtype=torch.cfloat))),
    (SpectrumAverage, lambda: (torch.randn(3, 8),)),
], ids=["fno_spectral_conv", "assignments", "complex_arguments", "complex_buffer"])
def test_complex_tensors_train_in_onnx_runtime_as_in_eager(factory, make_args):
    eager, wrapped = eager_and_wrapped(factory, debug_options=DebugOptions(fallback=False))
    for _ in range(3):
        args = make_args()
        copies = [a.clone() for a in args]
        with warnings.catch_warnings():
            warnings.simplefilter("error", ORTModuleFallbackWarning)
            outputs, grads = _step(wrapped, copies)
        expected, expected_grads = _step(eager, args)
        for output, e in zip(outputs, expected, strict=True):
            torch.testing.assert_close(output, e, rtol=1e-4, atol=1e-5)
        for grad, e in zip(grads, expected_grads, strict=True):
            assert grad.dtype == e.dtype  # complex weights get complex gradients
            # (an element far below the largest is a difference of terms near it: rounding of those)
            torch.testing.assert_close(grad, e, rtol=1e-4, atol=1e-5 + 2e-6 * float(e.abs().max()))
        for changed, e in zip(copies, args, strict=True):  # arguments changed in place
            torch.testing.assert_close(changed, e)
        for buffer, e in zip(wrapped.module.buffers(), eager.buffers(), strict=True):
            assert buffer.dtype == e.dtype
            torch.testing.assert_close(buffer, e, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for p in (*wrapped.module.parameters(), *eager.parameters()):
                p -= 0.05 * p.grad
