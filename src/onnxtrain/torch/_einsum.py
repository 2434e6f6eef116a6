"""A two-operand ``einsum`` written as one batched MatMul, for the exporter.

onnxruntime's CPU ``Einsum`` kernel runs a contraction 1.2-2.7x slower than the same product as
``MatMul`` with the operands transposed first (``bcxd,bcyd->bcxy`` on [32, 8, 16, 64] x
[32, 8, 48, 64]: 2.8 against 1.05 ms; XLNet's ``ibnd,jbnd->bnij``), and its gradient, in
Einsums again, as much. So :func:`as_matmul` sorts an equation's letters into batch letters (in
both operands and the output), row letters (first operand and output), column letters (second
operand and output) and contracted ones (both operands, not the output); a letter of one
operand alone that the output lacks is summed away first. Each operand is transposed to
[batch, rows, contracted] and [batch, contracted, columns] (several letters of a group merged by
a Reshape), multiplied, and the product put in the output's order. MatMul broadcasts the batch
axes as einsum does. Equations it cannot write so (a letter twice in one operand: a diagonal;
a contracted letter of size 1 against a larger one, which einsum broadcasts) stay ``Einsum``.
"""

from __future__ import annotations

from onnxscript import opset18 as op


def as_matmul(terms: list[str], output: str, a, b):
    """``einsum(",".join(terms) + "->" + output, a, b)`` as a MatMul of transposed operands
    (module docstring), or None where it is not a plain contraction of operands of known rank."""
    first, second = terms
    if any(len(set(t)) != len(t) for t in (first, second, output)) or not _known_ranks((a, first), (b, second)):
        return None
    if not _sizes_agree((a, first), (b, second), [c for c in first if c in second and c not in output]):
        return None
    a, first = _summed_alone(a, first, second + output)
    b, second = _summed_alone(b, second, first + output)
    batch = [c for c in output if c in first and c in second]
    rows = [c for c in output if c in first and c not in second]
    columns = [c for c in output if c in second and c not in first]
    contracted = [c for c in first if c in second and c not in output]
    a_grouped, row_sizes, _ = _grouped(a, first, batch, rows, contracted)
    b_grouped, _, column_sizes = _grouped(b, second, batch, contracted, columns)
    product = op.MatMul(a_grouped, b_grouped)  # [batch..., R, C]
    if len(rows) != 1 or len(columns) != 1:
        batch_sizes = op.Shape(product, start=0, end=len(batch))
        product = op.Reshape(product, op.Concat(batch_sizes, row_sizes, column_sizes, axis=0))
    order = batch + rows + columns
    if order != list(output):
        product = op.Transpose(product, perm=[order.index(c) for c in output])
    return product


def _known_ranks(*operands) -> bool:
    return all(x.shape is not None and len(x.shape) == len(term) for x, term in operands)


def _summed_alone(x, term: str, elsewhere: str):
    """``x`` with the axes of letters found nowhere else (not in the other operand nor the
    output) summed away, and its term without them."""
    alone = [i for i, c in enumerate(term) if c not in elsewhere]
    if not alone:
        return x, term
    return (op.ReduceSum(x, op.Constant(value_ints=alone), keepdims=0),
            "".join(c for i, c in enumerate(term) if i not in alone))


def _sizes_agree(first, second, letters) -> bool:
    """Whether the contracted ``letters`` have one size in both operands, or sizes
    known at run time only (which the model makes agree, as einsum requires); not where one is
    1 and the other may not be (einsum broadcasts it, MatMul would not)."""
    (a, term_a), (b, term_b) = first, second
    for c in letters:
        if c in term_a and c in term_b:
            size_a, size_b = a.shape[term_a.index(c)], b.shape[term_b.index(c)]
            if size_a == size_b:
                continue
            if (isinstance(size_a, int) and isinstance(size_b, int)) or 1 in (size_a, size_b):
                return False  # different, or perhaps a size 1 broadcast
    return True


def _grouped(x, term: str, batch: list[str], left: list[str], right: list[str]):
    """``x`` as [batch..., prod(left), prod(right)] (transposed so, the groups merged where they
    hold other than one letter), with the sizes of ``left``'s and ``right``'s axes (1-D)."""
    order = [term.index(c) for c in batch + left + right]
    if order != list(range(len(term))):
        x = op.Transpose(x, perm=order)
    nb, nl = len(batch), len(left)
    left_sizes = op.Shape(x, start=nb, end=nb + nl)
    right_sizes = op.Shape(x, start=nb + nl, end=nb + nl + len(right))
    if len(left) == 1 and len(right) == 1:
        return x, left_sizes, right_sizes
    merged = op.Concat(op.Shape(x, start=0, end=nb), _product(left_sizes, len(left)),
                       _product(right_sizes, len(right)), axis=0)
    return op.Reshape(x, merged), left_sizes, right_sizes


def _product(sizes, count: int):
    """The product of ``count`` sizes as a [1] tensor (1 for none)."""
    if count == 0:
        return op.Constant(value_ints=[1])
    return sizes if count == 1 else op.ReduceProd(sizes, keepdims=1)
