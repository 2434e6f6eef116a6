"""Reductions (Reduce*), CumSum and CumProd.

The reduced axes are an attribute up to opset 17 (12 for ReduceSum) and an optional input
from opset 18 (13 for ReduceSum). The helpers below read either form, accept axes computed
at run time (opset 13+), and handle ``keepdims`` and ``noop_with_empty_axes``, so each rule
writes its gradient as ``keep_dims(dy) * (something shaped like x)``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import Broadcast, GradContext, grad


def _axes(ctx: GradContext) -> list[int] | ir.Value | None:
    """The reduced axes: a list (attribute or constant input), a run-time value, or None for all."""
    axes = ctx.attr("axes")
    if axes is None and len(ctx.inputs) > 1 and ctx.inputs[1] is not None:
        const = ctx.const_input(1)
        if const is None:
            return ctx.inputs[1]
        axes = [int(a) for a in np.asarray(const).reshape(-1)]
    return list(axes) if axes else None


def reduction_axes(ctx: GradContext) -> list[int] | None:
    """The reduced axes as a list, or None for "all axes"; from the attribute or a constant input 1."""
    axes = _axes(ctx)
    if isinstance(axes, ir.Value):
        raise NotImplementedError(f"{ctx.node.op_type} with runtime-computed axes")
    return axes


def keep_dims(ctx: GradContext, v: ir.Value) -> ir.Value:
    """``v``, shaped like the reduction's output, reshaped to broadcast against the input.

    A no-op for keepdims=1, for a reduction over all axes (a scalar) and for the identity
    (noop_with_empty_axes with no axes); otherwise the reduced axes are unsqueezed back.
    Negative axes need no care: Unsqueeze reads them against its output's rank, the input's.
    """
    axes = _axes(ctx)
    if ctx.attr("keepdims", 1) or axes is None:
        return v
    if ctx.opset < 13:
        return ctx.op.Unsqueeze(v, axes=axes)  # axes became an input of Unsqueeze at opset 13
    return ctx.b.unsqueeze(v, axes)


def expand_back(ctx: GradContext, dy: ir.Value) -> Broadcast:
    """The gradient of a reduction, broadcast back over the input's shape (by the builder's sum,
    or by an Expand where nothing else flows into the input)."""
    return Broadcast(keep_dims(ctx, dy))


def reduce_again(ctx: GradContext, op_type: str, v: ir.Value) -> ir.Value:
    """Reduce ``v`` (shaped like the input) over the node's axes with keepdims=1."""
    axes = _axes(ctx)
    noop = bool(ctx.attr("noop_with_empty_axes", 0))
    if axes is None and noop:
        return v  # the reduction was the identity
    # a run-time axes value may turn out empty: pass noop on so that case stays the identity
    return ctx.b.reduce(op_type, v, axes, keepdims=True, noop_with_empty_axes=noop and isinstance(axes, ir.Value))


def reduced_count(ctx: GradContext) -> ir.Value:
    """Number of elements reduced into each output element, as a scalar of the input's type."""
    op, dtype = ctx.op, int(ctx.x.dtype)
    # size(x) / size(y) holds for any axes, keepdims and noop, static or run-time
    return op.Div(op.Cast(op.Size(ctx.x), to=dtype), op.Cast(op.Size(ctx.y), to=dtype))


@grad("ReduceSum")
def _reduce_sum(ctx):
    return (expand_back(ctx, ctx.dy),)


@grad("ReduceMean")
def _reduce_mean(ctx):
    return (expand_back(ctx, ctx.op.Div(ctx.dy, reduced_count(ctx))),)


def _reduce_select(ctx):
    """ReduceMax/ReduceMin: the gradient goes to the elements equal to the result; ties split it evenly."""
    op, x = ctx.op, ctx.x
    hit = op.Equal(x, keep_dims(ctx, ctx.y))
    ties = reduce_again(ctx, "ReduceSum", op.Cast(hit, to=int(x.dtype)))
    return (op.Where(hit, op.Div(keep_dims(ctx, ctx.dy), ties), ctx.like(x, 0.0)),)


grad("ReduceMax")(_reduce_select)
grad("ReduceMin")(_reduce_select)


