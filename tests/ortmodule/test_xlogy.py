"""``xlogy`` and ``xlog1py`` give PyTorch's values and gradients where ``x`` is 0 (torch's
derivative ``log(y)`` there, masked where the log's domain ends): the exporter's gave ``x`` a
gradient of 1 there."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import FunctionModule  # noqa: E402

NAN, INF = math.nan, math.inf
X = [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, -1.5, INF, 1.0]
Y = [2.0, 0.5, NAN, -3.0, 0.0, 0.5, 3.0, 2.0, -0.5]


@pytest.mark.parametrize("name", ["xlogy", "xlog1py", "xlogy-number", "xlog1py-number"])
def test_values_and_gradients_are_pytorchs_where_x_is_zero(name):
    function = {"xlogy": torch.xlogy, "xlog1py": torch.special.xlog1py,
                "xlogy-number": lambda x, y: torch.xlogy(x, 3.0),
                "xlog1py-number": lambda x, y: torch.special.xlog1py(x, 0.5)}[name]
    wrapped = ORTModule(FunctionModule(function), debug_options=DebugOptions(fallback=False))
    results = []
    for module in (FunctionModule(function), wrapped):
        x, y = torch.tensor(X, requires_grad=True), torch.tensor(Y, requires_grad=True)
        out = module(x, y)
        out.backward(torch.linspace(0.5, 1.5, len(X)))
        results.append((out.detach(), x.grad, y.grad))
    (expected, expected_dx, expected_dy), (out, dx, dy) = results
    torch.testing.assert_close(out, expected, equal_nan=True)
    torch.testing.assert_close(dx, expected_dx, equal_nan=True)
    if "number" not in name:
        # where x is 0 and y ends the log's domain PyTorch's x / y is 0 / 0 (NaN); ours 0
        keep = ~((torch.tensor(X) == 0) & torch.isnan(expected_dy))
        torch.testing.assert_close(dy[keep], expected_dy[keep], equal_nan=True)


@pytest.mark.parametrize("function", [torch.xlogy, torch.special.xlog1py], ids=["xlogy", "xlog1py"])
@pytest.mark.parametrize("integer", ["x", "y", "both"])
def test_integer_arguments_are_promoted(function, integer):
    """An integer argument takes the other's floating type (both integers: float32), as PyTorch:
    the graph cast the float one to the integer type (Log of an integer tensor did not load)."""
    x, y = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.5, 1.0, 2.5, 3.0])
    if integer in ("x", "both"):
        x = x.long()
    if integer in ("y", "both"):
        y = y.long()
    expected = function(x, y)
    got = ORTModule(FunctionModule(function), DebugOptions(fallback=False))(x, y)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)
