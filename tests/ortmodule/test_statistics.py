"""``torch.cov`` and ``torch.corrcoef`` (feature decorrelation losses: VICReg, Barlow Twins,
whitening) train in ONNX Runtime. PyTorch's kernels branch on the data (a warning when the
normalization factor is not positive), which the capture cannot trace, so such modules ran in
PyTorch; the capture now computes them with the same ops. Values, gradients, weights and the
degenerate factor (one observation: infinite or NaN, as PyTorch's) match eager's."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402


class Decorrelation(torch.nn.Module):
    """A VICReg-style loss of a projection's features: variance, off-diagonal covariance and
    correlation terms, with the statistic given as ``how(features.T)``."""

    def __init__(self, how):
        super().__init__()
        self.projection = torch.nn.Linear(6, 4)
        self.how = how

    def forward(self, x):
        features = torch.tanh(self.projection(x))
        statistic = self.how(features.T)
        return statistic, statistic.square().sum() + features.var(0).sum()


WEIGHTS = torch.tensor([1, 3, 2, 1, 1, 2, 4, 1])
AWEIGHTS = torch.tensor([0.5, 1.0, 0.2, 0.9, 0.3, 0.7, 0.1, 0.6])

CASES = {
    "cov": lambda f: torch.cov(f),
    "cov_correction_0": lambda f: torch.cov(f, correction=0),
    "cov_method": lambda f: f.cov(correction=2),
    "cov_fweights": lambda f: torch.cov(f, fweights=WEIGHTS),
    "cov_aweights": lambda f: torch.cov(f, aweights=AWEIGHTS),
    "cov_both_weights": lambda f: torch.cov(f, fweights=WEIGHTS, aweights=AWEIGHTS),
    "cov_one_variable": lambda f: torch.cov(f[0]),
    "corrcoef": lambda f: torch.corrcoef(f),
    "corrcoef_method": lambda f: f.corrcoef(),
}


def _run(model, x):
    statistic, loss = model(x)
    loss.backward()
    return statistic.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", list(CASES))
def test_statistics_train_in_onnx_runtime_as_in_pytorch(case):
    eager, wrapped = eager_and_wrapped(lambda: Decorrelation(CASES[case]), debug_options=DebugOptions(fallback=False))
    x = torch.randn(8, 6)
    expected, expected_grads = _run(eager, x)
    got, grads = _run(wrapped, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_a_single_observation_gives_pytorchs_non_finite_values():
    # the factor N - 1 is 0: PyTorch warns and divides by it
    eager, wrapped = eager_and_wrapped(lambda: Decorrelation(CASES["cov"]), debug_options=DebugOptions(fallback=False))
    x = torch.randn(1, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's "degrees of freedom is <= 0"
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        expected, _ = eager(x)
        got, _ = wrapped(x)
    assert not torch.isfinite(expected).any()
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_weights_of_the_wrong_dtype_are_refused_as_pytorch_refuses_them():
    wrapped = ORTModule(Decorrelation(lambda f: torch.cov(f, fweights=WEIGHTS.float())), DebugOptions(fallback=False))
    with pytest.raises(Exception, match="fweights to have integral dtype"):
        wrapped(torch.randn(8, 6))
