"""Antialiased bilinear and bicubic interpolation computes PyTorch's numbers
(onnxtrain/torch/_antialias.py): onnxruntime's antialias Resize maps coordinates otherwise, and
with align_corners=True or a scale factor that does not divide the size it was 0.07-0.9 off."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class _Resample(torch.nn.Module):
    """Bilinear and bicubic, both antialiased, of the same input (one export covers both modes)."""

    def __init__(self, **options):
        super().__init__()
        self.options = options
        self.gain = torch.nn.Parameter(torch.tensor(1.25))

    def forward(self, x):
        scaled = x * self.gain
        bilinear = F.interpolate(scaled, mode="bilinear", antialias=True, **self.options)
        bicubic = F.interpolate(scaled, mode="bicubic", antialias=True, **self.options)
        return torch.cat([bilinear, bicubic], dim=1)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize(("shape", "resize"), [
    ((2, 3, 8, 10), {"size": (3, 4)}),
    ((1, 2, 8, 10), {"scale_factor": 0.4}),
    ((1, 1, 8, 10), {"size": (12, 15)}),
    ((2, 1, 1, 9), {"size": (1, 4)}),  # an axis of length 1
])
def test_antialiased_interpolation_trains_as_eager(align_corners, shape, resize):
    torch.manual_seed(0)
    options = {"align_corners": align_corners, **resize}
    eager, wrapped = _Resample(**options), ORTModule(_Resample(**options), debug_options=DebugOptions(fallback=False))
    x_eager, x_ours = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
                       for _ in range(2))
    expected, out = eager(x_eager), wrapped(x_ours)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    seed = torch.randn_like(expected)
    expected.backward(seed)
    out.backward(seed)
    torch.testing.assert_close(x_ours.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wrapped.module.gain.grad, eager.gain.grad, rtol=1e-5, atol=1e-5)
