"""``torch.clamp`` with tensor bounds sends each element's gradient where PyTorch does
(torch/_translations.py ``_clamp_between``): the exporter's Max and Min split it between ``x`` and
the bound at ties."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

NAN = math.nan
# ties with either bound, inside, below, above, equal bounds, crossed bounds, NaN in x and bounds
X = [0.0, 0.0, 0.5, 0.0, 1.5, 0.0, -2.0, 3.0, NAN, 0.2, 0.2]
LOW = [0.0, -1.0, -1.0, 1.0, 2.0, 0.5, -1.0, -1.0, 0.0, NAN, 0.0]
HIGH = [1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, NAN]


class _Clamp(torch.nn.Module):
    def __init__(self, sides):
        super().__init__()
        self.sides = sides
        self.low = torch.nn.Parameter(torch.tensor(LOW))
        self.high = torch.nn.Parameter(torch.tensor(HIGH))

    def forward(self, x):
        low = self.low if "low" in self.sides else None
        high = self.high if "high" in self.sides else None
        return torch.clamp(x, min=low, max=high)


@pytest.mark.parametrize("sides", [("low", "high"), ("low",), ("high",)])
def test_gradients_at_ties_and_crossed_bounds_are_pytorchs(sides):
    wrapped = ORTModule(_Clamp(sides), debug_options=DebugOptions(fallback=False))
    results = []
    for module in (_Clamp(sides), wrapped):
        x = torch.tensor(X, requires_grad=True)
        out = module(x)
        out.backward(torch.linspace(0.5, 1.5, len(X)))
        grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros(len(X)) for p in (module.low, module.high)]
        results.append((out.detach(), *grads))
    (expected, *expected_grads), (out, *grads) = results
    torch.testing.assert_close(out, expected, equal_nan=True)
    finite = ~torch.isnan(expected)  # where the value is NaN, PyTorch's gradients follow no rule
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours[finite], theirs[finite])
