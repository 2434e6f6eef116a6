"""Translations of log-space and tail functions that the exporter writes in forms that overflow.

torchlib writes ``torch.logaddexp(a, b)`` as ``Log(Exp(a) + Exp(b))``: beyond ~88 either
exponential overflows (the result is inf) and below ~-104 both underflow (-inf, and a NaN
gradient), where PyTorch's result is finite. ``logaddexp2`` likewise, and ``logcumsumexp`` divides
every prefix by the whole axis' maximum, so that a prefix far below it comes out -inf.
``torch.erfc`` is ``1 - Erf(x)``, all of whose digits cancel from x ~ 3 on (0 from x ~ 3.9, where
the true value is 3.5e-8), and ``torch.special.erfcx`` is ``exp(x²) erfc(x)`` with that erfc,
infinite times zero beyond x ~ 9; ``torch.special.log_ndtr``, written with both, was NaN in the
tails. ``torch.sinc``
divides by zero at zero, in the graph's unused branch, which makes its gradient NaN there.

Ours:

- ``logaddexp(a, b) = max + log1p(exp(min - max))``, chosen by ``a >= b`` so that equal
  arguments share the gradient, and equal infinities give themselves;
- ``logcumsumexp`` as a scan by doubling over that ``logaddexp`` (the axis' length static);
- ``erfc`` and ``erfcx`` from the Chebyshev-fitted ``erfc(z) = t exp(-z² + P(t))``,
  ``t = 1 / (1 + z / 2)``, of Numerical Recipes (fractional error under 1.2e-7 for every z >= 0),
  by reflection below zero; that form's gradient is within ~6e-6 of the exact one. Float64 gets
  the same 1.2e-7 (onnxruntime's CPU provider has no double Erf: the exporter's form did not run
  in double at all);
- ``log_ndtr`` as PyTorch's formula with those, each of its branches fed its own range only;
- ``sinc`` dividing by one where its argument is zero.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

# Numerical Recipes' erfcc: erfc(z) = t exp(-z² + P(t)), t = 1 / (1 + z/2), z >= 0; P's
# coefficients from the constant term up
_ERFC_POLYNOMIAL = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                    1.48851587, -0.82215223, 0.17087277)


def constant_like(x, value: float):
    """A scalar constant of ``x``'s float type, exact in that type (not rounded to float32 first).
    Where the translation does not know ``x``'s type (an intermediate value), a float64 constant
    cast like ``x`` at run time (folded to one constant): a float64 model's arithmetic then meets
    float64 constants, not float32 ones that no session could load."""
    if x.dtype is None:
        return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float64))), x)
    return op.Constant(value=ir.tensor(np.array(value, dtype=x.dtype.numpy())))


_like = constant_like


def _log1p(e, like):
    """``log(1 + e)`` to the last digits also where ``1 + e`` rounds ``e`` (Goldberg's
    ``log(u) e / (u - 1)``, ``u = 1 + e``; ``e`` itself where ``u`` rounds to 1), in every float type
    (ONNX has no Log1p, onnxruntime no double Softplus)."""
    one = _like(like, 1.0)
    u = op.Add(one, e)
    rounded_away = op.Equal(u, one)
    denominator = op.Where(rounded_away, one, op.Sub(u, one))  # never 0: a finite gradient either way
    return op.Where(rounded_away, e, op.Div(op.Mul(op.Log(u), e), denominator))


def _logaddexp(a, b, like):
    """``log(exp(a) + exp(b))`` without overflow (see the module's docstring); constants of
    ``like``'s type (an input of the translation: intermediate values carry none). Each branch
    adds ``log1p(exp(d))`` for a ``d <= 0`` (the other one's ``d`` cut to 0: no overflow to reach
    the gradient); equal arguments take the first branch with ``d = 0``, half the gradient each."""
    zero = _like(like, 0.0)
    same_infinity = op.And(op.IsInf(a), op.Equal(a, b))
    difference = op.Where(same_infinity, zero, op.Sub(b, a))  # b - a
    below_a = op.Where(op.Greater(difference, zero), zero, difference)
    above_a = op.Where(op.Greater(difference, zero), op.Neg(difference), zero)
    a_larger = op.Add(a, _log1p(op.Exp(below_a), like))
    b_larger = op.Add(b, _log1p(op.Exp(above_a), like))
    # not ``a >= b``: ``a < b`` is false for a NaN on either side, whose branch then carries it
    return op.Where(op.Not(op.Less(a, b)), a_larger, b_larger)


def logaddexp(a, b):
    """``aten.logaddexp``."""
    return _logaddexp(a, b, a)


def logaddexp2(a, b):
    """``aten.logaddexp2``: ``logaddexp`` of the arguments in natural units, back in base 2."""
    ln2 = _like(a, math.log(2.0))
    return op.Div(_logaddexp(op.Mul(a, ln2), op.Mul(b, ln2), a), ln2)


def logcumsumexp(x, dim: int):
    """``aten.logcumsumexp``: each prefix's ``logaddexp``, by doubling (log2 of the length steps,
    each adding the values ``shift`` places before; the first ``shift`` add -inf)."""
    rank = len(x.shape)
    if rank == 0:
        return op.Identity(x)
    axis = dim % rank
    length = x.shape[axis]
    if not isinstance(length, int):
        raise NotImplementedError("torch.logcumsumexp needs a static length along its dim")
    axes = op.Constant(value_ints=[axis])
    minus_infinity = _like(x, -math.inf)
    like = x
    shift = 1
    while shift < length:
        head = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[shift]), axes)
        before = op.Concat(op.Expand(minus_infinity, op.Shape(head)),
                           op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[length - shift]), axes),
                           axis=axis)
        x = _logaddexp(x, before, like)
        shift *= 2
    return x


def _erfc_scaled(z, like):
    """``t`` and ``P(t)`` for ``z >= 0`` (``exp(z²) erfc(z) = t exp(P(t))``)."""
    t = op.Reciprocal(op.Add(_like(like, 1.0), op.Mul(_like(like, 0.5), z)))
    polynomial = _like(like, _ERFC_POLYNOMIAL[-1])
    for coefficient in reversed(_ERFC_POLYNOMIAL[:-1]):
        polynomial = op.Add(_like(like, coefficient), op.Mul(t, polynomial))
    return t, polynomial


def _magnitude(x, like):
    """``|x|`` with the derivative 1 at 0 (Abs's is 0 there, which made erfc's gradient at exactly
    0 vanish where PyTorch's is -2/sqrt(pi))."""
    return op.Where(op.Less(x, _like(like, 0.0)), op.Neg(x), x)


def erfc(x, like=None):
    """``aten.erfc``: the fitted form for ``x >= 0``, ``2 - erfc(-x)`` below."""
    like = x if like is None else like
    z = _magnitude(x, like)
    t, polynomial = _erfc_scaled(z, like)
    upper = op.Mul(t, op.Exp(op.Sub(polynomial, op.Mul(z, z))))
    return op.Where(op.Less(x, _like(like, 0.0)), op.Sub(_like(like, 2.0), upper), upper)


def erfcx(x, like=None):
    """``aten.special_erfcx``: the fitted ``t exp(P(t))`` for ``x >= 0``, ``2 exp(x²) - erfcx(-x)``
    below (which overflows where the true value does, x < -9.4, with PyTorch's infinite
    gradient; the exponential reads 0 for x >= 0, so it cannot overflow into the gradient there)."""
    like = x if like is None else like
    zero = _like(like, 0.0)
    t, polynomial = _erfc_scaled(_magnitude(x, like), like)
    upper = op.Mul(t, op.Exp(polynomial))
    x_below = op.Min(x, zero)
    below = op.Sub(op.Mul(_like(like, 2.0), op.Exp(op.Mul(x_below, x_below))), upper)
    return op.Where(op.Less(x, zero), below, upper)


def log_ndtr(x):
    """``aten.special_log_ndtr``: ``log Φ(x)`` as PyTorch computes it, ``log(erfcx(-t) / 2) - t²``
    (``t = x / √2``) below 1 and ``log1p(-erfc(t) / 2)`` from 1 on, each branch given an
    argument of its own range only, so that the other one's overflow cannot reach the gradient."""
    low = op.Less(x, _like(x, 1.0))
    t = op.Mul(x, _like(x, math.sqrt(0.5)))
    t_low = op.Where(low, t, _like(x, 0.0))
    t_high = op.Where(low, _like(x, 1.0), t)
    below = op.Sub(op.Log(op.Mul(erfcx(op.Neg(t_low), x), _like(x, 0.5))), op.Mul(t_low, t_low))
    tail = op.Mul(erfc(t_high, x), _like(x, 0.5))  # 1 - Φ(x), at most 0.16
    # log1p(-tail): its series where 1 - tail would round the tail away
    series = op.Neg(op.Mul(tail, op.Add(_like(x, 1.0), op.Mul(tail, op.Add(_like(x, 0.5), op.Mul(
        tail, _like(x, 1.0 / 3.0)))))))
    above = op.Where(op.Less(tail, _like(x, 1e-3)), series, op.Log(op.Sub(_like(x, 1.0), tail)))
    return op.Where(low, below, above)


def sinc(x):
    """``aten.sinc``: ``sin(πx) / (πx)``, 1 at 0 (where it divides by one instead of zero)."""
    zero = op.Equal(x, _like(x, 0.0))
    scaled = op.Where(zero, _like(x, 1.0), op.Mul(x, _like(x, math.pi)))
    return op.Where(zero, _like(x, 1.0), op.Div(op.Sin(scaled), scaled))
