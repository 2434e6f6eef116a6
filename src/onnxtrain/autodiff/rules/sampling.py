"""Resampling: Resize (nearest, linear and cubic interpolation; F.interpolate, nn.Upsample).

Every Resize mode is separable: along each axis, output position ``i`` is a fixed weighted sum
of input positions (the weights depend on the axis' input and output lengths, its scale, its
roi and the node's attributes, never on the data). So along one axis Resize is a product with
an ``[m, n]`` matrix ``A``, and its gradient is the product with ``Aᵀ``. The rule builds ``A``
by resizing an ``n x n`` identity along its first axis with the node's own attributes and that
axis' scale or size: column ``j`` of the result is what input ``e_j`` contributes, whatever the
mode, coordinate transformation, rounding, cubic coefficient or antialiasing. With static
shapes the matrices are constants (folded); with dynamic ones they are built at run time.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.ir.shapes import rank_of

_FLOAT = int(ir.DataType.FLOAT)
# the largest identity written into the graph as a constant: the folder's input limit (onnxscript's
# default, 8192 elements); a larger one is built at run time rather than stored in the model
_FOLDED_IDENTITY_SIZE = 8192


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _same_dim(a, b) -> bool:
    """Whether two dims of a static or symbolic shape are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value is not None \
        and a.value == b.value


def _resized_axes(ctx: GradContext, axes: list[int], scales, sizes, crop: bool) -> list[int]:
    """The axes along which the node changes anything: every listed axis, less those whose scale
    is provably 1 (or whose size provably stays): Resize by 1 without a crop is the identity in
    every mode (a sample at an input position takes that position's value)."""
    if crop:
        return axes
    x_shape, y_shape = ctx.x.shape, ctx.y.shape
    kept = set()
    for k, axis in enumerate(axes):
        if scales is not None and scales.size:
            if float(scales[k]) == 1.0:
                kept.add(axis)
        elif sizes is not None and x_shape is not None and isinstance(x_shape[axis], int):
            if int(sizes[k]) == x_shape[axis]:
                kept.add(axis)
        elif x_shape is not None and y_shape is not None and _same_dim(x_shape[axis], y_shape[axis]):
            kept.add(axis)
    return [a for a in axes if a not in kept]


def _axis_matrix(ctx: GradContext, axis: int, k: int, count: int, uses_scales: bool) -> ir.Value:
    """``A`` of shape ``[m, n]`` (float32): Resize along ``axis`` (the ``k``-th of ``count`` resized
    axes) as a matrix, from an ``n x n`` identity resized along its first axis."""
    op, b, node = ctx.op, ctx.b, ctx.node
    length = ctx.x.shape[axis] if ctx.x.shape is not None else None
    if isinstance(length, int) and length * length <= _FOLDED_IDENTITY_SIZE:
        # a constant: with a constant scale or size, the matrix folds
        n = b.ints([length])
        identity = b.const(np.eye(length, dtype=np.float32))
    else:
        n = op.Gather(op.Shape(ctx.x), b.ints([axis]), axis=0)
        identity = op.EyeLike(op.ConstantOfShape(op.Concat(n, n, axis=0),
                                                 value=ir.tensor(np.zeros([1], np.float32))))
    attributes = {name: attr.value for name, attr in node.attributes.items()
                  if name not in ("axes", "keep_aspect_ratio_policy", "extrapolation_value")}
    roi = None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        # roi lists the starts of the resized axes, then their ends
        roi = op.Cast(op.Gather(node.inputs[1], b.ints([k, k + count]), axis=0), to=_FLOAT)
        roi = op.Concat(op.Slice(roi, b.ints([0]), b.ints([1])), b.const(np.array([0.0], np.float32)),
                        op.Slice(roi, b.ints([1]), b.ints([2])), b.const(np.array([1.0], np.float32)), axis=0)
    if uses_scales:
        scale = op.Gather(node.inputs[2], b.ints([k]), axis=0)
        return op.Resize(identity, roi, op.Concat(scale, b.const(np.array([1.0], np.float32)), axis=0),
                         **attributes)
    m = op.Gather(op.Shape(ctx.y), b.ints([axis]), axis=0)
    return op.Resize(identity, roi, None, op.Concat(m, n, axis=0), **attributes)


def _contract(ctx: GradContext, g: ir.Value, matrix: ir.Value, axis: int, rank: int) -> ir.Value:
    """``g`` with its ``axis`` (length m) multiplied by ``matrix`` ``[m, n]``: length n."""
    op = ctx.op
    if axis == rank - 1:
        return op.MatMul(g, matrix)
    if axis == rank - 2:
        return op.MatMul(op.Transpose(matrix, perm=[1, 0]), g)
    perm = list(range(rank))
    perm[axis], perm[rank - 1] = rank - 1, axis  # a swap: its own inverse
    return op.Transpose(op.MatMul(op.Transpose(g, perm=perm), matrix), perm=perm)


@grad("Resize", versions=(13, None))
def _resize(ctx):
    node = ctx.node
    rank = rank_of(ctx.x)
    if rank is None:
        raise NotImplementedError(f"the rank of {ctx.x.name!r} must be known")
    policy = _text(ctx.attr("keep_aspect_ratio_policy", "stretch"))
    scales = ctx.const_input(2)
    sizes = ctx.const_input(3)
    scale_input = node.inputs[2] if len(node.inputs) > 2 else None
    uses_scales = scale_input is not None and not (scales is not None and scales.size == 0)
    if not uses_scales and policy != "stretch":
        # the policy replaces each axis' scale by a common one and rounds the sizes: not per axis
        raise NotImplementedError(f"keep_aspect_ratio_policy={policy!r} (only 'stretch' is supported)")
    axes = [a % rank for a in ctx.attr("axes", list(range(rank)))]
    crop = _text(ctx.attr("coordinate_transformation_mode", "half_pixel")) == "tf_crop_and_resize"
    g = ctx.dy
    resized = _resized_axes(ctx, axes, scales if uses_scales else None, sizes, crop)
    for axis in reversed(resized):
        matrix = _axis_matrix(ctx, axis, axes.index(axis), len(axes), uses_scales)
        if g.dtype != ir.DataType.FLOAT:
            matrix = ctx.op.Cast(matrix, to=int(g.dtype))
        g = _contract(ctx, g, matrix, axis, rank)
    return (g,)
