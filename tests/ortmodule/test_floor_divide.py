"""``tensor // number`` on a bool tensor (``aten.floor_divide.Scalar``, which the exporter could
not translate) gives PyTorch's values and type: int64 by an integer, float32 by a float, floored
toward minus infinity; the module trains around it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import FunctionModule, assert_steps_match  # noqa: E402


@pytest.mark.parametrize("divisor", [2, -2, 2.5, -0.5, 1])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.uint8])
def test_floor_division_by_a_number_is_pytorchs(dtype, divisor):
    x = torch.tensor([[-3.0, 0.0, 1.0, 5.0], [2.0, -1.0, 7.0, 0.5]])

    def function(x):
        values = x > 0 if dtype == torch.bool else x.to(dtype)
        return torch.floor_divide(values, divisor)

    expected = function(x)
    got = ORTModule(FunctionModule(function), DebugOptions(fallback=False))(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)


class _CountedHalves(torch.nn.Module):
    """A Linear's output plus ``(x > 0) // 2 + (x > 0) // 0.5``, counts that carry no gradient."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(4, 4)

    def forward(self, x):
        positive = x > 0
        return self.mix(x) + positive // 2 + positive // 0.5


def test_a_module_with_floor_divided_masks_trains_as_eager():
    torch.manual_seed(0)
    eager = _CountedHalves()
    wrapped = ORTModule(_CountedHalves(), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    assert_steps_match(eager, wrapped, torch.randn(6, 4))
