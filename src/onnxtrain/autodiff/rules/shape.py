"""Shape manipulation: Reshape, Transpose, Concat, Split, Tile, Pad, Trilu, ...

These ops only move elements, so each gradient moves ``dy`` back: a reshape to
``Shape(x)``, the inverse permutation, a slice or a concat. Every shape the
gradient needs is read at run time with ``Shape``, so symbolic dims just work.
Rules start at opset 13, onnxtrain's minimum (``ir.io.MIN_OPSET``: older models
are upgraded on load, which turns Squeeze/Unsqueeze/Split attributes into inputs).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.errors import ModelError
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.shapes import rank_of, sum_to_shape


def reshape_to(ctx: GradContext, dy: ir.Value, x: ir.Value) -> ir.Value:
    """``dy`` reshaped to the runtime shape of ``x`` (zero-sized dims included)."""
    return reshape_exactly(ctx.b, dy, ctx.op.Shape(x))


def reshape_exactly(b: GraphBuilder, t: ir.Value, shape: ir.Value) -> ir.Value:
    """``t`` reshaped to ``shape``, a 0 in it meaning a zero-sized dim (not "copy the dim").

    Opset 14+ says so with allowzero. Opset 13 has none: where ``shape`` holds a 0, ``t`` has
    no elements, so its first 0 becomes -1 (inferred as 0) and any other 1, and an Expand to
    ``shape`` brings those back to 0 (broadcasting takes 1 to 0). That costs a copy of each
    reshaped tensor, at opset 13 only.
    """
    op = b.op
    if b.opset >= 14:
        return op.Reshape(t, shape, allowzero=1)
    zero = op.Equal(shape, b.ints([0]))
    first_zero = op.And(zero, op.Equal(op.CumSum(op.Cast(zero, to=int(ir.DataType.INT64)), b.scalar_int(0)),
                                       b.ints([1])))
    no_zero = op.Where(zero, op.Where(first_zero, b.ints([-1]), b.ints([1])), shape)
    return op.Expand(op.Reshape(t, no_zero), shape)


def dim_of(ctx: GradContext, x: ir.Value, axis: int) -> ir.Value:
    """``x.shape[axis]`` as a 1-element int64 tensor (negative axes allowed)."""
    return ctx.op.Gather(ctx.op.Shape(x), ctx.b.ints([axis]), axis=0)


def _reshape_back(ctx: GradContext):
    return (reshape_to(ctx, ctx.dy, ctx.x),)


# Reshape-like ops: the gradient is dy viewed in x's shape, whatever the attributes
# (allowzero, Flatten's axis, Squeeze/Unsqueeze axes as attribute or input).
for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    grad(_op, versions=(13, None))(_reshape_back)


@grad("Transpose", versions=(13, None))
def _transpose(ctx):
    perm = ctx.attr("perm")
    if perm is None:  # the default (reversed axes) is its own inverse
        return (ctx.op.Transpose(ctx.dy),)
    return (ctx.op.Transpose(ctx.dy, perm=[int(i) for i in np.argsort(perm)]),)


@grad("Expand", versions=(13, None))
def _expand(ctx):
    return (sum_to_shape(ctx.b, ctx.dy, ctx.x, ctx.y.shape),)


@grad("Concat", versions=(13, None))
def _concat(ctx):
    # dx_i = dy[..., start_i:start_i + size_i, ...]; sizes read at run time (symbolic dims).
    op, axis = ctx.op, ctx.attr("axis")
    axes = ctx.b.ints([axis])
    start = ctx.b.ints([0])
    grads = []
    for i, x in enumerate(ctx.inputs):
        end = op.Add(start, dim_of(ctx, x, axis))
        grads.append(op.Slice(ctx.dy, start, end, axes) if ctx.needs(i) else None)
        start = end
    return tuple(grads)


@grad("Split", versions=(13, None))
def _split(ctx):
    # Outputs without a gradient become zeros of their shape, so the split sizes
    # (attribute, input or num_outputs) never need to be read. An unused output may have no
    # type (a pass created it): every output has the input's.
    for out in ctx.outputs:
        if out.type is None:
            out.type = ctx.x.type
    parts = [ctx.grad_output(i) for i in range(len(ctx.outputs))]
    return (ctx.op.Concat(*parts, axis=ctx.attr("axis", 0)),)


@grad("Tile", versions=(13, None))
def _tile(ctx):
    # y viewed as [r0, d0, r1, d1, ...]: dx sums the copies, i.e. the even axes.
    op, b = ctx.op, ctx.b
    x_shape = op.Shape(ctx.x)
    repeats = op.Cast(ctx.inputs[1], to=int(ir.DataType.INT64))
    pairs = op.Concat(op.Reshape(repeats, b.ints([-1, 1])), op.Reshape(x_shape, b.ints([-1, 1])), axis=1)
    split = reshape_exactly(ctx.b, ctx.dy, op.Reshape(pairs, b.ints([-1])))  # a repeat may be 0
    copy_axes = op.Range(b.scalar_int(0), op.Mul(op.Size(x_shape), b.scalar_int(2)), b.scalar_int(2))
    return (op.ReduceSum(split, copy_axes, keepdims=0),)


def _pad_source_index(ctx: GradContext, mode: str, out_len, size, begin, end):
    """For each position along a padded axis, the position of x it copies (edge/reflect/wrap)."""
    op, b = ctx.op, ctx.b
    zero = b.scalar_int(0)
    positions = op.Range(zero, out_len, b.scalar_int(1))
    if mode == "wrap":
        # onnxruntime crops first (negative pads), then wraps the cropped data: its length is the period
        crop_start = op.Max(op.Neg(begin), zero)
        period = op.Sub(op.Sub(size, crop_start), op.Max(op.Neg(end), zero))
        # integer Mod takes the divisor's sign: always >= 0 here
        return op.Add(op.Mod(op.Sub(positions, op.Max(begin, zero)), period), crop_start)
    j = op.Sub(positions, begin)
    last = op.Sub(size, b.scalar_int(1))
    if mode == "edge":
        return op.Min(op.Max(j, zero), last)
    # reflect (edge not repeated) is periodic with period 2*(size-1); a size-1 axis reads 0
    period = op.Max(op.Mul(last, b.scalar_int(2)), b.scalar_int(1))
    k = op.Mod(j, period)
    return op.Min(k, op.Sub(period, k))


def _pad_copy_grad(ctx: GradContext, mode: str, pads: ir.Value, axes: list[int]) -> ir.Value:
    """Adjoint of an edge/reflect/wrap Pad. Padding is separable and each padded axis is
    a gather of x along that axis with repeated indices, so dy is summed back per axis
    with a one-hot [out_len, size] matrix (no scatter-add needed, any opset)."""
    op, b = ctx.op, ctx.b
    rank = rank_of(ctx.x)
    dy = ctx.dy
    for i, axis in enumerate(axes):
        begin = op.Reshape(op.Gather(pads, b.ints([i]), axis=0), b.ints([]))
        end = op.Reshape(op.Gather(pads, b.ints([i + len(axes)]), axis=0), b.ints([]))
        size = op.Reshape(dim_of(ctx, ctx.x, axis), b.ints([]))
        out_len = op.Reshape(dim_of(ctx, dy, axis), b.ints([]))
        src = _pad_source_index(ctx, mode, out_len, size, begin, end)
        onehot = op.Equal(op.Reshape(src, b.ints([-1, 1])), op.Range(b.scalar_int(0), size, b.scalar_int(1)))
        perm = [a for a in range(rank) if a != axis] + [axis]  # the padded axis last
        moved = op.MatMul(op.Transpose(dy, perm=perm), op.Cast(onehot, to=int(dy.dtype)))
        dy = op.Transpose(moved, perm=[int(p) for p in np.argsort(perm)])
    return dy


@grad("Pad", versions=(13, None))
def _pad(ctx):
    op = ctx.op
    mode = ctx.attr("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    pads = op.Cast(ctx.inputs[1], to=int(ir.DataType.INT64))
    axes = ctx.inputs[3] if len(ctx.inputs) > 3 else None
    if mode == "constant":
        # Pad by -pads crops what was added and zero-fills what was cropped: the adjoint.
        dx = op.Pad(ctx.dy, op.Neg(pads), None, axes) if axes is not None else op.Pad(ctx.dy, op.Neg(pads))
        if not ctx.needs(2):
            return (dx,)
        # constant_value receives the gradient of every padded position
        total = op.Sub(op.ReduceSum(ctx.dy, keepdims=0), op.ReduceSum(dx, keepdims=0))
        return dx, None, op.Reshape(total, op.Shape(ctx.inputs[2]))
    if mode not in ("edge", "reflect", "wrap"):
        raise ModelError(f"Pad gradient: unknown mode {mode!r} (expected constant, edge, reflect or wrap)")
    rank = rank_of(ctx.x)
    if rank is None:
        raise ModelError(f"Pad gradient in {mode!r} mode needs the rank of {ctx.x.name!r}")
    if axes is None:
        axis_list = list(range(rank))
    else:
        const = ctx.const_input(3)
        if const is None:
            raise ModelError(f"Pad gradient in {mode!r} mode needs constant axes (node {ctx.node.name!r})")
        axis_list = [int(a) % rank for a in np.asarray(const).reshape(-1)]
    return (_pad_copy_grad(ctx, mode, pads, axis_list),)


@grad("ReverseSequence", versions=(10, None))
def _reverse_sequence(ctx):
    # a permutation within each sequence that is its own inverse (positions past a sequence's
    # length stay in place): the gradient is the same reversal of dy
    attrs = {"batch_axis": ctx.attr("batch_axis", 1), "time_axis": ctx.attr("time_axis", 0)}
    return ctx.op.ReverseSequence(ctx.dy, ctx.inputs[1], **attrs), None


@grad("Trilu", versions=(14, None))
def _trilu(ctx):
    # y = mask * x with a fixed mask: dx = mask * dy, the same Trilu applied to dy
    k = ctx.inputs[1] if len(ctx.inputs) > 1 else None
    inputs = [ctx.dy] if k is None else [ctx.dy, k]
    return (ctx.op.Trilu(*inputs, upper=ctx.attr("upper", 1)),)


_CRD_PERM = [0, 1, 4, 2, 5, 3]  # DepthToSpace CRD: [N, C', b, b, H, W] -> [N, C', H, b, W, b]


@grad("DepthToSpace", versions=(13, None))
def _depth_to_space(ctx):
    op, b = ctx.op, ctx.b
    blocksize = ctx.attr("blocksize")
    mode = ctx.attr("mode", "DCR")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "DCR":  # SpaceToDepth is exactly the inverse permutation of DCR
        return (op.SpaceToDepth(ctx.dy, blocksize=blocksize),)
    # CRD: view dy as [N, C', H, b, W, b], undo the transpose, reshape to x's shape
    width = dim_of(ctx, ctx.x, 3)
    view = op.Concat(b.ints([0, 0, -1, blocksize]), width, b.ints([blocksize]), axis=0)
    moved = op.Transpose(op.Reshape(ctx.dy, view), perm=[int(p) for p in np.argsort(_CRD_PERM)])
    return (reshape_to(ctx, moved, ctx.x),)


@grad("SpaceToDepth", versions=(13, None))
def _space_to_depth(ctx):
    return (ctx.op.DepthToSpace(ctx.dy, blocksize=ctx.attr("blocksize"), mode="DCR"),)
