"""Elementwise arithmetic and activations.

Binary and variadic ops are registered from opset 7: before it, broadcasting was the
legacy ``broadcast``/``axis`` attribute form, which the central un-broadcast does not model.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxtrain import names
from onnxtrain.autodiff.registry import grad, unary
from onnxtrain.ir.shapes import sum_to_shape

# -- arithmetic ---------------------------------------------------------------------------


@grad("Add", versions=(7, None), broadcasting=True)
def _add(ctx):
    return ctx.dy, ctx.dy


@grad("Sub", versions=(7, None))
def _sub(ctx):
    # un-broadcast here rather than in the builder, so that the subtrahend's minus sign falls on
    # its summed (often much smaller) gradient instead of costing a pass over dy
    a, b = ctx.inputs
    da = sum_to_shape(ctx.b, ctx.dy, a, ctx.y.shape) if ctx.needs(0) else None
    db = ctx.op.Neg(sum_to_shape(ctx.b, ctx.dy, b, ctx.y.shape)) if ctx.needs(1) else None
    return da, db


@grad("Mul", versions=(7, None), broadcasting=True)
def _mul(ctx):
    a, b = ctx.inputs
    op = ctx.op
    if a is b:  # a square: 2 * a * dy in two passes, not two products and their sum
        return _square_grad(ctx, a), None
    return (op.Mul(ctx.dy, b) if ctx.needs(0) else None,
            op.Mul(ctx.dy, a) if ctx.needs(1) else None)


def _square_grad(ctx, a: ir.Value) -> ir.Value:
    """The gradient of ``a * a`` (or ``a ** 2``) with respect to ``a``: ``dy * (a + a)``."""
    return ctx.op.Mul(ctx.dy, ctx.op.Add(a, a))


@grad("Div", versions=(7, None))
def _div(ctx):
    a, b = ctx.inputs
    op, shape = ctx.op, ctx.y.shape
    da = sum_to_shape(ctx.b, op.Div(ctx.dy, b), a, shape) if ctx.needs(0) else None
    # -dy * a / b^2 = -dy * y / b; b is constant along the axes un-broadcasting sums, so the
    # division and the sign apply to the summed product (a pass over dy each, saved when b is small)
    db = op.Neg(op.Div(sum_to_shape(ctx.b, op.Mul(ctx.dy, ctx.y), b, shape), b)) if ctx.needs(1) else None
    return da, db


@grad("Pow", versions=(7, None), broadcasting=True)
def _pow(ctx):
    a, e = ctx.inputs
    op, b = ctx.op, ctx.b
    da = db = None
    exponent = ctx.const_input(1)
    if ctx.needs(0) and exponent is not None and exponent.size == 1 and float(exponent.ravel()[0]) == 2.0:
        da = _square_grad(ctx, a)  # a square
    elif ctx.needs(0):
        ef = b.cast_to(e, a.dtype)  # the exponent may be an integer tensor
        # e * a^(e-1) rather than e * y / a: finite at a = 0, exact for a < 0 with integer e
        da = op.Mul(ctx.dy, op.Mul(ef, op.Pow(a, op.Sub(ef, ctx.like(ef, 1.0)))))
        if exponent is None or not exponent.all():
            # a zero exponent: zero, as torch's (not 0 * 0^-1 = NaN at a = 0)
            zero = ctx.like(a, 0.0)
            da = op.Where(op.Equal(ef, zero), zero, da)
    if ctx.needs(1):
        # log(a) only for the exponent's gradient; at a = 0 take y*log(a) -> 0 (torch does the same)
        zero = ctx.like(a, 0.0)
        ylog = op.Where(op.Equal(a, zero), zero, op.Mul(ctx.y, op.Log(a)))
        db = b.cast_to(op.Mul(ctx.dy, ylog), e.dtype)
    return da, db


@grad("Mod", versions=(10, None), broadcasting=True)
def _mod(ctx):
    # y = a - q * b with an integer quotient q (trunc for fmod=1, floor for fmod=0): dy/da = 1, dy/db = -q.
    a, b = ctx.inputs
    op = ctx.op
    db = op.Neg(op.Mul(ctx.dy, op.Round(op.Div(op.Sub(a, ctx.y), b)))) if ctx.needs(1) else None
    return ctx.dy, db


@grad("Neg")
def _neg(ctx):
    return (ctx.op.Neg(ctx.dy),)


@grad("Identity")
def _identity(ctx):
    return (ctx.dy,)


@grad("Cast")
def _cast(ctx):
    # needs(0) is False when the source is not a float: integer casts carry no gradient
    return (ctx.b.cast_to(ctx.dy, ctx.x.dtype) if ctx.needs(0) else None,)


@grad("CastLike", versions=(15, None))
def _cast_like(ctx):
    return (ctx.b.cast_to(ctx.dy, ctx.x.dtype) if ctx.needs(0) else None, None)


# -- variadic -----------------------------------------------------------------------------


@grad("Sum", versions=(8, None), broadcasting=True)
def _sum(ctx):
    return (ctx.dy,) * len(ctx.inputs)


@grad("Mean", versions=(8, None), broadcasting=True)
def _mean(ctx):
    return (ctx.op.Div(ctx.dy, ctx.like(ctx.dy, float(len(ctx.inputs)))),) * len(ctx.inputs)


def _select(ctx):
    """Max/Min: the gradient goes to the inputs equal to the output; ties split it evenly
    (as torch.maximum/minimum do for two inputs)."""
    op, y = ctx.op, ctx.y
    if len(ctx.inputs) == 1:
        return (ctx.dy,)
    masks = [op.Cast(op.Equal(v, y), to=int(y.dtype)) for v in ctx.inputs]
    share = op.Div(ctx.dy, op.Sum(*masks))
    return tuple(op.Mul(share, m) if ctx.needs(i) else None for i, m in enumerate(masks))


grad("Max", versions=(8, None), broadcasting=True)(_select)
grad("Min", versions=(8, None), broadcasting=True)(_select)


def _non_finite_constant(value: ir.Value) -> bool:
    """Whether ``value`` is a constant holding an inf or NaN (``masked_fill(mask, -inf)``'s fill)."""
    tensor = ir.convenience.get_const_tensor(value)
    return tensor is not None and not np.all(np.isfinite(tensor.numpy()))


# ops whose derivative is infinite at 0 in the input named (Pow: with an exponent below 1)
_SINGULAR_AT_ZERO = {("Sqrt", 0), ("Log", 0), ("Reciprocal", 0), ("Div", 1), ("Pow", 0)}
# ops a value passes through on its way to one (a scaled, shifted or reshaped masked value)
_PASSING_ON = frozenset({"Mul", "Add", "Sub", "Neg", "Identity", "Cast", "Reshape", "Transpose", "Squeeze",
                         "Unsqueeze", "Flatten", "Expand", "Slice", "Gather", "Concat", "Abs", "Max", "Min"})


def _meets_infinite_derivative(value: ir.Value, depth: int = 4) -> bool:
    """Whether ``value`` reaches, through at most ``depth`` of the ops in ``_PASSING_ON``, an op
    whose derivative is infinite at 0 (``sqrt(relu(x))``, ``log(where(c, x, 0))``): its gradient
    may then be inf where a mask zeroed it, and ``dy * mask`` would be NaN there."""
    for node, index in value.uses():
        if (node.op_type, index) in _SINGULAR_AT_ZERO and node.domain in ("", "ai.onnx"):
            if node.op_type != "Pow":
                return True
            exponent = ir.convenience.get_const_tensor(node.inputs[1])
            if exponent is None or np.any(exponent.numpy() < 1):
                return True
        elif (depth and node.op_type in _PASSING_ON and node.domain in ("", "ai.onnx")
              and any(_meets_infinite_derivative(out, depth - 1) for out in node.outputs)):
            return True
    return False


def _masked(ctx, keep: ir.Value, dy: ir.Value, exactly: bool) -> ir.Value:
    """``dy`` where ``keep`` holds, else 0: ``dy * mask`` (GraphBuilder.keep_where: ~8x faster on
    onnxruntime's CPU, but NaN where dy is inf at a masked position), or ``exactly`` a Where."""
    return ctx.op.Where(keep, dy, ctx.like(dy, 0.0)) if exactly else ctx.b.keep_where(keep, dy)


@grad("Where", versions=(9, None), broadcasting=True)
def _where(ctx):
    # masks as Cast + Mul (see GraphBuilder.keep_where): an inf/NaN dy at a position routed to
    # the other branch gives that branch NaN there instead of 0. Beside a fill of -inf (or NaN),
    # whose rows a softmax may turn into NaN that a later masked_fill zeroes (PyTorch's gradient
    # there is 0), or where the output meets an infinite derivative (a masked value's square
    # root), the branch's gradient is chosen exactly, with a Where.
    cond, dy = ctx.inputs[0], ctx.dy
    op = ctx.op
    singular = _meets_infinite_derivative(ctx.y)

    def routed(keep, other: ir.Value):
        return _masked(ctx, keep, dy, singular or _non_finite_constant(other))

    return (None, routed(cond, ctx.inputs[2]) if ctx.needs(1) else None,
            routed(op.Not(cond), ctx.inputs[1]) if ctx.needs(2) else None)


@grad("Clip", versions=(6, None), broadcasting=True)
def _clip(ctx):
    # Opsets 6-10 hold min/max as attributes, 11+ as optional scalar inputs. y == x marks the
    # unclipped elements (bounds included, like torch); a clipped element's gradient goes to the
    # bound it equals, so min > max (y = max everywhere) sends nothing to min.
    # A Clip marked names.OPEN_CLIP_METADATA (PyTorch's hardtanh and relu6) passes the gradient
    # where x is not at or beyond a bound (strictly inside, NaN too), as those ops do in torch.
    # x's gradient is masked as a ReLU's (dy * mask; a Where beside an infinite derivative):
    # onnxruntime's Where took 16 ms on MobileNetV2's largest ReLU6 gradient.
    op, x, y, dy = ctx.op, ctx.x, ctx.y, ctx.dy
    zero = ctx.like(dy, 0.0)
    bounds = [(i, compare) for i, compare in ((1, op.LessOrEqual), (2, op.GreaterOrEqual))
              if i < len(ctx.inputs) and ctx.inputs[i] is not None]
    if names.OPEN_CLIP_METADATA in ctx.node.metadata_props and bounds:
        beyond = [compare(x, ctx.inputs[i]) for i, compare in bounds]
        passed = op.Not(beyond[0] if len(beyond) == 1 else op.Or(*beyond))
    else:
        passed = op.Equal(y, x)
    grads = [_masked(ctx, passed, dy, _meets_infinite_derivative(y))]
    for i in range(1, len(ctx.inputs)):
        hit = op.And(op.Not(passed), op.Equal(y, ctx.inputs[i])) if ctx.needs(i) else None
        grads.append(op.Where(hit, dy, zero) if hit is not None else None)
    return tuple(grads)


# -- unary math -----------------------------------------------------------------------------

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715  # cubic coefficient of the tanh approximation, per the ONNX spec


def _one_minus_sq(ctx, v):
    return ctx.op.Sub(ctx.like(v, 1.0), ctx.op.Mul(v, v))


@grad("Sqrt")
def _sqrt(ctx):
    return (ctx.op.Div(ctx.op.Mul(ctx.dy, ctx.like(ctx.dy, 0.5)), ctx.y),)


@grad("Log")
def _log(ctx):
    return (ctx.op.Div(ctx.dy, ctx.x),)


unary("Reciprocal", lambda ctx: ctx.op.Neg(ctx.op.Mul(ctx.y, ctx.y)))
unary("Exp", lambda ctx: ctx.y)
unary("Abs", lambda ctx: ctx.op.Sign(ctx.x))
unary("Erf", lambda ctx: ctx.op.Mul(ctx.like(ctx.x, _TWO_OVER_SQRT_PI),
                                      ctx.op.Exp(ctx.op.Neg(ctx.op.Mul(ctx.x, ctx.x)))))
unary("Sin", lambda ctx: ctx.op.Cos(ctx.x))
unary("Cos", lambda ctx: ctx.op.Neg(ctx.op.Sin(ctx.x)))
unary("Tan", lambda ctx: ctx.op.Add(ctx.like(ctx.y, 1.0), ctx.op.Mul(ctx.y, ctx.y)))
unary("Sinh", lambda ctx: ctx.op.Cosh(ctx.x), versions=(9, None))
unary("Cosh", lambda ctx: ctx.op.Sinh(ctx.x), versions=(9, None))
unary("Tanh", lambda ctx: _one_minus_sq(ctx, ctx.y))


@grad("Atan")
def _atan(ctx):
    return (ctx.op.Div(ctx.dy, ctx.op.Add(ctx.like(ctx.x, 1.0), ctx.op.Mul(ctx.x, ctx.x))),)


@grad("Asin")
def _asin(ctx):
    return (ctx.op.Div(ctx.dy, ctx.op.Sqrt(_one_minus_sq(ctx, ctx.x))),)


@grad("Acos")
def _acos(ctx):
    return (ctx.op.Neg(ctx.op.Div(ctx.dy, ctx.op.Sqrt(_one_minus_sq(ctx, ctx.x)))),)


@grad("Asinh", versions=(9, None))
def _asinh(ctx):
    op, x = ctx.op, ctx.x
    return (op.Div(ctx.dy, op.Sqrt(op.Add(op.Mul(x, x), ctx.like(x, 1.0)))),)


@grad("Acosh", versions=(9, None))
def _acosh(ctx):
    op, x = ctx.op, ctx.x
    return (op.Div(ctx.dy, op.Sqrt(op.Sub(op.Mul(x, x), ctx.like(x, 1.0)))),)


@grad("Atanh", versions=(9, None))
def _atanh(ctx):
    return (ctx.op.Div(ctx.dy, _one_minus_sq(ctx, ctx.x)),)


# -- activations ----------------------------------------------------------------------------


def _where_positive(ctx, then, otherwise, threshold=0.0):
    """Where(x > threshold, then, otherwise): the two branches of a piecewise activation."""
    return ctx.op.Where(ctx.op.Greater(ctx.x, ctx.like(ctx.x, threshold)), then, otherwise)


@grad("Relu")
def _relu(ctx):
    # exactly (a Where) where the output meets an infinite derivative: sqrt(relu(x)) is 0 with
    # PyTorch's gradient at x < 0 (dy * mask was inf * 0 there, NaN)
    op = ctx.op
    return (_masked(ctx, op.Greater(ctx.y, ctx.like(ctx.y, 0.0)), ctx.dy, _meets_infinite_derivative(ctx.y)),)


@grad("LeakyRelu")
def _leaky_relu(ctx):
    alpha = ctx.like(ctx.dy, ctx.attr("alpha", 0.01))
    return (_where_positive(ctx, ctx.dy, ctx.op.Mul(ctx.dy, alpha)),)


@grad("PRelu", versions=(7, None), broadcasting=True)
def _prelu(ctx):
    # slope broadcasts (unidirectionally) to x: both gradients are x-shaped, summed to slope's shape centrally
    op, x, slope, dy = ctx.op, ctx.x, ctx.inputs[1], ctx.dy
    zero = ctx.like(dy, 0.0)
    dx = _where_positive(ctx, dy, op.Mul(dy, slope)) if ctx.needs(0) else None
    dslope = _where_positive(ctx, zero, op.Mul(dy, x)) if ctx.needs(1) else None
    return dx, dslope


@grad("ThresholdedRelu", versions=(10, None))
def _thresholded_relu(ctx):
    return (_where_positive(ctx, ctx.dy, ctx.like(ctx.dy, 0.0), threshold=ctx.attr("alpha", 1.0)),)


@grad("Shrink", versions=(9, None))
def _shrink(ctx):
    # y = x -+ bias outside [-lambd, lambd], 0 inside: slope 1 outside, 0 inside
    outside = ctx.op.Greater(ctx.op.Abs(ctx.x), ctx.like(ctx.x, ctx.attr("lambd", 0.5)))
    return (_masked(ctx, outside, ctx.dy, _meets_infinite_derivative(ctx.y)),)


@grad("Elu", versions=(6, None))
def _elu(ctx):
    # for x <= 0, y = alpha * (exp(x) - 1) so dy/dx = y + alpha
    alpha = ctx.like(ctx.y, ctx.attr("alpha", 1.0))
    return (_where_positive(ctx, ctx.dy, ctx.op.Mul(ctx.dy, ctx.op.Add(ctx.y, alpha))),)


@grad("Selu", versions=(6, None))
def _selu(ctx):
    # for x <= 0, y = gamma * alpha * (exp(x) - 1) so dy/dx = y + gamma * alpha
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    op, dy, y = ctx.op, ctx.dy, ctx.y
    below = op.Add(y, ctx.like(y, float(gamma) * float(alpha)))
    return (op.Mul(dy, _where_positive(ctx, ctx.like(y, gamma), below)),)


@grad("Celu", versions=(12, None))
def _celu(ctx):
    # for x <= 0, y = alpha * (exp(x / alpha) - 1) so dy/dx = exp(x / alpha) = y / alpha + 1
    op, y = ctx.op, ctx.y
    below = op.Add(op.Div(y, ctx.like(y, ctx.attr("alpha", 1.0))), ctx.like(y, 1.0))
    return (_where_positive(ctx, ctx.dy, op.Mul(ctx.dy, below)),)


@grad("HardSigmoid", versions=(6, None))
def _hard_sigmoid(ctx):
    op, y, dy = ctx.op, ctx.y, ctx.dy
    linear = op.And(op.Greater(y, ctx.like(y, 0.0)), op.Less(y, ctx.like(y, 1.0)))
    return (op.Where(linear, op.Mul(dy, ctx.like(dy, ctx.attr("alpha", 0.2))), ctx.like(dy, 0.0)),)


@grad("HardSwish", versions=(14, None))
def _hard_swish(ctx):
    # y = x * clip(x/6 + 1/2, 0, 1): derivative 0 up to -3, 1 from 3 on, x/3 + 1/2 strictly
    # between (torch's hardswish_backward at the two kinks); exactly 0 up to -3 (a Where) where
    # the output (0 there) meets an infinite derivative
    op, x = ctx.op, ctx.x
    flat = op.LessOrEqual(x, ctx.like(x, -3.0))
    inner = op.Add(op.Div(x, ctx.like(x, 3.0)), ctx.like(x, 0.5))
    d = op.Where(flat, ctx.like(x, 0.0), op.Where(op.GreaterOrEqual(x, ctx.like(x, 3.0)), ctx.like(x, 1.0), inner))
    dx = op.Mul(ctx.dy, d)
    return (op.Where(flat, ctx.like(dx, 0.0), dx) if _meets_infinite_derivative(ctx.y) else dx,)


unary("Sigmoid", lambda ctx: ctx.op.Mul(ctx.y, ctx.op.Sub(ctx.like(ctx.y, 1.0), ctx.y)))
unary("Softplus", lambda ctx: ctx.op.Sigmoid(ctx.x))


@grad("Softsign")
def _softsign(ctx):
    op, x = ctx.op, ctx.x
    denom = op.Add(ctx.like(x, 1.0), op.Abs(x))
    return (op.Div(ctx.dy, op.Mul(denom, denom)),)


@grad("Mish", versions=(18, None))
def _mish(ctx):
    # y = x * t with t = tanh(softplus(x)); dt/dx = (1 - t^2) * sigmoid(x)
    op, x = ctx.op, ctx.x
    t = op.Tanh(op.Softplus(x))
    d = op.Add(t, op.Mul(op.Mul(x, op.Sigmoid(x)), _one_minus_sq(ctx, t)))
    return (op.Mul(ctx.dy, d),)


@grad("Swish", versions=(24, None))
def _swish(ctx):
    # y = x * s with s = sigmoid(alpha x): dy/dx = s * (1 + alpha x (1 - s))
    op, x = ctx.op, ctx.x
    ax = op.Mul(x, ctx.like(x, ctx.attr("alpha", 1.0)))
    s = op.Sigmoid(ax)
    d = op.Mul(s, op.Add(ctx.like(x, 1.0), op.Mul(ax, op.Sub(ctx.like(x, 1.0), s))))
    return (op.Mul(ctx.dy, d),)


@grad("Gelu", versions=(20, None))
def _gelu(ctx):
    op, x, like = ctx.op, ctx.x, ctx.like
    half = like(x, 0.5)
    if ctx.attr("approximate", "none") == "tanh":
        # y = x/2 (1 + tanh(z)) = x s with s = sigmoid(w), w = 2z = x (2k + 2kc x^2):
        # dy/dx = s (1 + x (1 - s) w'), w' = 2k + 6kc x^2 (fewer full-size passes than the tanh form)
        k2 = 2.0 * _SQRT_2_OVER_PI
        x2 = op.Mul(x, x)
        s = op.Sigmoid(op.Mul(x, op.Add(op.Mul(x2, like(x, k2 * _GELU_TANH_C)), like(x, k2))))
        dw = op.Add(op.Mul(x2, like(x, 3.0 * k2 * _GELU_TANH_C)), like(x, k2))
        d = op.Mul(s, op.Add(like(x, 1.0), op.Mul(op.Mul(x, op.Sub(like(x, 1.0), s)), dw)))
    else:
        # y = x Phi(x): dy/dx = Phi(x) + x phi(x)
        cdf = op.Mul(half, op.Add(like(x, 1.0), op.Erf(op.Mul(x, like(x, _INV_SQRT_2)))))
        pdf = op.Mul(like(x, _INV_SQRT_2PI), op.Exp(op.Mul(op.Mul(x, x), like(x, -0.5))))
        d = op.Add(cdf, op.Mul(x, pdf))
    return (op.Mul(ctx.dy, d),)
