"""Matrix products: MatMul, Gemm, Einsum."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import grad
from onnxtrain.ir.shapes import dims_equal, rank_of, sum_or_expand_to_shape, sum_to_shape


def _batched_shape(y: ir.Value, x: ir.Value) -> ir.Shape | None:
    """Shape of a gradient that has y's batch dims and x's last two dims."""
    if y.shape is None or x.shape is None or len(y.shape) < 2 or len(x.shape) < 2:
        return None
    return ir.Shape(list(y.shape)[:-2] + list(x.shape)[-2:])


def transpose_last2(op, x, rank: int):
    """``x`` with its last two axes swapped (``rank`` its rank)."""
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return op.Transpose(x, perm=perm)


@grad("MatMul")
def _matmul(ctx):
    a, bm = ctx.inputs
    op, b = ctx.op, ctx.b
    ra, rb = rank_of(a), rank_of(bm)
    dy = ctx.dy
    da = db = None
    if rb is None or (ra is None and rb != 2):
        # a matrix b (a layer's weight) needs only a's rank to be at least 1, whatever it is
        raise NotImplementedError(f"the ranks of {a.name!r} and {bm.name!r} must be known "
                                  "(or the second operand be a matrix)")
    if ra == 1 and rb == 1:  # a dot product: y = sum_k a[k] b[k], a scalar
        return (op.Mul(dy, bm) if ctx.needs(0) else None), (op.Mul(dy, a) if ctx.needs(1) else None)
    if ctx.needs(0):
        if rb == 1:  # y[..., i] = sum_k a[..., i, k] b[k]
            da = op.Mul(b.unsqueeze(dy, [-1]), bm)
        elif ra == 1:  # y[..., j] = sum_k a[k] b[..., k, j]
            da = op.MatMul(b.unsqueeze(dy, [-2]), transpose_last2(op, bm, rb))
            da = b.squeeze(da, [-2])
        else:
            da = op.MatMul(dy, transpose_last2(op, bm, rb))
        if rb != 2:  # a matrix b broadcasts nothing onto a
            da = sum_to_shape(b, da, a, _batched_shape(ctx.y, a) if ra and ra >= 2 and rb >= 2 else None)
    if ctx.needs(1):
        if ra == 1:
            db = op.Mul(b.unsqueeze(a, [-1]), b.unsqueeze(dy, [-2]))
        elif rb == 1 and ra is not None and ra > 2:
            # db[k] = sum over the batch dims and rows of dy[..., i] a[..., i, k]: one [1, M'] @ [M', K]
            # product (not a transposed matrix times a vector, which onnxruntime's fusion gets wrong)
            db = op.Reshape(op.MatMul(op.Reshape(dy, b.ints([1, -1])), op.Flatten(a, axis=ra - 1)), b.ints([-1]))
        elif rb == 1:
            db = op.MatMul(transpose_last2(op, a, ra), b.unsqueeze(dy, [-1]))
            db = b.squeeze(db, [-1])
            if ra != 2:  # a of unknown rank: its batch dims, if any, are summed away
                db = sum_to_shape(b, db, bm)
        elif rb == 2 and (ra is None or ra > 2):
            # a [..., M, K] @ b [K, N] (a Linear layer): fold the batch dims into M, one
            # [K, M'] @ [M', N] product rather than a batched product summed over the batch
            # (of whatever rank a is: Flatten at the last axis)
            last = -1 if ra is None else ra - 1
            db = op.MatMul(op.Transpose(op.Flatten(a, axis=last), perm=[1, 0]), op.Flatten(dy, axis=last))
        else:
            db = op.MatMul(transpose_last2(op, a, ra), dy)
            db = sum_to_shape(b, db, bm, _batched_shape(ctx.y, bm) if ra >= 2 and rb >= 2 else None)
    return da, db


@grad("Gemm", versions=(13, None))
def _gemm(ctx):
    # y = alpha * A' @ B' + beta * C with A' = A^T if transA (B' likewise)
    a, bm = ctx.inputs[:2]
    c = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    op, b, dy = ctx.op, ctx.b, ctx.dy
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    da = db = dc = None
    if ctx.needs(0):  # dA' = alpha dy B'^T; transposed back when transA
        da = op.Gemm(bm, dy, alpha=alpha, transA=tb, transB=1) if ta else op.Gemm(dy, bm, alpha=alpha, transB=1 - tb)
    if ctx.needs(1):  # dB' = alpha A'^T dy
        db = op.Gemm(dy, a, alpha=alpha, transA=1, transB=ta) if tb else op.Gemm(a, dy, alpha=alpha, transA=1 - ta)
    if c is not None and ctx.needs(2):
        dc = sum_to_shape(b, dy if beta == 1.0 else op.Mul(dy, b.like(dy, beta)), c)
    return (da, db, dc)[: len(ctx.inputs)]


_ELLIPSIS = "..."


def _einsum_terms(equation: str) -> tuple[list[list[str]], list[str]]:
    """Operand terms and output term as token lists ('...' is one token); implicit output made explicit."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")

    def tokens(term: str) -> list[str]:
        head, dots, tail = term.partition(_ELLIPSIS)
        return [*head, *([_ELLIPSIS] if dots else []), *tail]

    terms = [tokens(t) for t in lhs.split(",")]
    if arrow:
        out = tokens(rhs)
    else:  # labels seen exactly once, sorted, after the ellipsis (ONNX's implicit form)
        labels = [t for term in terms for t in term if t != _ELLIPSIS]
        out = ([_ELLIPSIS] if any(_ELLIPSIS in t for t in terms) else []) + sorted(
            t for t in set(labels) if labels.count(t) == 1)
    return terms, out


