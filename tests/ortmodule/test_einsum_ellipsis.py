"""``torch.einsum`` with ellipses of different ranks (numpy's broadcast) exports: each operand's
``...`` gets the same number of axes first (torch/_translations.py ``einsum``); onnxruntime
refused the model and ORTModule ran it in PyTorch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import assert_steps_match  # noqa: E402


class _Einsum(torch.nn.Module):
    def __init__(self, equation, weight_shape):
        super().__init__()
        self.equation = equation
        self.weight = torch.nn.Parameter(torch.randn(*weight_shape))

    def forward(self, x):
        return torch.einsum(self.equation, x, self.weight)


@pytest.mark.parametrize(("equation", "x_shape", "weight_shape"), [
    ("...ij,...jk->...ik", (3, 2, 2, 4), (2, 4, 3)),  # a batch of 3 x 2 against one of 2
    ("...ij,...jk->...ik", (2, 4), (3, 4, 5)),  # the other way round
    ("b...d,...d->b...", (2, 3, 5, 4), (5, 4)),
    ("...i,...i->i", (2, 3, 4), (3, 4)),  # the ellipsis summed away (onnxruntime failed the run)
    ("...ij,jk", (2, 3, 4), (4, 5)),  # implicit output: the ellipsis first, then i and k
    ("ij...,j", (3, 4, 2), (4,)),
])
def test_ellipses_of_different_ranks_train_as_eager(equation, x_shape, weight_shape):
    torch.manual_seed(0)
    eager = _Einsum(equation, weight_shape)
    wrapped = ORTModule(_Einsum(equation, weight_shape), debug_options=DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    assert_steps_match(eager, wrapped, torch.randn(*x_shape))
