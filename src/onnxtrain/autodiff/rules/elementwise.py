"""Elementwise arithmetic and activations."""

from __future__ import annotations

from onnxtrain.autodiff.registry import grad, unary


@grad("Add", broadcasting=True)
def _add(ctx):
    return ctx.dy, ctx.dy


@grad("Sub", broadcasting=True)
def _sub(ctx):
    return ctx.dy, (ctx.op.Neg(ctx.dy) if ctx.needs(1) else None)


@grad("Mul", broadcasting=True)
def _mul(ctx):
    a, b = ctx.inputs
    op = ctx.op
    return (op.Mul(ctx.dy, b) if ctx.needs(0) else None,
            op.Mul(ctx.dy, a) if ctx.needs(1) else None)


@grad("Div", broadcasting=True)
def _div(ctx):
    a, b = ctx.inputs
    op = ctx.op
    da = op.Div(ctx.dy, b) if ctx.needs(0) else None
    db = op.Neg(op.Div(op.Mul(ctx.dy, ctx.y), b)) if ctx.needs(1) else None  # -dy * a / b^2 = -dy * y / b
    return da, db


@grad("Neg")
def _neg(ctx):
    return (ctx.op.Neg(ctx.dy),)


@grad("Identity")
def _identity(ctx):
    return (ctx.dy,)


@grad("Relu")
def _relu(ctx):
    op = ctx.op
    positive = op.Greater(ctx.y, ctx.like(ctx.y, 0.0))
    return (op.Where(positive, ctx.dy, ctx.like(ctx.dy, 0.0)),)


unary("Exp", lambda ctx: ctx.y)
unary("Tanh", lambda ctx: ctx.op.Sub(ctx.like(ctx.y, 1.0), ctx.op.Mul(ctx.y, ctx.y)))
unary("Sigmoid", lambda ctx: ctx.op.Mul(ctx.y, ctx.op.Sub(ctx.like(ctx.y, 1.0), ctx.y)))
