"""Cholesky factorizations and triangular solves train in ONNX Runtime (they fell back to
PyTorch: the exporter has none, and standard ONNX has no decomposition): ``torch.linalg.cholesky``
(unrolled columns, PyTorch's symmetric gradient), ``solve_triangular``, ``cholesky_solve`` and
``cholesky_inverse`` (through ``com.microsoft.Inverse`` of the triangle PyTorch reads), so
``MultivariateNormal`` / ``LowRankMultivariateNormal`` log-probabilities and a Gaussian process's
marginal likelihood train with eager's values and gradients; ``slogdet``/``logdet`` (Glow's
invertible convolutions) from ``Det`` of the matrix with unit-norm rows, finite far beyond float
range."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class Cholesky(torch.nn.Module):
    def __init__(self, upper=False):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.randn(2, 4, 4))
        self.upper = upper

    def forward(self, x):
        return torch.linalg.cholesky(self.factor @ self.factor.transpose(-1, -2) + torch.eye(4) * x, upper=self.upper)


class CholeskyOfAnInput(torch.nn.Module):
    def forward(self, a):
        return torch.linalg.cholesky(a)


class TriangularSolve(torch.nn.Module):
    def __init__(self, upper, left, unitriangular):
        super().__init__()
        self.matrix = torch.nn.Parameter(torch.randn(3, 3) + 3 * torch.eye(3))
        self.other = torch.nn.Parameter(torch.randn(3, 2) if left else torch.randn(2, 3))
        self.options = {"upper": upper, "left": left, "unitriangular": unitriangular}

    def forward(self, x):
        return torch.linalg.solve_triangular(self.matrix * x, self.other, **self.options)


class Gaussian(torch.nn.Module):
    """A MultivariateNormal from its covariance (or its scale_tril), a low-rank one beside it."""

    def __init__(self, scale_tril=False):
        super().__init__()
        self.loc = torch.nn.Parameter(torch.randn(3))
        self.factor = torch.nn.Parameter(torch.randn(3, 3))
        self.low_rank = torch.nn.Parameter(torch.randn(3, 2))
        self.scale_tril = scale_tril

    def forward(self, x):
        covariance = self.factor @ self.factor.T + torch.eye(3)
        if self.scale_tril:
            full = torch.distributions.MultivariateNormal(self.loc, scale_tril=torch.linalg.cholesky(covariance))
        else:
            full = torch.distributions.MultivariateNormal(self.loc, covariance_matrix=covariance)
        low = torch.distributions.LowRankMultivariateNormal(self.loc, self.low_rank, torch.ones(3))
        return full.log_prob(x) + low.log_prob(x)


class GaussianProcess(torch.nn.Module):
    """The negative log marginal likelihood of an RBF-kernel Gaussian process."""

    def __init__(self):
        super().__init__()
        self.log_lengthscale = torch.nn.Parameter(torch.tensor(0.3))
        self.log_noise = torch.nn.Parameter(torch.tensor(-1.0))

    def forward(self, x, y):
        distances = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
        kernel = torch.exp(-0.5 * distances / torch.exp(2 * self.log_lengthscale))
        factor = torch.linalg.cholesky(kernel + torch.exp(self.log_noise) * torch.eye(x.shape[0]))
        alpha = torch.cholesky_solve(y[:, None], factor)
        return 0.5 * (y[:, None] * alpha).sum() + torch.log(torch.diagonal(factor)).sum()


class FactorInverse(torch.nn.Module):
    def __init__(self, upper):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.randn(3, 3) + 3 * torch.eye(3))
        self.upper = upper

    def forward(self, x):
        factor = (torch.triu(self.factor) if self.upper else torch.tril(self.factor)) * x
        solved = torch.cholesky_solve(torch.ones(3, 2), factor, upper=self.upper)
        return torch.cholesky_inverse(factor, upper=self.upper) + solved.sum()


def _assert_trains_like_eager(eager, *inputs, tolerance=1e-5):
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(fallback=False))
    ours_inputs = [t.clone().requires_grad_() for t in inputs]
    eager_inputs = [t.clone().requires_grad_() for t in inputs]
    ours, theirs = wrapped(*ours_inputs), eager(*eager_inputs)
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    weights = torch.randn(theirs.shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for mine, reference in zip(ours_inputs, eager_inputs):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=tolerance, atol=tolerance)
    for (name, p), q in zip(wrapped.module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_of_a_batch(upper):
    torch.manual_seed(0)
    _assert_trains_like_eager(Cholesky(upper), torch.tensor(1.0))


def test_cholesky_reads_the_lower_triangle_and_has_pytorchs_symmetric_gradient():
    torch.manual_seed(0)
    a = torch.randn(4, 4)
    a = a @ a.T + torch.eye(4)
    a[0, 3] += 0.5  # not symmetric: PyTorch reads the lower triangle
    _assert_trains_like_eager(CholeskyOfAnInput(), a)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unitriangular", [False, True])
def test_solve_triangular(upper, left, unitriangular):
    torch.manual_seed(0)
    _assert_trains_like_eager(TriangularSolve(upper, left, unitriangular), torch.tensor(1.0))


@pytest.mark.parametrize("scale_tril", [False, True])
def test_multivariate_normal_log_probabilities(scale_tril):
    torch.manual_seed(0)
    _assert_trains_like_eager(Gaussian(scale_tril), torch.randn(5, 3))


def test_a_gaussian_process_marginal_likelihood():
    torch.manual_seed(0)
    _assert_trains_like_eager(GaussianProcess(), torch.randn(6, 2), torch.randn(6))


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_solve_and_inverse_of_a_factor(upper):
    torch.manual_seed(0)
    _assert_trains_like_eager(FactorInverse(upper), torch.tensor(1.0))


class InvertibleConvolution(torch.nn.Module):
    """Glow's invertible 1x1 convolution: the flow's output and its log-determinant."""

    def __init__(self, channels=4, scale=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.linalg.qr(torch.randn(channels, channels))[0]
                                          + 0.1 * torch.randn(channels, channels)) * scale)

    def forward(self, x):  # [batch, channels, h, w]
        out = torch.nn.functional.conv2d(x, self.weight[:, :, None, None])
        return out.flatten(1).sum(1) + x.shape[2] * x.shape[3] * torch.linalg.slogdet(self.weight).logabsdet


class Determinants(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 3, 3) + 2 * torch.eye(3))

    def forward(self, x):
        sign, logabsdet = torch.linalg.slogdet(self.weight * x)
        return sign * logabsdet + torch.logdet(self.weight[0] @ self.weight[0].T)


def test_a_normalizing_flows_log_determinant():
    torch.manual_seed(0)
    _assert_trains_like_eager(InvertibleConvolution(), torch.randn(2, 4, 3, 3))


def test_a_log_determinant_far_beyond_float_range():
    # |det| ~ e^150 (float32 ends at ~e^88): the rows are scaled to unit norm before Det
    torch.manual_seed(0)
    _assert_trains_like_eager(InvertibleConvolution(64, scale=10.0), torch.randn(1, 64, 2, 2), tolerance=1e-4)


def test_signs_and_log_determinants_of_a_batch():
    torch.manual_seed(0)
    _assert_trains_like_eager(Determinants(), torch.tensor(1.0))


class _SlogdetOf(torch.nn.Module):
    def forward(self, a):
        return torch.linalg.slogdet(a)


def test_a_singular_matrix_has_sign_zero_and_log_determinant_minus_infinity():
    singular = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])  # (a zero row: exactly singular in LU too)
    sign, logabsdet = ORTModule(_SlogdetOf(), DebugOptions(fallback=False))(singular)
    expected = torch.linalg.slogdet(singular)
    assert sign == expected.sign == 0 and logabsdet == expected.logabsdet == -float("inf")


class WishartAndDivergence(torch.nn.Module):
    """A Wishart log-density (its covariance's Cholesky factor) and the KL divergence of two
    MultivariateNormals (triangular solves), as a Bayesian model's loss would read them."""

    def __init__(self):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.randn(2, 3) * 0.5)
        self.loc = torch.nn.Parameter(torch.randn(3))
        self.log_scale = torch.nn.Parameter(torch.randn(3) * 0.1)

    def forward(self, sample):
        covariance = torch.eye(3) + self.factor.T @ self.factor
        wishart = torch.distributions.Wishart(5.0, covariance_matrix=covariance).log_prob(sample)
        posterior = torch.distributions.MultivariateNormal(self.loc, scale_tril=torch.diag(self.log_scale.exp()))
        prior = torch.distributions.MultivariateNormal(torch.zeros(3), covariance_matrix=covariance)
        return (wishart + torch.distributions.kl_divergence(posterior, prior)).reshape(1)


def test_a_wishart_density_and_a_gaussian_divergence():
    torch.manual_seed(0)
    _assert_trains_like_eager(WishartAndDivergence(), torch.eye(3) * 2 + 0.1)
