"""``torch.einsum`` in ORTModule (torch/_translations.py ``einsum``).

With ellipses of different ranks (numpy's broadcast) it exports: each operand's ``...`` gets the
same number of axes first; onnxruntime refused the model and ORTModule ran it in PyTorch.

A two-operand einsum exports as a MatMul of transposed operands where it is a plain contraction
(torch/_einsum.py: onnxruntime's Einsum kernel is slower), with eager's outputs and gradients;
a diagonal, or a size-1 axis einsum broadcasts, stays an Einsum."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import assert_steps_match, exported_ops  # noqa: E402


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
    _trains_as_eager(equation, x_shape, weight_shape)


def _trains_as_eager(equation, x_shape, weight_shape):
    """One step of ``einsum(equation, x, weight)`` in ORTModule and in eager, compared; the eager
    module and x."""
    torch.manual_seed(0)
    eager = _Einsum(equation, weight_shape)
    wrapped = ORTModule(_Einsum(equation, weight_shape), debug_options=DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    x = torch.randn(*x_shape)
    assert_steps_match(eager, wrapped, x)
    return eager, x


CONTRACTIONS = [
    ("bcxd,bcyd->bcxy", (2, 3, 4, 5), (2, 3, 6, 5)),  # attention scores
    ("ibnd,jbnd->bnij", (4, 2, 3, 5), (6, 2, 3, 5)),  # XLNet's, batch letters in the middle
    ("bij,jk->bik", (2, 3, 4), (4, 5)),  # a linear layer
    ("abc,cd->dba", (2, 3, 4), (4, 5)),  # two row letters merged, the output transposed
    ("bn,anm->bam", (3, 4), (2, 4, 5)),  # two column letters
    ("ij,ij->i", (3, 4), (3, 4)),  # a dot product per row: no row or column letter
    ("i,i->", (4,), (4,)),  # a scalar
    ("ij,kl->ijkl", (2, 3), (4, 5)),  # an outer product: nothing contracted
    ("ijk,jl->il", (2, 3, 4), (3, 5)),  # k summed away first
    ("bij,bjk", (2, 3, 4), (2, 4, 5)),  # implicit output
]


@pytest.mark.parametrize(("equation", "x_shape", "weight_shape"), CONTRACTIONS, ids=[c[0] for c in CONTRACTIONS])
def test_contractions_are_matmuls_that_train_as_eager(equation, x_shape, weight_shape):
    ops = exported_ops(*_trains_as_eager(equation, x_shape, weight_shape))
    assert "Einsum" not in ops
    assert ops.count("MatMul") == 1


@pytest.mark.parametrize(("equation", "x_shape", "weight_shape"), [
    ("ii,ij->ij", (3, 3), (3, 4)),  # a diagonal
    ("bij,bjk->bik", (2, 3, 1), (2, 4, 5)),  # j of size 1 against 4: einsum broadcasts it
])
def test_other_equations_stay_einsums(equation, x_shape, weight_shape):
    assert "Einsum" in exported_ops(*_trains_as_eager(equation, x_shape, weight_shape))