@grad("ReduceProd")
def _reduce_prod(ctx):
    # The gradient of one element is the product of the others. Written without dividing by a
    # zero: with z zeros in a slice and p the product of its nonzeros, that is p / x when z = 0,
    # p at the zero when z = 1, and 0 otherwise.
    op, x = ctx.op, ctx.x
    zero, one = ctx.like(x, 0.0), ctx.like(x, 1.0)
    is_zero = op.Equal(x, zero)
    x_safe = op.Where(is_zero, one, x)
    p = reduce_again(ctx, "ReduceProd", x_safe)
    z = reduce_again(ctx, "ReduceSum", op.Cast(is_zero, to=int(x.dtype)))
    others = op.Where(is_zero, op.Where(op.Equal(z, one), p, zero),
                      op.Where(op.Equal(z, zero), op.Div(p, x_safe), zero))
    return (op.Mul(keep_dims(ctx, ctx.dy), others),)


@grad("ReduceL1")
def _reduce_l1(ctx):
    return (ctx.op.Mul(keep_dims(ctx, ctx.dy), ctx.op.Sign(ctx.x)),)


@grad("ReduceL2")
def _reduce_l2(ctx):
    # x / ||x||, with 0 where the norm is 0 (the subgradient torch picks)
    op, y = ctx.op, ctx.y
    zero = ctx.like(y, 0.0)
    scale = op.Where(op.Equal(y, zero), zero, op.Div(ctx.dy, y))
    return (op.Mul(keep_dims(ctx, scale), ctx.x),)


@grad("ReduceSumSquare")
def _reduce_sum_square(ctx):
    return (ctx.op.Mul(keep_dims(ctx, ctx.op.Mul(ctx.dy, ctx.like(ctx.dy, 2.0))), ctx.x),)


@grad("ReduceLogSum")
def _reduce_log_sum(ctx):
    return (expand_back(ctx, ctx.op.Div(ctx.dy, ctx.op.Exp(ctx.y))),)  # exp(y) is the sum


@grad("ReduceLogSumExp")
def _reduce_log_sum_exp(ctx):
    op = ctx.op
    softmax = op.Exp(op.Sub(ctx.x, keep_dims(ctx, ctx.y)))  # exp(x - y): stable, y >= max(x)
    return (op.Mul(keep_dims(ctx, ctx.dy), softmax),)


@grad("CumSum", versions=(11, None))
def _cumsum(ctx):
    # each input element feeds the outputs after it: the adjoint is the cumsum in the other direction
    reverse = 1 - int(ctx.attr("reverse", 0))
    return (ctx.op.CumSum(ctx.dy, ctx.inputs[1], exclusive=int(ctx.attr("exclusive", 0)), reverse=reverse), None)


@grad("CumProd", versions=(26, None))
def _cumprod(ctx):
    # Each output is a product over a prefix (in the direction of ``reverse``), so where x has
    # no zero, dx = adjoint-cumsum(dy * y) / x. Past the first zero every prefix holding x_i
    # also holds that zero: dx is 0 there. At the first zero itself, dx is the adjoint cumsum
    # of dy times the products taken with that zero read as 1 (torch.cumprod's gradient too).
    op, b = ctx.op, ctx.b
    x, axis = ctx.inputs
    exclusive, reverse = int(ctx.attr("exclusive", 0)), int(ctx.attr("reverse", 0))

    def adjoint(t):
        return op.CumSum(t, axis, exclusive=exclusive, reverse=1 - reverse)

    is_zero = op.Equal(x, ctx.like(x, 0.0))
    zeros_so_far = op.CumSum(op.Cast(is_zero, to=int(ir.DataType.INT32)), axis, reverse=reverse)
    before = op.Equal(zeros_so_far, b.const(np.array(0, np.int32)))
    first = op.And(is_zero, op.Equal(zeros_so_far, b.const(np.array(1, np.int32))))
    one = ctx.like(x, 1.0)
    d_before = op.Div(adjoint(op.Mul(ctx.dy, ctx.y)), op.Where(before, x, one))
    skipping_first = op.CumProd(op.Where(first, one, x), axis, exclusive=exclusive, reverse=reverse)
    d_first = adjoint(op.Mul(ctx.dy, skipping_first))
    return op.Where(before, d_before, op.Where(first, d_first, ctx.like(x, 0.0))), None
