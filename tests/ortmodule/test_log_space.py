"""ORTModule computes log-space and tail functions as PyTorch does over their whole range, where
the exporter's forms overflow: logaddexp, logaddexp2 and logcumsumexp (``Log(Exp(a) + Exp(b))``
and a prefix divided by the axis' maximum: inf, -inf and NaN gradients), logsigmoid and binary
cross entropy with logits (``Log(Sigmoid(x))``, with onnxruntime's Sigmoid exactly 0 from x ~ -18),
erfc, erfcx and log_ndtr (``1 - Erf(x)``: all digits cancel), and sinc's gradient at zero (NaN)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

F = torch.nn.functional

# far beyond exp's float32 range on both sides, around zero, and ties
WIDE = [-300.0, -120.0, -90.0, -20.0, -1e-6, 0.0, 1e-7, 3.0, 25.0, 90.0, 120.0, 300.0]


class _Scaled(torch.nn.Module):
    """``function(x * w, y)`` with a scalar weight ``w`` = 1, so that the weight's gradient is the
    sum of the function's derivatives over the elements."""

    def __init__(self, function):
        super().__init__()
        self.function = function
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, y):
        return self.function(x * self.w, y)


def _assert_matches_eager(function, x, y, rtol=1e-5, atol=1e-6):
    eager, module = _Scaled(function), _Scaled(function)
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    expected = eager(x, y)
    (expected_grad,) = torch.autograd.grad(expected.sum(), eager.w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no runtime warning
        got = wrapped(x, y)
    (got_grad,) = torch.autograd.grad(got.sum(), module.w)
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(got_grad, expected_grad, rtol=max(rtol, 1e-4), atol=max(atol, 1e-5), equal_nan=True)


CASES = {
    "logaddexp": lambda x, y: torch.logaddexp(x, y),
    "logaddexp of equal arguments": lambda x, y: torch.logaddexp(x, x * 1.0),
    "logaddexp2": lambda x, y: torch.logaddexp2(x, y),
    "logcumsumexp": lambda x, y: torch.logcumsumexp(x, 0),
    "logcumsumexp along dim 1": lambda x, y: torch.logcumsumexp(torch.stack([x, y]), 1),
    "logsigmoid": lambda x, y: F.logsigmoid(x),
    "BCE with logits": lambda x, y: F.binary_cross_entropy_with_logits(x, torch.sigmoid(y), reduction="none"),
    "BCE with logits and pos_weight": lambda x, y: F.binary_cross_entropy_with_logits(
        x, (y > 0).float(), pos_weight=torch.full_like(x, 3.0)),
    "multilabel soft margin": lambda x, y: F.multilabel_soft_margin_loss(x[None], (y[None] > 0).float()),
    "log_ndtr": lambda x, y: torch.special.log_ndtr(x / 10),
    "erfc": lambda x, y: torch.erfc(x / 30),
    "erfcx": lambda x, y: torch.special.erfcx(x / 10),
    "sinc": lambda x, y: torch.sinc(x / 100),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager_over_the_whole_range(name):
    x = torch.tensor(WIDE)
    y = torch.flip(x, [0]) + 0.5
    _assert_matches_eager(CASES[name], x, y)


def test_a_written_out_log_of_sigmoid_is_exact():
    """``log(sigmoid(x))`` and ``log(1 - sigmoid(x))`` written out: the true values (float64's),
    where eager float32 rounds the sigmoid to 0 or 1 (-inf) and onnxruntime's Sigmoid is 0 from
    x ~ -18."""
    x = torch.tensor(WIDE)
    module = _Scaled(lambda x, y: torch.log(torch.sigmoid(x)) + torch.log(1 - torch.sigmoid(y)))
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    got = wrapped(x, -x)
    (got_grad,) = torch.autograd.grad(got.sum(), module.w)
    exact = 2 * F.logsigmoid(x.double())
    exact_grad = (torch.sigmoid(-x.double()) * x.double()).sum()
    torch.testing.assert_close(got.detach().double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), exact_grad, rtol=1e-5, atol=1e-5)


def test_erfc_and_erfcx_keep_their_relative_accuracy_in_the_tails():
    """Tiny values are right to the last digits, not only within an absolute tolerance."""
    x = torch.linspace(0.0, 9.0, 37)
    _assert_matches_eager(lambda x, y: torch.erfc(x) + torch.special.erfcx(y), x, x * 1.3, rtol=2e-6, atol=0.0)


def test_logaddexp_of_infinities_and_nans_is_pytorchs():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([-inf, -inf, inf, 3.0, -inf, nan, 1.0, nan])
    y = torch.tensor([-inf, 2.0, inf, inf, 5.0, 1.0, nan, nan])
    eager = torch.logaddexp(x, y)
    wrapped = ORTModule(_Scaled(lambda a, b: torch.logaddexp(a, b)), DebugOptions(fallback=False))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x, y), eager, equal_nan=True)


def test_float64_keeps_double_precision():
    """logaddexp to double precision; the erfc-based functions run in double (onnxruntime has no
    double Erf) to the fitted form's 1.2e-7."""
    x = torch.tensor(WIDE, dtype=torch.float64)
    _assert_matches_eager(lambda x, y: torch.logaddexp(x, y / 3), x, x.flip(0), rtol=1e-12, atol=1e-12)
    _assert_matches_eager(lambda x, y: torch.special.log_ndtr(x / 20) + torch.erfc(y / 30), x, x.flip(0),
                          rtol=2e-7, atol=1e-12)


def test_logcumsumexp_with_a_new_length_each_call():
    """The doubling scan needs the length: a call with another length is exported for it."""
    module = _Scaled(lambda x, y: torch.logcumsumexp(x, 0))
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    for length in (5, 9, 12):
        x = torch.tensor(WIDE[:length])
        torch.testing.assert_close(wrapped(x, x), torch.logcumsumexp(x, 0))


def test_binary_cross_entropy_of_a_sigmoid_is_exact_where_float32_saturates():
    """``F.binary_cross_entropy(torch.sigmoid(x), t)`` reads ``log1p(-sigmoid)``: the true loss and
    gradient (float64's), where onnxruntime's Sigmoid is 0 (x < -17: the gradient was NaN) and
    where float32 rounds the sigmoid to 1 (x > 17: eager float32 clamps the log to -100)."""
    x = torch.tensor([-25.0, -20.0, -17.5, -3.0, 0.0, 2.0, 17.5, 20.0, 25.0])
    t = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    module = _Scaled(lambda x, y: torch.nn.functional.binary_cross_entropy(torch.sigmoid(x), y, reduction="none"))
    wrapped = ORTModule(module, DebugOptions(fallback=False))
    got = wrapped(x, t)
    (got_grad,) = torch.autograd.grad(got.sum(), module.w)
    exact = -(t.double() * F.logsigmoid(x.double()) + (1 - t.double()) * F.logsigmoid(-x.double()))
    exact_grad = ((torch.sigmoid(x.double()) - t.double()) * x.double()).sum()
    torch.testing.assert_close(got.detach().double(), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), exact_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("function", [torch.erfc, torch.special.erfcx, torch.special.log_ndtr],
                         ids=["erfc", "erfcx", "log_ndtr"])
def test_gradient_at_exactly_zero(function):
    """The fitted forms read |x|, whose derivative (Abs's) is 0 at 0: the gradient there was 0."""
    x = torch.tensor([0.0, 0.0, -0.0, 0.5])
    _assert_matches_eager(lambda x, y: function(x), x, x)
