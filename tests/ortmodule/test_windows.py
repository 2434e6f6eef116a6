"""Window functions built in a forward are PyTorch's (onnxtrain/torch/_windows.py): torchlib's
HammingWindow has other coefficients (the window 0.007 off, an stft with it ~0.03), and the other
forms fell back to PyTorch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

WINDOWS = {
    "hamming": lambda n: torch.hamming_window(n),
    "hamming-symmetric": lambda n: torch.hamming_window(n, periodic=False),
    "hamming-alpha-beta": lambda n: torch.hamming_window(n, True, 0.5, 0.4),
    "hann": lambda n: torch.hann_window(n),
    "blackman-symmetric": lambda n: torch.blackman_window(n, periodic=False),
    "bartlett": lambda n: torch.bartlett_window(n),
    "kaiser": lambda n: torch.kaiser_window(n, True, 8.0),
    "kaiser-default": lambda n: torch.kaiser_window(n),
    "hamming-float64": lambda n: torch.hamming_window(n, dtype=torch.float64),
}


class _Windowed(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.gain * self.window(x.shape[-1]).to(x.dtype)


@pytest.mark.parametrize("name", WINDOWS)
def test_a_window_built_in_forward_is_pytorchs(name):
    module = _Windowed(WINDOWS[name])
    wrapped = ORTModule(_Windowed(WINDOWS[name]), debug_options=DebugOptions(fallback=False))
    x = torch.randn(3, 9)
    torch.testing.assert_close(wrapped(x), module(x), rtol=0, atol=0)


class _Spectrogram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        spec = torch.stft(x * self.scale, n_fft=16, hop_length=4, window=torch.hamming_window(16),
                          return_complex=True)
        return spec.abs()


def test_an_stft_with_a_hamming_window_trains_as_eager():
    torch.manual_seed(0)
    eager, wrapped = _Spectrogram(), ORTModule(_Spectrogram(), debug_options=DebugOptions(fallback=False))
    x = torch.randn(2, 64)
    expected, out = eager(x), wrapped(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    expected.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(wrapped.module.scale.grad, eager.scale.grad, rtol=1e-4, atol=1e-4)
