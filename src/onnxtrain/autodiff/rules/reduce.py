"""Reductions: ReduceSum, ReduceMean and friends."""

from __future__ import annotations

import numpy as np

from onnxtrain.autodiff.registry import GradContext, grad


def reduction_axes(ctx: GradContext) -> list[int] | None:
    """The reduced axes as a list, or None for "all axes"; from the attribute or input 1."""
    axes = ctx.attr("axes")
    if axes is None and len(ctx.inputs) > 1 and ctx.inputs[1] is not None:
        const = ctx.const_input(1)
        if const is None:
            raise NotImplementedError(f"{ctx.node.op_type} with runtime-computed axes")
        axes = [int(a) for a in np.asarray(const).reshape(-1)]
    if axes is not None and len(axes) == 0:
        axes = None
    return axes


def expand_back(ctx: GradContext, dy):
    """Broadcast the gradient of a reduction back to the input's shape."""
    b = ctx.b
    axes = reduction_axes(ctx)
    if axes is None and ctx.attr("noop_with_empty_axes", 0):
        return dy  # reduction was the identity
    if not ctx.attr("keepdims", 1) and axes is not None:
        dy = b.unsqueeze(dy, axes)
    return ctx.op.Expand(dy, ctx.op.Shape(ctx.x))


def reduced_count(ctx: GradContext):
    """Number of elements averaged by a reduction, as a scalar of the input's type."""
    op = ctx.op
    axes = reduction_axes(ctx)
    shape = op.Shape(ctx.x)
    if axes is None:
        count = op.Size(ctx.x)
    else:
        count = op.ReduceProd(op.Gather(shape, ctx.b.ints(axes), axis=0), keepdims=0)
    return op.Cast(count, to=int(ctx.x.dtype))


@grad("ReduceSum")
def _reduce_sum(ctx):
    return (expand_back(ctx, ctx.dy),)


@grad("ReduceMean")
def _reduce_mean(ctx):
    return (ctx.op.Div(expand_back(ctx, ctx.dy), reduced_count(ctx)),)
