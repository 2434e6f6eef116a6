"""Gradient rules: softmax, normalization (Layer/Batch/Instance/Lp, LRN) and dropout.

Normalizations use the closed form of the standardization's gradient (ReduceMean of
``g`` and ``g * xhat``) rather than differentiating the mean/variance subgraph, and
reuse what the forward node already computes: Softmax/LogSoftmax their output,
LayerNormalization its Mean/InvStdDev outputs and Dropout its mask (outputs that are
missing are added to the forward node, so nothing is recomputed or re-randomized).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.ir.shapes import normalize_axis, rank_of, sum_to_shape

_LOW_PRECISION = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


# -- helpers ---------------------------------------------------------------------
def rank(x: ir.Value) -> int:
    r = rank_of(x)
    if r is None:
        raise NotImplementedError(f"gradient needs the rank of {x.name!r}, which shape inference did not find")
    return r


def reduce_sum(ctx: GradContext, x: ir.Value, axes, keepdims: bool = True) -> ir.Value:
    """ReduceSum over ``axes`` (None: all), valid at any opset."""
    if ctx.b.opset < 13:  # ReduceSum took axes as an attribute before opset 13
        return ctx.op.ReduceSum(x, axes=None if axes is None else list(axes), keepdims=int(keepdims))
    return ctx.b.reduce_sum(x, axes, keepdims)


def unsqueeze(ctx: GradContext, x: ir.Value, axes) -> ir.Value:
    if ctx.b.opset < 13:
        return ctx.op.Unsqueeze(x, axes=list(axes))
    return ctx.b.unsqueeze(x, axes)


def standardize(ctx: GradContext, x: ir.Value, axes, eps: float):
    """(xhat, inv_std) of x over ``axes`` (population variance), kept broadcastable."""
    op, b = ctx.op, ctx.b
    centered = op.Sub(x, b.reduce("ReduceMean", x, axes, keepdims=True))
    var = b.reduce("ReduceMean", op.Mul(centered, centered), axes, keepdims=True)
    inv_std = op.Reciprocal(op.Sqrt(op.Add(var, b.like(x, eps))))
    return op.Mul(centered, inv_std), inv_std


def standardize_grad(ctx: GradContext, g: ir.Value, xhat: ir.Value, inv_std: ir.Value, axes) -> ir.Value:
    """dL/dx for xhat = (x - mean(x)) * inv_std over ``axes``, given g = dL/dxhat."""
    op, b = ctx.op, ctx.b

    def mean(v):
        return b.reduce("ReduceMean", v, axes, keepdims=True)

    return op.Mul(inv_std, op.Sub(op.Sub(g, mean(g)), op.Mul(xhat, mean(op.Mul(g, xhat)))))


# -- Softmax / LogSoftmax ----------------------------------------------------------
def _softmax_grad(ctx: GradContext, y, dy, axis: int, log: bool):
    op = ctx.op
    if log:  # y = log p: dx = dy - p * sum(dy)
        return op.Sub(dy, op.Mul(op.Exp(y), reduce_sum(ctx, dy, [axis])))
    return op.Mul(y, op.Sub(dy, reduce_sum(ctx, op.Mul(dy, y), [axis])))


def _softmax_rule(log: bool):
    def rule(ctx):
        return (_softmax_grad(ctx, ctx.y, ctx.dy, ctx.attr("axis", -1), log),)
    return rule


def _softmax_2d_rule(log: bool):
    """Before opset 13 the input is coerced to 2-D [prod(d[:axis]), prod(d[axis:])]."""
    def rule(ctx):
        op, axis = ctx.op, ctx.attr("axis", 1)
        dx = _softmax_grad(ctx, op.Flatten(ctx.y, axis=axis), op.Flatten(ctx.dy, axis=axis), 1, log)
        return (op.Reshape(dx, op.Shape(ctx.x)),)
    return rule


grad("Softmax", versions=(13, None))(_softmax_rule(log=False))
grad("LogSoftmax", versions=(13, None))(_softmax_rule(log=True))
grad("Softmax", versions=(1, 12))(_softmax_2d_rule(log=False))
grad("LogSoftmax", versions=(1, 12))(_softmax_2d_rule(log=True))


# -- LayerNormalization ------------------------------------------------------------
@grad("LayerNormalization", versions=(17, None))
def _layer_norm(ctx):
    op, b = ctx.op, ctx.b
    x, scale = ctx.inputs[:2]
    bias = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    r = rank(x)
    axes = list(range(normalize_axis(ctx.attr("axis", -1), r), r))
    stash = ir.DataType.FLOAT if ctx.attr("stash_type", 1) == 1 else x.dtype
    mean = ctx.forward_output(1, stash, "mean")
    inv_std = ctx.forward_output(2, stash, "inv_std_dev")
    # work in the statistics' precision for fp16/bf16 inputs, else in x's own
    work = mean.dtype if x.dtype in _LOW_PRECISION else x.dtype
    xw, dy = b.cast_to(x, work), b.cast_to(ctx.dy, work)
    mean, inv_std = b.cast_to(mean, work), b.cast_to(inv_std, work)
    xhat = op.Mul(op.Sub(xw, mean), inv_std)
    grads = [None] * len(ctx.inputs)
    if ctx.needs(0):
        dx = standardize_grad(ctx, op.Mul(dy, b.cast_to(scale, work)), xhat, inv_std, axes)
        d_mean = ctx.grad_outputs[1] if len(ctx.grad_outputs) > 1 else None
        d_inv = ctx.grad_outputs[2] if len(ctx.grad_outputs) > 2 else None
        if d_mean is not None or d_inv is not None:
            # d mean/dx = 1/n; d inv_std/dx = -inv_std^2 * xhat / n
            extra = b.cast_to(d_mean, work) if d_mean is not None else b.like(xw, 0.0)
            if d_inv is not None:
                d_inv = op.Mul(b.cast_to(d_inv, work), op.Mul(inv_std, inv_std))
                extra = op.Sub(extra, op.Mul(d_inv, xhat))
            n = op.Cast(op.Div(op.Size(x), op.Size(mean)), to=int(work))
            dx = op.Add(dx, op.Div(extra, n))
        grads[0] = b.cast_to(dx, x.dtype)
    if ctx.needs(1):
        grads[1] = b.cast_to(sum_to_shape(b, op.Mul(dy, xhat), scale, x.shape), scale.dtype)
    if bias is not None and ctx.needs(2):
        grads[2] = sum_to_shape(b, ctx.dy, bias, x.shape)
    return tuple(grads)


# -- BatchNormalization / InstanceNormalization ------------------------------------
def _per_channel_grads(ctx, x, xhat, inv_std, stat_axes, eps, norm_axes):
    """Gradients of y = xhat * scale + B for a per-channel (axis 1) scale and B.

    ``norm_axes``: the axes the statistics were computed over from x, or None when the
    statistics are the given mean/var inputs (BatchNormalization in inference mode).
    """
    op, b = ctx.op, ctx.b
    dy = ctx.dy
    scale = b.cast_to(ctx.inputs[1], x.dtype)
    grads = [None] * len(ctx.inputs)
    if ctx.needs(0):
        g = op.Mul(dy, unsqueeze(ctx, scale, stat_axes))
        grads[0] = op.Mul(g, inv_std) if norm_axes is None else standardize_grad(ctx, g, xhat, inv_std, norm_axes)
    needs_stats = norm_axes is None and len(ctx.inputs) > 4 and (ctx.needs(3) or ctx.needs(4))
    d_scale = reduce_sum(ctx, op.Mul(dy, xhat), stat_axes, keepdims=False)
    d_bias = reduce_sum(ctx, dy, stat_axes, keepdims=False)
    if ctx.needs(1):
        grads[1] = b.cast_to(d_scale, ctx.inputs[1].dtype)
    if ctx.needs(2):
        grads[2] = b.cast_to(d_bias, ctx.inputs[2].dtype)
    if needs_stats:  # inference mode: y is differentiable in the given mean and var too
        var = b.cast_to(ctx.inputs[4], x.dtype)
        inv = op.Reciprocal(op.Sqrt(op.Add(var, b.like(x, eps))))
        scaled_inv = op.Mul(scale, inv)
        if ctx.needs(3):
            grads[3] = b.cast_to(op.Neg(op.Mul(d_bias, scaled_inv)), ctx.inputs[3].dtype)
        if ctx.needs(4):
            d_var = op.Mul(op.Mul(d_scale, op.Mul(scaled_inv, inv)), b.like(x, -0.5))
            grads[4] = b.cast_to(d_var, ctx.inputs[4].dtype)
    return tuple(grads)


def _batch_norm(ctx, training: bool):
    op, b = ctx.op, ctx.b
    x = ctx.x
    # the statistics outputs are buffers (PyTorch's running statistics never get a gradient):
    # a gradient that reaches one that depends on x (the saved statistics; the running ones unless
    # momentum is 1) would be ignored, and the loss's silently wrong
    depends_on_x = [ctx.attr("momentum", 0.9) != 1.0] * 2 + [True] * 2
    if any(g is not None and depends for g, depends in zip(ctx.grad_outputs[1:], depends_on_x)):
        raise NotImplementedError("a gradient through BatchNormalization's statistics outputs (running or "
                                  "saved mean and variance): only its normalized output is differentiated")
    stat_axes = [0, *range(2, rank(x))]
    eps = ctx.attr("epsilon", 1e-5)
    if training:  # batch statistics depend on x; the running stats get no gradient
        xhat, inv_std = standardize(ctx, x, stat_axes, eps)
    else:
        mean, var = (unsqueeze(ctx, b.cast_to(v, x.dtype), stat_axes) for v in ctx.inputs[3:5])
        inv_std = op.Reciprocal(op.Sqrt(op.Add(var, b.like(x, eps))))
        xhat = op.Mul(op.Sub(x, mean), inv_std)
    return _per_channel_grads(ctx, x, xhat, inv_std, stat_axes, eps, stat_axes if training else None)


@grad("BatchNormalization", versions=(9, 13))
def _batch_norm_9(ctx):
    # training mode is signalled by the optional outputs (mean, var, saved_mean, saved_var)
    return _batch_norm(ctx, training=len(ctx.outputs) > 1)


@grad("BatchNormalization", versions=(14, None))
def _batch_norm_14(ctx):
    return _batch_norm(ctx, training=bool(ctx.attr("training_mode", 0)))


@grad("LpNormalization", versions=(1, None))
def _lp_normalization(ctx):
    # y = x / n with n = ||x||_p along axis: dx = (dy - dn/dx * sum(dy * y)) / n, where dn/dx
    # is y for p = 2 and sign(x) for p = 1 (the only orders the op has)
    op, b = ctx.op, ctx.b
    axis, p = ctx.attr("axis", -1), ctx.attr("p", 2)
    if p not in (1, 2):
        raise NotImplementedError(f"p={p} (LpNormalization defines p = 1 and 2)")
    x, y, dy = ctx.x, ctx.y, ctx.dy
    norm = b.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis])
    slope = y if p == 2 else op.Sign(x)
    projected = b.reduce_sum(op.Mul(dy, y), [axis])
    return (op.Div(op.Sub(dy, op.Mul(slope, projected)), norm),)


@grad("LRN", versions=(13, None))
def _lrn(ctx):
    # y = x * d^-beta with d = bias + alpha / size * (window sum of x^2 over channels):
    # dx = dy * d^-beta - 2 alpha beta / size * x * (adjoint window sum of dy * x * d^(-beta-1));
    # the adjoint window is the forward one mirrored (an even size is lopsided)
    op, b = ctx.op, ctx.b
    x, dy = ctx.x, ctx.dy
    size = int(ctx.attr("size"))
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    shape = op.Shape(x)
    rest = op.ReduceProd(op.Slice(shape, b.ints([2]), b.ints([np.iinfo(np.int64).max])), keepdims=1)  # N may be 0
    channels_view = op.Concat(op.Slice(shape, b.ints([0]), b.ints([1])), b.ints([1]),
                              op.Slice(shape, b.ints([1]), b.ints([2])), rest, axis=0)  # [N, 1, C, rest]
    ones = b.const(np.ones([1, 1, size, 1], x.dtype.numpy()))

    def channel_window_sum(t, before, after):
        return op.Reshape(op.Conv(op.Reshape(t, channels_view), ones, pads=[before, 0, after, 0]), shape)

    below, above = (size - 1) // 2, size - 1 - (size - 1) // 2
    denominator = op.Add(ctx.like(x, bias), op.Mul(ctx.like(x, alpha / size),
                                                   channel_window_sum(op.Mul(x, x), below, above)))
    scale = op.Pow(denominator, ctx.like(x, -beta))
    inner = op.Div(op.Mul(op.Mul(dy, x), scale), denominator)
    spread = channel_window_sum(inner, above, below)
    return (op.Sub(op.Mul(dy, scale), op.Mul(ctx.like(x, 2 * alpha * beta / size), op.Mul(x, spread))),)


@grad("InstanceNormalization", versions=(6, None))
def _instance_norm(ctx):
    x = ctx.x
    r = rank(x)
    eps = ctx.attr("epsilon", 1e-5)
    spatial = list(range(2, r))  # statistics are per (n, c)
    xhat, inv_std = standardize(ctx, x, spatial, eps)
    return _per_channel_grads(ctx, x, xhat, inv_std, [0, *spatial], eps, spatial)


# -- Dropout -----------------------------------------------------------------------
@grad("Dropout", versions=(12, None))
def _dropout(ctx):
    op, b = ctx.op, ctx.b
    dy = ctx.dy
    inputs = ctx.inputs
    training = inputs[2] if len(inputs) > 2 else None
    training_const = ctx.const_input(2)
    if training is None or (training_const is not None and not bool(training_const)):
        return (dy,)  # inference mode: identity
    # reuse the forward mask: recomputing it would draw new random numbers
    mask = ctx.forward_output(1, ir.DataType.BOOL, "mask")
    ratio = inputs[1] if len(inputs) > 1 and inputs[1] is not None else b.like(dy, 0.5)
    keep = op.Sub(b.like(dy, 1.0), b.cast_to(ratio, dy.dtype))
    dx = op.Div(b.keep_where(mask, dy), keep)  # dy * mask / keep, as torch computes it
    if training_const is None:  # training_mode known only at run time
        dx = op.Where(training, dx, dy)
    return (dx,)
