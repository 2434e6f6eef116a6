"""The gradient of a lookup of rows: zeros of the table's shape with each looked-up row's
gradient added at its row, exact and without a reducing scatter.

onnxruntime's reducing ScatterND loses repeated rows when its session has several threads
(:mod:`onnxtrain.ir.scatter`), and its ScatterElements, exact, walks every element in one
thread. So an embedding's gradient (a Gather along axis 0; a GatherND's, its index tuples
flattened) is a :class:`Rows`: the builder hands all of one table's lookups to
:meth:`Rows.join`, whose :func:`row_sums` sorts their rows by index and writes each row's sum
once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.partial import Partial
from onnxtrain.ir.builder import GraphBuilder

_INT64_MAX = int(np.iinfo(np.int64).max)


def row_sums(b: GraphBuilder, dy_rows: ir.Value, index: ir.Value, table_shape: ir.Value,
              known: np.ndarray | None = None, table_rows: int | None = None, row_rank: int | None = None) -> ir.Value:
    """Zeros of ``table_shape`` with ``dy_rows[k]`` added at row ``index[k]``: the gradient of an
    embedding lookup, exact and without a reducing scatter (onnxruntime's reducing ScatterND
    loses repeated rows when its session has several threads, :mod:`onnxtrain.ir.scatter`; its
    ScatterElements is exact but walks every element, ~3x slower here). The rows are sorted by
    index, summed as differences of float64 prefix sums at the end of each run of equal indices
    (:func:`_prefix_sums_at`), and each sum written once (a ScatterND without reduction, to
    distinct rows). ``known``: the indices (in range, flat) where they are a constant, sorted
    here, not in every run: those that never repeat are written as they are; those that repeat
    a few times (the overlapping windows of an ``as_strided``) are summed from a table of each
    row's sources (:func:`_sums_by_table`; ``row_rank``: the rank of ``dy_rows`` where known);
    and where they name each of the table's ``table_rows`` rows (its static row count), the
    sums are the gradient, with no scatter."""
    op = b.op
    if known is None:
        index = op.Reshape(index, b.ints([-1]))
        ordered, order = op.TopK(index, op.Reshape(op.Size(index), b.ints([1])), largest=0, sorted=1, _outputs=2)
        following = op.Concat(op.Slice(ordered, b.ints([1]), b.ints([_INT64_MAX])), b.ints([-1]), axis=0)
        ends = op.Reshape(op.NonZero(op.Not(op.Equal(ordered, following))), b.ints([-1]))  # last row of each run
        targets = b.unsqueeze(op.Gather(ordered, ends, axis=0), [-1])
        return op.ScatterND(zeros_of(b, table_shape, dy_rows), targets, _prefix_sums_at(b, dy_rows, order, ends))
    order = np.argsort(known, kind="stable")
    ordered = known[order]
    last_of_run = np.flatnonzero(np.append(ordered[1:] != ordered[:-1], True))
    counts = np.diff(last_of_run, prepend=-1)
    targets = ordered[last_of_run]
    every_row = table_rows is not None and targets.size == table_rows  # targets are 0 .. table_rows - 1
    if counts.max() == 1 and not every_row:
        sums, targets = dy_rows, known
    elif counts.max() == 1:
        sums = dy_rows if np.array_equal(order, np.arange(order.size)) else op.Gather(dy_rows, b.const(order), axis=0)
    elif counts.max() * targets.size <= 2 * known.size:
        sums = _sums_by_table(b, dy_rows, order, last_of_run, counts, row_rank == 1)
    else:
        sums = _prefix_sums_at(b, dy_rows, b.const(order), b.const(last_of_run))
    if every_row:
        return op.Reshape(sums, table_shape)
    return op.ScatterND(zeros_of(b, table_shape, dy_rows), b.const(targets.reshape(-1, 1)), sums)


def zeros_of(b: GraphBuilder, shape: ir.Value, like: ir.Value) -> ir.Value:
    return b.op.ConstantOfShape(shape, value=ir.tensor(np.zeros([1], dtype=like.dtype.numpy())))


def _zero_row(b: GraphBuilder, rows: ir.Value) -> ir.Value:
    """One row of zeros like those of ``rows`` (shape [1, *rows.shape[1:]], same type)."""
    op = b.op
    return zeros_of(b, op.Concat(b.ints([1]), op.Slice(op.Shape(rows), b.ints([1]), b.ints([_INT64_MAX])), axis=0),
                    rows)


def _prefix_sums_at(b: GraphBuilder, dy_rows: ir.Value, order: ir.Value, ends: ir.Value) -> ir.Value:
    """The sums of ``dy_rows`` over each run of rows in ``order`` that ends at a position of
    ``ends``: differences of float64 prefix sums (a float64 copy of the rows and their sums)."""
    op = b.op
    prefix = op.CumSum(op.Cast(op.Gather(dy_rows, order, axis=0), to=int(ir.DataType.DOUBLE)), b.scalar_int(0))
    at_ends = op.Gather(prefix, ends, axis=0)
    before = op.Concat(_zero_row(b, at_ends), op.Slice(at_ends, b.ints([0]), b.ints([-1])), axis=0)
    return op.Cast(op.Sub(at_ends, before), to=int(dy_rows.dtype))


def _sums_by_table(b: GraphBuilder, dy_rows: ir.Value, order: np.ndarray, last_of_run: np.ndarray,
                   counts: np.ndarray, scalar_rows: bool = False) -> ir.Value:
    """The sums of each run of constant indices' rows (:func:`row_sums`) where each repeats at
    most R times and the table of every run's rows, padded to R with a zero row, is at most
    twice their number: a Gather of that table and a ReduceSum over its R columns, in dy's
    type, in a fixed order; no prefix sums, no float64 copy. ``order``, ``last_of_run`` and
    ``counts``: the indices' stable sort, the last position of each run of equal ones in it,
    and the runs' lengths. Rows that are single elements (``scalar_rows``: dy_rows is 1-D) are
    gathered with GatherElements (passes/flat_gather.py)."""
    op = b.op
    table = np.full([last_of_run.size, counts.max()], order.size, dtype=np.int64)  # order.size: the zero row
    for r in range(counts.max()):
        longer = counts > r
        table[longer, r] = order[last_of_run[longer] - counts[longer] + 1 + r]
    padded = op.Concat(dy_rows, _zero_row(b, dy_rows), axis=0)
    if scalar_rows:
        sources = op.Reshape(op.GatherElements(padded, b.const(table.reshape(-1)), axis=0), b.ints(list(table.shape)))
    else:
        sources = op.Gather(padded, b.const(table), axis=0)
    return op.ReduceSum(sources, b.ints([1]), keepdims=0)


@dataclass(frozen=True)
class Rows(Partial):
    """A gather's gradient: zeros of its input's runtime ``shape`` with ``rows[k]`` added at row
    ``index[k]`` (flat, in range) of the input viewed as a table of rows, its first ``leading``
    dims flattened (1: an embedding lookup, a Gather along axis 0; more: a GatherND's index
    tuples). Every part of one input is summed by one :func:`row_sums` over all their rows (a
    Qwen2-MoE layer's experts each gather their tokens' rows of one hidden state), not each
    written into zeros of the input's size and added. ``known``: the indices where they are
    constants; ``table_rows``: the table's number of rows where it is static; ``row_rank``:
    the rank of ``rows`` where it is known."""

    rows: ir.Value
    index: ir.Value
    leading: int
    shape: ir.Value
    known: np.ndarray | None = None
    table_rows: int | None = None
    row_rank: int | None = None

    @classmethod
    def join(cls, b: GraphBuilder, parts: list[Rows], primal: ir.Value | None = None) -> list[ir.Value]:
        op = b.op
        joined = []
        for leading in sorted({part.leading for part in parts}):
            group = [part for part in parts if part.leading == leading]
            rows, index, shape = group[0].rows, group[0].index, group[0].shape
            if len(group) > 1:
                rows = op.Concat(*[part.rows for part in group], axis=0)
                index = op.Concat(*[part.index for part in group], axis=0)
            known = (np.concatenate([part.known for part in group])
                     if all(part.known is not None for part in group) else None)
            if leading == 1:
                joined.append(row_sums(b, rows, index, shape, known, group[0].table_rows, group[0].row_rank))
                continue
            table = op.Concat(op.ReduceProd(op.Slice(shape, b.ints([0]), b.ints([leading])), keepdims=1),
                              op.Slice(shape, b.ints([leading]), b.ints([_INT64_MAX])), axis=0)
            joined.append(op.Reshape(row_sums(b, rows, index, table, known, group[0].table_rows, group[0].row_rank),
                                     shape))
        return joined
