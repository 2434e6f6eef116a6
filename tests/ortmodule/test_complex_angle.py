"""``torch.angle`` of a complex tensor is ORTModule's atan2 (complex translations registered
with the exporter, torch/_exporter.py registry): torchlib's gave -π on the negative real axis
with a +0 imaginary part and NaN gradients where the real part is 0. Complex outputs come back
complex (they were the graph's real float pairs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class _Angle(torch.nn.Module):
    def forward(self, real, imaginary):
        return torch.complex(real, imaginary).angle()


class _SpectrumPhase(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.fft.rfft(x * self.gain).angle()


def test_angle_on_the_axes_and_its_gradient_are_pytorchs():
    real = torch.tensor([-1.0, 0.0, 0.0, 1.0, -2.0, 0.0])
    imaginary = torch.tensor([0.0, 1.0, -2.0, 1.0, 1.0, 0.0])
    results = []
    for module in (_Angle(), ORTModule(_Angle(), debug_options=DebugOptions(fallback=False))):
        re, im = real.clone().requires_grad_(), imaginary.clone().requires_grad_()
        out = module(re, im)
        out.backward(torch.linspace(0.5, 1.5, 6))
        results.append((out.detach(), re.grad, im.grad))
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs)


def test_the_phase_of_a_real_spectrum_trains_as_eager():
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    eager, wrapped = _SpectrumPhase(), ORTModule(_SpectrumPhase(), debug_options=DebugOptions(fallback=False))
    expected, out = eager(x), wrapped(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # DC and Nyquist bins: ±π alike
    expected.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(wrapped.module.gain.grad, eager.gain.grad, rtol=1e-4, atol=1e-4)


class _Spectra(torch.nn.Module):
    """Complex outputs, one with a parameter's gradient, next to a real one."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor([1.5, -0.5, 2.0, 1.0, 0.25, 3.0]))

    def forward(self, x):
        spectrum = torch.fft.rfft(x * self.gain)
        return {"spectrum": spectrum, "cast": x.cfloat(), "power": spectrum.abs().square().sum()}


def test_complex_outputs_stay_complex_and_carry_their_gradients():
    """A complex output came back as a float tensor with a last axis of 2 (the ONNX graph's form)."""
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    results = []
    for module in (_Spectra(), ORTModule(_Spectra(), debug_options=DebugOptions(fallback=False))):
        source = x.clone().requires_grad_()
        out = module(source)
        assert out["spectrum"].dtype == torch.complex64 and out["cast"].dtype == torch.complex64
        weights = torch.linspace(-1.0, 2.0, out["spectrum"].numel()).reshape(out["spectrum"].shape)
        loss = (out["spectrum"].real * weights + out["spectrum"].imag).sum() + out["power"] \
            + out["cast"].real.sum() * 0.5
        loss.backward()
        gain = module.gain if isinstance(module, _Spectra) else module.module.gain
        results.append((out["spectrum"].detach(), out["cast"].detach(), source.grad, gain.grad))
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
