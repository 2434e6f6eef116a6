"""Matrix products: MatMul, Gemm, Einsum."""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.autodiff.registry import grad
from onnxtrain.ir.shapes import rank_of, sum_to_shape


def _batched_shape(y: ir.Value, x: ir.Value) -> ir.Shape | None:
    """Shape of a gradient that has y's batch dims and x's last two dims."""
    if y.shape is None or x.shape is None or len(y.shape) < 2 or len(x.shape) < 2:
        return None
    return ir.Shape(list(y.shape)[:-2] + list(x.shape)[-2:])


def _transpose_last2(op, b, x, rank: int):
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return op.Transpose(x, perm=perm)


@grad("MatMul")
def _matmul(ctx):
    a, bm = ctx.inputs
    op, b = ctx.op, ctx.b
    ra, rb = rank_of(a), rank_of(bm)
    dy = ctx.dy
    da = db = None
    if ctx.needs(0):
        if rb == 1:  # y[..., i] = sum_k a[..., i, k] b[k]
            da = op.Mul(b.unsqueeze(dy, [-1]), bm)
        elif ra == 1:  # y[..., j] = sum_k a[k] b[..., k, j]
            da = op.MatMul(b.unsqueeze(dy, [-2]), _transpose_last2(op, b, bm, rb))
            da = b.squeeze(da, [-2])
        else:
            da = op.MatMul(dy, _transpose_last2(op, b, bm, rb))
        da = sum_to_shape(b, da, a, _batched_shape(ctx.y, a) if ra and rb and ra >= 2 and rb >= 2 else None)
    if ctx.needs(1):
        if ra == 1:
            db = op.Mul(b.unsqueeze(a, [-1]), b.unsqueeze(dy, [-2]))
        elif rb == 1:
            db = op.MatMul(_transpose_last2(op, b, a, ra), b.unsqueeze(dy, [-1]))
            db = b.squeeze(db, [-1])
        else:
            db = op.MatMul(_transpose_last2(op, b, a, ra), dy)
        db = sum_to_shape(b, db, bm, _batched_shape(ctx.y, bm) if ra and rb and ra >= 2 and rb >= 2 else None)
    return da, db