def _ellipsis_rank(ctx, terms) -> int:
    for v, term in zip(ctx.inputs, terms):
        if _ELLIPSIS in term and rank_of(v) is not None:
            return rank_of(v) - (len(term) - 1)
    raise NotImplementedError("Einsum gradient needs the rank of an operand with '...'")


@grad("Einsum", versions=(13, None))
def _einsum(ctx):
    # d operand_i = einsum(dy, other operands -> term_i); labels of term_i found in none of
    # those (summed out of operand i alone) are broadcast back with Unsqueeze + Expand.
    terms, out = _einsum_terms(ctx.attr("equation"))
    op, b = ctx.op, ctx.b
    grads = []
    for i, (x, full_term) in enumerate(zip(ctx.inputs, terms)):
        if not ctx.needs(i):
            grads.append(None)
            continue
        # a label repeated within the operand reads its diagonal: the gradient is computed for the
        # diagonal (each label once), then placed on it (zeros elsewhere)
        term = list(dict.fromkeys(full_term))
        if len(term) < len(full_term) and (_ELLIPSIS in full_term or x.dtype is None):
            raise NotImplementedError("Einsum gradient: a repeated label in an operand with '...' or of unknown type")
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(out).union(*others)
        kept = [t for t in term if t in available]
        # onnxruntime wants '...' in the output when an input has it: keep it in front, sum it after
        extra = [_ELLIPSIS] if _ELLIPSIS in available and _ELLIPSIS not in term else []
        equation = ",".join("".join(t) for t in [out, *others]) + "->" + "".join(extra + kept)
        g = op.Einsum(ctx.dy, *[v for j, v in enumerate(ctx.inputs) if j != i], equation=equation)
        if extra:
            g = b.reduce_sum(g, list(range(_ellipsis_rank(ctx, terms))), keepdims=False)
        diagonal = len(term) < len(full_term)
        # the operand's shape with each label once: its own, or its dims at each label's first axis
        shape = op.Gather(op.Shape(x), b.ints([full_term.index(t) for t in term]), axis=0) if diagonal \
            else op.Shape(x)
        if len(kept) < len(term):
            rank = len(term) if diagonal else rank_of(x)
            if rank is None:
                raise NotImplementedError("Einsum gradient needs the rank of an operand with summed-out labels")
            dims, pos = [], 0  # first axis of each token in x
            for t in term:
                dims.append(pos)
                pos += rank - (len(term) - 1) if t == _ELLIPSIS else 1
            missing = [a for t, d in zip(term, dims) if t not in available
                       for a in (range(d, d + rank - len(term) + 1) if t == _ELLIPSIS else [d])]
            g = op.Expand(b.unsqueeze(g, missing), shape)
        if diagonal:
            g = _on_diagonals(b, g, full_term, x)
        if _ELLIPSIS in term or _labels_may_broadcast(ctx.inputs, terms, i):
            # a dim of size 1 here and n elsewhere (or the reverse: Einsum broadcasts labels and
            # '...' as numpy) came out of the product at the other size: summed down to 1, or
            # expanded to n, as the operand's own dims
            g = sum_or_expand_to_shape(b, g, x)
        grads.append(g)
    return tuple(grads)


def _labels_may_broadcast(inputs, terms, i: int) -> bool:
    """Whether a label of operand ``i`` may have another size in another operand (Einsum
    broadcasts a size-1 label as numpy does): not where every operand's dims for it are the same
    number or the same symbolic dim."""
    def dims_of(value, term) -> dict[str, list] | None:
        if value is None or value.shape is None or _ELLIPSIS in term and len(value.shape) < len(term) - 1:
            return None
        shape = list(value.shape)
        if _ELLIPSIS in term:
            at = term.index(_ELLIPSIS)
            tail = len(term) - at - 1
            shape = [*shape[:at], None, *shape[len(shape) - tail:]]
        found: dict[str, list] = {}
        for token, dim in zip(term, shape):
            if token != _ELLIPSIS:
                found.setdefault(token, []).append(dim)
        return found

    own = dims_of(inputs[i], terms[i])
    if own is None:
        return True
    for j, (value, term) in enumerate(zip(inputs, terms)):
        if j == i or not set(own) & set(term):
            continue
        theirs = dims_of(value, term)
        if theirs is None:
            return True
        if any(dims_equal(own[label][0], dim) is not True for label in own if label in theirs for dim in theirs[label]):
            return True
    return False


def _on_diagonals(b, g, term: list[str], x):
    """``g`` (one axis per label of ``term``, in first-appearance order) as a tensor of ``x``'s
    shape that is ``g`` where every repeated label's axes agree and 0 elsewhere: each repeated
    axis inserted (size 1), then multiplied by an identity over it and its label's first axis."""
    op = b.op
    repeated = [position for position, t in enumerate(term) if term.index(t) != position]
    g = b.unsqueeze(g, repeated)
    zero = ir.tensor(np.zeros([1], dtype=x.dtype.numpy()))  # identities of x's type (opset 13: no CastLike)
    for position in repeated:
        first = term.index(term[position])
        size = op.Gather(op.Shape(x), b.ints([first]), axis=0)
        eye = op.EyeLike(op.ConstantOfShape(op.Concat(size, size, axis=0), value=zero))
        g = op.Mul(g, b.unsqueeze(eye, [a for a in range(len(term)) if a not in (first, position)]))
    return g
