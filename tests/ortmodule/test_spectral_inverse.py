"""``torch.fft.irfft`` / ``irfft2`` / ``hfft`` (a one-sided inverse DFT) train in ONNX Runtime with
PyTorch's gradient: a Fourier neural operator's spectral convolution (rfft, complex weights on
the lowest modes mixed by a complex ``einsum``, a complex ``torch.zeros`` for the other modes,
irfft back to the grid) and a Hermitian transform, even and odd lengths. (Writing the modes into
the zeros in place, as FNO's reference code does, fails PyTorch's own capture: slice_scatter has
no complex autograd there; such a module runs in PyTorch.)"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class SpectralConv1d(torch.nn.Module):
    """FNO's layer: keep the lowest ``modes`` frequencies, mix channels there with complex weights."""

    def __init__(self, channels=3, modes=4):
        super().__init__()
        self.modes = modes
        self.real = torch.nn.Parameter(torch.randn(channels, channels, modes) / channels)
        self.imag = torch.nn.Parameter(torch.randn(channels, channels, modes) / channels)
        self.skip = torch.nn.Conv1d(channels, channels, 1)

    def forward(self, x):  # [batch, channels, length]
        spectrum = torch.fft.rfft(x)
        weights = torch.complex(self.real, self.imag)
        mixed = torch.einsum("bim,iom->bom", spectrum[..., :self.modes], weights)
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
        out = torch.cat([mixed, out[..., self.modes:]], dim=-1)  # (written in place, the capture fails)
        return torch.nn.functional.gelu(torch.fft.irfft(out, n=x.shape[-1]) + self.skip(x))


class SpectralConv2d(torch.nn.Module):
    def __init__(self, channels=2):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(channels, 1, 1) + 1.0)

    def forward(self, x):  # [batch, channels, h, w]
        spectrum = torch.fft.rfft2(x * self.gain)
        return torch.fft.irfft2(spectrum * spectrum.abs().tanh(), s=x.shape[-2:])


class Hermitian(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 10)

    def forward(self, x):
        h = self.linear(x)
        return torch.fft.hfft(torch.complex(h[..., :5], h[..., 5:]), n=9)


def _assert_trains_like_eager(eager, x):
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    ours_input, eager_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = wrapped(ours_input), eager(eager_input)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    weights = torch.randn(theirs.shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_input.grad, eager_input.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(wrapped.module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("length", [16, 15])
def test_a_fourier_neural_operator_layer(length):
    torch.manual_seed(0)
    _assert_trains_like_eager(SpectralConv1d(), torch.randn(2, 3, length))


def test_a_two_dimensional_spectral_filter():
    torch.manual_seed(0)
    _assert_trains_like_eager(SpectralConv2d(), torch.randn(2, 2, 6, 7))


def test_a_hermitian_transform():
    torch.manual_seed(0)
    _assert_trains_like_eager(Hermitian(), torch.randn(3, 6))
