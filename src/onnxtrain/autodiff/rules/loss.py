"""Gradient rules: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both compute a per-target loss ``l = -w[label] * z[n, label, d...]`` (``z``: log-probs,
``w = 0`` for ignored targets) and reduce it: "none", "sum", or "mean" = ``sum(l) / sum(w)``
(the target count without weights; a zero gradient where ``sum(w)`` is 0, as PyTorch's).
Labels and class weights are not differentiable.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.autodiff.rules.index import SCATTER_ADD_OPSET
from onnxtrain.autodiff.rules.nn import rank, reduce_sum, unsqueeze


def _per_target(ctx: GradContext):
    """Labels safe to index with (ignored ones -> class 0) and per-target weights (None: all 1)."""
    op, b = ctx.op, ctx.b
    labels = b.cast_to(ctx.inputs[1], ir.DataType.INT64)
    weights = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    ignore = ctx.attr("ignore_index")
    if ignore is None:
        return labels, (op.Gather(weights, labels, axis=0) if weights is not None else None)
    valid = op.Not(op.Equal(labels, b.scalar_int(ignore)))
    labels = op.Where(valid, labels, b.scalar_int(0))
    w = op.Gather(weights, labels, axis=0) if weights is not None else ctx.like(ctx.x, 1.0)
    return labels, op.Where(valid, w, ctx.like(ctx.x, 0.0))


def _is_label(ctx: GradContext, labels):
    """Boolean [N, C, d...]: class c (axis 1) is the target's label."""
    op, b = ctx.op, ctx.b
    classes = op.Range(b.scalar_int(0), op.Gather(op.Shape(ctx.x), b.scalar_int(1)), b.scalar_int(1))
    r = rank(ctx.x)
    if r > 2:
        classes = unsqueeze(ctx, classes, list(range(1, r - 1)))
    return op.Equal(unsqueeze(ctx, labels, [1]), classes)


def _coefficient(ctx: GradContext, labels, w):
    """dL/d(-z[n, label, d...]) per target, broadcastable against [N, C, d...]."""
    op = ctx.op
    reduction = ctx.attr("reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    coef = ctx.dy
    if reduction == "mean":
        if w is None:
            total = op.Cast(op.Size(labels), to=int(coef.dtype))
        else:
            # every target ignored (or weighted 0): the loss is 0/0, its gradient 0 as PyTorch's
            # (dividing by the zero total would make 0 * inf = NaN)
            total = reduce_sum(ctx, w, None, False)
            zero = ctx.like(ctx.x, 0.0)
            total = op.Where(op.Equal(total, zero), ctx.like(ctx.x, 1.0), total)
        coef = op.Div(coef, total)
    if w is not None:
        coef = op.Mul(coef, w)
    if reduction == "none" or w is not None:  # per target: insert the class axis
        coef = unsqueeze(ctx, coef, [1])
    return coef


@grad("SoftmaxCrossEntropyLoss", versions=(12, None))
def _softmax_cross_entropy(ctx):
    op = ctx.op
    scores = ctx.x
    prob = op.Exp(ctx.forward_output(1, scores.dtype, "log_prob"))  # reuse the forward's softmax
    dx = None
    if ctx.grad_outputs[0] is not None:  # coef * (softmax - onehot)
        labels, w = _per_target(ctx)
        coef = _coefficient(ctx, labels, w)
        if ctx.opset >= SCATTER_ADD_OPSET:
            # coef * softmax, then -coef added at each target's label: two passes over the
            # [N, C, ...] scores instead of building a one-hot (Equal, Cast, Sub: ~3x slower)
            at_label = unsqueeze(ctx, labels, [1])
            minus_coef = op.Expand(op.Neg(coef), op.Shape(at_label))
            dx = op.ScatterElements(op.Mul(coef, prob), at_label, minus_coef, axis=1, reduction="add")
        else:
            onehot = op.Cast(_is_label(ctx, labels), to=int(scores.dtype))
            dx = op.Mul(coef, op.Sub(prob, onehot))
    d_log_prob = ctx.grad_outputs[1] if len(ctx.grad_outputs) > 1 else None
    if d_log_prob is not None:  # LogSoftmax over the class axis
        d_lp = op.Sub(d_log_prob, op.Mul(prob, reduce_sum(ctx, d_log_prob, [1])))
        dx = d_lp if dx is None else op.Add(dx, d_lp)
    return (dx,)


@grad("NegativeLogLikelihoodLoss", versions=(12, None))
def _negative_log_likelihood(ctx):
    labels, w = _per_target(ctx)
    op = ctx.op
    return (op.Where(_is_label(ctx, labels), op.Neg(_coefficient(ctx, labels, w)), ctx.like(ctx.x, 0.0)),)
