"""Nearest-neighbour interpolation reads PyTorch's source pixels (onnxtrain/torch/_nearest.py): the
exporter's Resize divided by the float scale and read one pixel over from eager at some positions
(scale 0.3, output 9 of 97: input 29 against PyTorch's 30)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402
from onnxtrain.torch._nearest import source_indices  # noqa: E402


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_source_indices_are_pytorchs_for_every_size_and_scale(mode, spatial):
    """(PyTorch's 2-D kernel copies an equal size and shifts a double one; 1-D and 3-D apply the
    formula: 2 pixels scaled by 1.1 read [0, 0] in 1-D, [0, 1] in 2-D.)"""
    mismatches = []
    for in_size in (1, 2, 3, 5, 7, 10, 31, 64, 97, 250):
        for scale in (0.3, 0.5, 0.7, 1 / 3, 1.1, 1.5, 2.0, 2.3, 3.0, 7.0, None):
            out_size = int(in_size * scale) if scale is not None else max(1, in_size * 3 // 4)
            if out_size < 1:
                continue
            source = torch.arange(in_size, dtype=torch.float32).reshape(1, 1, *[1] * (spatial - 1), in_size)
            if scale is None:
                expected = F.interpolate(source, size=(*[1] * (spatial - 1), out_size), mode=mode)
            else:
                expected = F.interpolate(source, scale_factor=(*[1.0] * (spatial - 1), scale), mode=mode)
            ours = source_indices(in_size, out_size, scale, exact=mode == "nearest-exact", shortcuts=spatial == 2)
            if not np.array_equal(ours, expected.reshape(-1).numpy().astype(np.int64)):
                mismatches.append((in_size, scale))
    assert not mismatches


class _Interpolate(torch.nn.Module):
    def __init__(self, mode, scale_factor=None, size=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3).reshape(1, 3, *[1] * 1))
        self.modes = (mode,) if mode != "both" else ("nearest", "nearest-exact")
        self.scale_factor, self.size = scale_factor, size

    def forward(self, x):
        scaled = x * self.weight.reshape(1, 3, *[1] * (x.dim() - 2))
        return torch.cat([F.interpolate(scaled, size=self.size, scale_factor=self.scale_factor, mode=mode)
                          for mode in self.modes], dim=1)


def _assert_matches_eager(module, inputs, **options):
    wrapped = ORTModule(module, debug_options=DebugOptions(fallback=False), **options)
    for x in inputs:
        x_eager, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = module(x_eager)
        seed = torch.randn_like(expected)
        expected_grads = torch.autograd.grad(expected, [x_eager, module.weight], seed)
        out = wrapped(x_ours)
        grads = torch.autograd.grad(out, [x_ours, wrapped.module.weight], seed)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the same pixels
        for ours, theirs in zip(grads, expected_grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shape", "scale_factor", "size"), [
    ((2, 3, 97), 0.3, None),  # a Gather (the exporter's Resize read input 29 for output 9)
    ((2, 3, 20, 9), (1.5, 0.6), None),
    ((2, 3, 8, 6), 2.0, None),  # an integer factor: onnxruntime's Resize divides exactly
    ((2, 3, 8, 6), 0.5, None),  # a strided Slice
    ((1, 3, 5, 7, 6), None, (3, 11, 4)),
])
def test_ortmodule_interpolates_as_eager(shape, scale_factor, size):
    """nearest and nearest-exact, side by side in one module."""
    torch.manual_seed(0)
    _assert_matches_eager(_Interpolate("both", scale_factor, size), [torch.randn(*shape)])


@pytest.mark.parametrize(("scale_factor", "shapes"), [
    ((0.3, 1.7), [(2, 3, 97, 10), (1, 3, 41, 23)]),
    # 2-D: a scale whose size comes out equal copies, one that doubles it shifts (10 * 2.05 = 20)
    ((1.1, 2.05), [(1, 3, 2, 10), (1, 3, 7, 10)]),
])
def test_dynamic_shapes_compute_pytorchs_indices_in_the_graph(scale_factor, shapes):
    torch.manual_seed(0)
    _assert_matches_eager(_Interpolate("nearest", scale_factor), [torch.randn(*s) for s in shapes], dynamic=True)


def test_dynamic_shapes_in_one_and_three_dimensions():
    """(Sizes where PyTorch's 1-D and 3-D outputs come out equal to or twice the input are left out:
    there its backward kernel copies and shifts, unlike its forward, and fails its own gradcheck.)"""
    torch.manual_seed(0)
    _assert_matches_eager(_Interpolate("nearest", 1.3), [torch.randn(1, 3, 5), torch.randn(2, 3, 9)], dynamic=True)
    _assert_matches_eager(_Interpolate("nearest", (0.6, 1.3, 2.5)),
                          [torch.randn(1, 3, 5, 4, 3), torch.randn(1, 3, 7, 5, 2)], dynamic=True)
    _assert_matches_eager(_Interpolate("nearest-exact", (0.6, 1.1, 2.3)),
                          [torch.randn(1, 3, 5, 2, 3), torch.randn(1, 3, 7, 4, 2)], dynamic=True)
