"""Linear algebra: Det, and onnxruntime's ``com.microsoft.Inverse`` (torch.linalg.det, inv, solve).

With ``Y = A^-1``: ``d(A^-1) = -Y dA Y``, so the gradient of an inverse is ``-Y^T dY Y^T``; and
``d det(A) = det(A) tr(A^-1 dA)``, so that of a determinant is ``dy det(A) A^-T``. Both act on
the last two axes, batched over the others. The determinant's gradient inverts ``A`` with
``com.microsoft.Inverse``, a CPU kernel stock onnxruntime ships (standard ONNX has no inverse):
at a singular ``A`` it is not finite, where PyTorch's (through an SVD) is.
"""

from __future__ import annotations

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.autodiff.rules.matmul import transpose_last2
from onnxtrain.ir.shapes import rank_of
from onnxtrain.names import MS_DOMAIN


def _rank(ctx: GradContext) -> int:
    rank = rank_of(ctx.x)
    if rank is None or rank < 2:
        raise NotImplementedError(f"{ctx.node.op_type} gradient needs the rank of its [..., M, M] input")
    return rank


@grad("Inverse", domain=MS_DOMAIN)
def _inverse(ctx: GradContext):
    op, y, rank = ctx.op, ctx.y, _rank(ctx)
    y_t = transpose_last2(op, y, rank)
    return (op.Neg(op.MatMul(op.MatMul(y_t, ctx.dy), y_t)),)


@grad("Det", versions=(11, None))
def _det(ctx: GradContext):
    op, b, rank = ctx.op, ctx.b, _rank(ctx)
    b.graph.opset_imports.setdefault(MS_DOMAIN, 1)
    inverse_t = transpose_last2(op, op.Inverse(ctx.x, _domain=MS_DOMAIN), rank)
    scale = op.Unsqueeze(op.Mul(ctx.dy, ctx.y), b.ints([-1, -2]))
    return (op.Mul(scale, inverse_t),)
