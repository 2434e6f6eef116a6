"""``scatter_reduce`` and ``index_reduce`` (graph networks' aggregations) train in ONNX Runtime
with every reduction PyTorch has: ``mean`` (the exporter took it for a plain scatter) and
``index_reduce`` (which the exporter lacks) are sums and counts of ScatterElements; ``prod``'s
gradient is PyTorch's, zeros included (a factor that is the only zero at its position gets the
product of the others). Values and the gradients of both the scattered-into tensor and the
updates match eager's."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

INDEX = torch.tensor([[0, 2, 0], [3, 2, 2], [0, 1, 3], [3, 3, 0], [2, 2, 2]])  # row 1 of column 0 gets none


class Scatter(torch.nn.Module):
    """``base.scatter_reduce(dim, index, src)`` with ``base`` and ``src`` made from parameters."""

    def __init__(self, reduce, include_self, dim=0, zeros=False, src_rows=5):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(4, 3) + 2.0)
        self.src = torch.nn.Parameter(torch.randn(src_rows, 3) + 2.0)
        if zeros:  # products through zeros: one zero at a position, two at another, one in base
            with torch.no_grad():
                self.src[0, 0] = self.src[1, 1] = self.src[4, 1] = self.src[2, 2] = 0.0
                self.base[3, 2] = 0.0
        self.reduce, self.include_self, self.dim = reduce, include_self, dim

    def forward(self, x, index):
        return (self.base * x).scatter_reduce(self.dim, index, self.src * 1.5, self.reduce,
                                              include_self=self.include_self)


class IndexReduce(torch.nn.Module):
    """``base.index_reduce(dim, index, src)``: one index per slice of ``src`` along ``dim``."""

    def __init__(self, reduce, include_self, dim):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(4, 3, 2))
        shape = [4, 3, 2]
        shape[dim] = 5
        self.src = torch.nn.Parameter(torch.randn(*shape))
        self.reduce, self.include_self, self.dim = reduce, include_self, dim

    def forward(self, x, index):
        return (self.base * x).index_reduce(self.dim, index, self.src.tanh(), self.reduce,
                                            include_self=self.include_self)


def _assert_matches_eager(factory, *inputs):
    torch.manual_seed(0)
    eager = factory()
    wrapped = ORTModule(factory(), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        ours, theirs = wrapped(*inputs), eager(*inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = torch.linspace(-1.0, 2.0, theirs.numel()).reshape(theirs.shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(wrapped.module.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["mean", "prod", "sum", "amax"])
def test_scatter_reduce_matches_eager(reduce, include_self):
    _assert_matches_eager(lambda: Scatter(reduce, include_self), torch.rand(4, 3) + 0.5, INDEX)


@pytest.mark.parametrize("include_self", [True, False])
def test_products_through_zeros_have_pytorchs_gradient(include_self):
    # dy * y / factor would be 0/0 at the zeros; the only zero at a position gets the product of the others
    _assert_matches_eager(lambda: Scatter("prod", include_self, zeros=True), torch.rand(4, 3) + 0.5, INDEX)


def test_scatter_mean_along_the_last_dim():
    index = torch.tensor([[2, 2, 0], [0, 0, 1], [2, 1, 1], [0, 2, 2]])  # each row leaves a position unreached
    # (src no larger than index: PyTorch's own mean backward fails on a larger one)
    _assert_matches_eager(lambda: Scatter("mean", False, dim=-1, src_rows=4), torch.rand(4, 3) + 0.5, index)


def test_the_mean_of_integers_is_floored():
    class IntegerMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, counts, index):
            means = torch.zeros(4, 3, dtype=torch.int64).scatter_reduce(0, index, counts, "mean", include_self=False)
            return self.linear(means.float())

    counts = torch.tensor([[-7, 3, 5], [2, -1, 4], [9, -9, 0], [1, 1, -2], [-4, 6, 7]])
    _assert_matches_eager(IntegerMean, counts, INDEX)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["mean", "prod", "amax", "amin"])
@pytest.mark.parametrize("dim", [0, -2])
def test_index_reduce_matches_eager(reduce, include_self, dim):
    index = torch.tensor([0, 2, 0, 3, 2]) if dim == 0 else torch.tensor([0, 2, 0, 2, 2])
    _assert_matches_eager(lambda: IndexReduce(reduce, include_self, dim), torch.rand(4, 3, 2) + 0.5, index)
