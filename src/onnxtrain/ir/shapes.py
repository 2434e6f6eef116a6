"""Shape helpers that work for static and symbolic dims alike.

``sum_to_shape`` is the one place that un-broadcasts a gradient. It takes the
static path when shape inference proved which axes were broadcast and otherwise
emits a small dynamic subgraph (Shape/Equal/NonZero/ReduceSum) that handles any
runtime shape, so rules never branch on whether a shape is static.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.builder import GraphBuilder


def rank_of(x: ir.Value) -> int | None:
    return None if x.shape is None else len(x.shape)


def dims_equal(a, b) -> bool | None:
    """True/False when provably equal/different, None when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim):
        if a.value is not None and a.value == b.value:
            return True
    return None


def shapes_equal(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    """Whether two shapes are provably the same: both known, of one rank, every dim equal (the
    same number, or the same named symbol)."""
    return a is not None and b is not None and len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def broadcast_axes(target: ir.Shape | None, source: ir.Shape | None) -> tuple[list[int], list[int]] | None:
    """Static un-broadcast plan: (leading axes to drop, kept axes to sum with keepdims).

    ``source`` is the shape of the broadcast result, ``target`` the shape of the operand.
    Returns None when the shapes do not prove the plan.
    """
    if target is None or source is None or len(source) < len(target):
        return None
    lead = len(source) - len(target)
    kept: list[int] = []
    for i, tdim in enumerate(target):
        sdim = source[lead + i]
        if isinstance(tdim, int) and tdim == 1:
            if isinstance(sdim, int) and sdim == 1:
                continue
            if isinstance(sdim, int):
                kept.append(lead + i)
                continue
            return None  # a symbolic dim against 1: broadcast or not, only runtime knows
        if isinstance(tdim, int):
            continue  # an operand dim != 1 equals the result dim in any valid broadcast
        if dims_equal(tdim, sdim) or (isinstance(sdim, int) and sdim == 1):
            continue
        return None  # a symbolic operand dim may be 1 at runtime: only runtime knows
    return list(range(lead)), kept


def sum_to_shape(b: GraphBuilder, dx: ir.Value, x: ir.Value, dx_shape: ir.Shape | None = None) -> ir.Value:
    """Sum ``dx`` (shaped like a broadcast result) down to the shape of ``x``."""
    source = dx_shape if dx_shape is not None else dx.shape
    plan = broadcast_axes(x.shape, source)
    if plan is not None:
        lead, kept = plan
        out = dx
        if kept:
            out = b.reduce_sum(out, kept, keepdims=True)
        if lead:
            out = b.reduce_sum(out, lead, keepdims=False)
        return out
    return _sum_to_shape_dynamic(b, dx, x)


def sum_or_expand_to_shape(b: GraphBuilder, dx: ir.Value, x: ir.Value) -> ir.Value:
    """``dx`` (of ``x``'s rank or more) as ``x``'s shape, at run time: summed over its leading
    axes and where ``x`` has size 1 and ``dx`` more, expanded where ``dx`` has size 1 and ``x``
    more (an operand broadcast against another in both directions, as Einsum's labels)."""
    return _sum_to_shape_dynamic(b, dx, x, expand=True)


def _sum_to_shape_dynamic(b: GraphBuilder, dx: ir.Value, x: ir.Value, expand: bool = False) -> ir.Value:
    op = b.op
    x_shape = op.Shape(x)
    dx_shape = op.Shape(dx)
    rank_gap = op.Sub(op.Size(dx_shape), op.Size(x_shape))
    ones = op.ConstantOfShape(op.Reshape(rank_gap, b.ints([1])), value=ir.tensor(np.ones([1], dtype=np.int64)))
    x_shape_padded = op.Concat(ones, x_shape, axis=0)
    one = b.const(np.array(1, dtype=np.int64))
    broadcast = op.And(op.Equal(x_shape_padded, one), op.Not(op.Equal(dx_shape, one)))
    axes = op.Reshape(op.NonZero(broadcast), b.ints([-1]))
    summed = op.ReduceSum(dx, axes, keepdims=1, noop_with_empty_axes=1)
    if expand:
        summed = op.Expand(summed, x_shape_padded)
    return op.Reshape(summed, x_shape)


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis
