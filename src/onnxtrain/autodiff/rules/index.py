"""Indexing: Slice, Gather, GatherElements, TopK, GatherND, ScatterND, ScatterElements, Compress,
OneHot, MaxUnpool, TensorScatter.

The gradient of a gather is a scatter of ``dy`` into zeros that *adds* where an index repeats.
onnxruntime's reducing ScatterND is not exact with several threads (:mod:`onnxtrain.ir.scatter`),
so an embedding's rows (a Gather along axis 0) are summed by sorting (autodiff/rows.py), and
other gathers add with ScatterElements ``reduction="add"`` (opset 16+); for opsets 13-15 those
sum with a one-hot matrix instead (Equal against a Range, then MatMul or ReduceSum), which is
exact but costs memory proportional to (number of indices) x (size of the gathered axis). Rules
start at opset 13, onnxtrain's minimum (``ir.io.MIN_OPSET``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain import names
from onnxtrain.autodiff.partial import Region
from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.autodiff.rows import Rows, zeros_of
from onnxtrain.errors import ModelError
from onnxtrain.ir.scatter import scatter_nd_by_elements
from onnxtrain.ir.shapes import normalize_axis, rank_of

_INT64 = int(ir.DataType.INT64)
_INT64_MAX = int(np.iinfo(np.int64).max)
SCATTER_ADD_OPSET = 16  # first opset with ScatterND/ScatterElements reduction="add"


def _wrap_negative(ctx: GradContext, index: ir.Value, size: ir.Value) -> ir.Value:
    """Indices in [-size, size) mapped to [0, size); as they are where none can be negative
    (:func:`never_negative`: DeBERTa's relative positions, clamped at 0, skip two passes over
    their ``[batch * heads, T, T]`` indices)."""
    op = ctx.op
    if index.dtype != ir.DataType.INT64:
        index = op.Cast(index, to=_INT64)
    if never_negative(index):
        return index
    return op.Where(op.Less(index, ctx.b.scalar_int(0)), op.Add(index, size), index)


# ops whose output takes its values from one input's: moved, copied or picked (the first
# input's), or from all inputs' (Concat, Where's two branches)
_VALUES_OF_FIRST = frozenset({"Identity", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Transpose", "Flatten",
                              "Slice", "Gather", "GatherElements", "GatherND", "Tile"})
_ALWAYS_NON_NEGATIVE = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "Abs", "Relu"})


def never_negative(value: ir.Value, depth: int = 8) -> bool:
    """Whether integer ``value`` is provably >= 0 everywhere, from what computes it (up to
    ``depth`` nodes back): a constant with no negative entry, an unsigned type, a size or an
    index (Shape, NonZero, ArgMax, TopK's indices), a Clip or Max with a bound >= 0, values
    moved or picked from such (Reshape, Expand, Gather, ...), sums and products of such."""
    if value.dtype in (ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64,
                       ir.DataType.BOOL):
        return True
    constant = ir.convenience.get_const_tensor(value)
    if constant is not None:
        return constant.size <= _LARGEST_EVALUATED_INDICES and bool((constant.numpy() >= 0).all())
    node = value.producer()
    if depth == 0 or node is None or node.domain not in ("", "ai.onnx"):
        return False
    inputs, kind = node.inputs, node.op_type
    if kind in _ALWAYS_NON_NEGATIVE or (kind == "TopK" and value is node.outputs[1]):
        return True
    if kind in _VALUES_OF_FIRST or kind == "Cast":
        return inputs[0] is not None and never_negative(inputs[0], depth - 1)
    if kind == "Clip":  # a lower bound >= 0, or an input that is
        return any(v is not None and never_negative(v, depth - 1) for v in inputs[:2])
    if kind == "Max":
        return any(v is not None and never_negative(v, depth - 1) for v in inputs)
    if kind in ("Concat", "Min", "Add", "Mul"):
        return all(v is not None and never_negative(v, depth - 1) for v in inputs)
    if kind == "Where":
        return all(v is not None and never_negative(v, depth - 1) for v in inputs[1:])
    return False


def _prod(ctx: GradContext, dims: ir.Value) -> ir.Value:
    """Product of a 1-D int64 tensor as a [1] tensor (1 for an empty one)."""
    return ctx.op.ReduceProd(dims, keepdims=1)


# integer arithmetic an exporter leaves on constant indices (the windows of torchlib's
# as_strided: Add of a [.., 1] and a [1, .., K] constant, too large for the folder to write out)
_INDEX_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}
_LARGEST_EVALUATED_INDICES = 1 << 24


def _index_value(indices: ir.Value, depth: int = 4) -> np.ndarray | None:
    """The value of integer ``indices`` where it is a constant, or Add/Sub/Mul of such (up to
    ``depth`` ops deep), evaluated here; else None."""
    constant = ir.convenience.get_const_tensor(indices)
    if constant is not None:
        return constant.numpy()
    node = indices.producer()
    if (depth == 0 or node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _INDEX_ARITHMETIC
            or len(node.inputs) != 2 or indices.dtype not in (ir.DataType.INT64, ir.DataType.INT32)):
        return None
    left, right = (_index_value(i, depth - 1) if i is not None else None for i in node.inputs)
    if left is None or right is None or np.prod(np.broadcast_shapes(left.shape, right.shape)) > _LARGEST_EVALUATED_INDICES:
        return None
    return _INDEX_ARITHMETIC[node.op_type](left, right).astype(left.dtype)


def _constant_indices(indices: ir.Value, size: object) -> np.ndarray | None:
    """The flat int64 values of constant ``indices`` (:func:`_index_value`; negative ones counted
    from the end where the gathered axis has a static ``size``), or None where they are not a
    constant or not all in range."""
    constant = _index_value(indices)
    if constant is None or constant.size == 0:
        return None
    values = constant.reshape(-1).astype(np.int64)
    if (values < 0).any():
        if not isinstance(size, int):
            return None
        values = np.where(values < 0, values + size, values)
    if (values < 0).any() or (isinstance(size, int) and (values >= size).any()):
        return None
    return values


def _contiguous_constant_run(indices: ir.Value, size: object) -> tuple[int, int] | None:
    """``(a, K)`` where ``indices`` is a constant holding a, a+1, ..., a+K-1 in order (negative
    ones counted from the end where the gathered axis has a static ``size``), else None."""
    values = _constant_indices(indices, size)
    if values is None or not np.array_equal(values, np.arange(values[0], values[0] + values.size)):
        return None
    return int(values[0]), int(values.size)


def _contiguous_gather_grad(ctx: GradContext, dy: ir.Value, first: int, count: int, axis: int, rank: int) -> Region:
    """Adjoint of ``Gather(x, indices, axis)`` (x of rank ``rank``) for constant indices
    ``first, ..., first + count - 1`` (``x[:, 0]``, torchlib's im2col over a kernel of width 1,
    an expert's ``W[e]``): each position is gathered once, so dy is a :class:`Region` of x's
    gradient, padded back with zeros or joined with the gradients of other positions (a
    scatter walked every element, single-threaded)."""
    op, b = ctx.op, ctx.b
    x_shape = op.Shape(ctx.x)
    spread = op.Reshape(dy, op.Concat(op.Slice(x_shape, b.ints([0]), b.ints([axis])), b.ints([count]),
                                      op.Slice(x_shape, b.ints([axis + 1]), b.ints([_INT64_MAX])), axis=0))
    return Region(spread, axis, first, count, rank, x_shape)


def gather_grad(ctx: GradContext, dy: ir.Value, x_shape: ir.Value, indices: ir.Value, axis: int,
                static_size: int | None = None, rank: int | None = None) -> ir.Value | Rows:
    """Adjoint of ``Gather(x, indices, axis)`` for x of runtime shape ``x_shape``.

    Along axis 0 (an embedding lookup): :class:`~onnxtrain.autodiff.rows.Rows` (which sorts
    constant indices when the graph is built; ``static_size``, the axis's size where it is
    static, reads negative ones; ``rank``: x's, where known).
    Otherwise x is viewed as [P, D, Q]
    and dy as [P, K, Q] (K = number of indices); repeated indices accumulate, with
    ``ScatterElements`` (onnxruntime's reducing ScatterND loses repeated updates when its session
    has several threads: :mod:`onnxtrain.ir.scatter`).
    """
    op, b = ctx.op, ctx.b
    axes = b.ints([axis])
    size = op.Gather(x_shape, axes, axis=0)  # D, as [1]
    index = _wrap_negative(ctx, indices, size)
    if axis == 0 and dy.dtype is not None:
        # rows of dy summed straight into a tensor of x's shape (no [P, D, Q] view, no Reshape
        # copy of the whole table at the end)
        rows = op.Concat(b.ints([-1]), op.Slice(x_shape, b.ints([1]), b.ints([_INT64_MAX])), axis=0)
        return Rows(op.Reshape(dy, rows), op.Reshape(index, b.ints([-1])), 1, x_shape,
                    _constant_indices(indices, static_size), static_size, rank)
    outer = _prod(ctx, op.Slice(x_shape, b.ints([0]), axes))  # P
    inner = _prod(ctx, op.Slice(op.Slice(x_shape, axes, b.ints([_INT64_MAX])), b.ints([1]), b.ints([_INT64_MAX])))
    index = op.Reshape(index, b.ints([-1]))  # [K]
    count = op.Reshape(op.Size(index), b.ints([1]))
    dy3 = op.Reshape(dy, op.Concat(outer, count, inner, axis=0))
    if ctx.opset >= SCATTER_ADD_OPSET:
        spread = op.Expand(op.Reshape(index, b.ints([1, -1, 1])), op.Shape(dy3))  # index[k] at [p, k, q]
        dx3 = op.ScatterElements(zeros_of(ctx.b, op.Concat(outer, size, inner, axis=0), dy), spread, dy3, axis=1,
                                 reduction="add")
    else:
        classes = op.Range(b.scalar_int(0), op.Reshape(size, b.ints([])), b.scalar_int(1))
        onehot = op.Cast(op.Equal(op.Reshape(index, b.ints([1, -1])), op.Reshape(classes, b.ints([-1, 1]))),
                         to=int(dy.dtype))  # [D, K]
        dx3 = op.MatMul(onehot, dy3)  # [D, K] @ [P, K, Q] -> [P, D, Q]
    return op.Reshape(dx3, x_shape)


# -- Slice ---------------------------------------------------------------------------


def _slice_grad_pad(ctx: GradContext) -> ir.Value:
    """Unit steps: dy padded back with zeros; the pads come from the clamped starts."""
    op, b = ctx.op, ctx.b
    zero = b.scalar_int(0)
    x_shape = op.Shape(ctx.x)
    rank = op.Size(x_shape)
    starts = op.Cast(ctx.inputs[1], to=_INT64)
    axes = ctx.inputs[3] if len(ctx.inputs) > 3 else None
    if axes is None:
        axes = op.Range(zero, op.Size(starts), b.scalar_int(1))
    axes = _wrap_negative(ctx, axes, rank)
    dims = op.Gather(x_shape, axes, axis=0)
    begin = op.Min(op.Max(_wrap_negative(ctx, starts, dims), zero), dims)  # Slice's clamping
    end = op.Sub(op.Sub(dims, begin), op.Gather(op.Shape(ctx.dy), axes, axis=0))
    # pads for every axis: zeros, with begin/end written at the sliced axes
    no_pads = op.ConstantOfShape(op.Reshape(op.Mul(rank, b.scalar_int(2)), b.ints([1])),
                                 value=ir.tensor(np.zeros([1], dtype=np.int64)))
    pads = op.ScatterElements(no_pads,
                              op.Concat(axes, op.Add(axes, rank), axis=0), op.Concat(begin, end, axis=0), axis=0)
    return op.Pad(ctx.dy, pads)


def _slice_grad_scatter(ctx: GradContext) -> ir.Value:
    """Any steps (negative, strided): slice a grid of flat positions with the node's own
    starts/ends/axes/steps, then scatter dy to those positions (they never repeat)."""
    op, b = ctx.op, ctx.b
    x_shape = op.Shape(ctx.x)
    count = op.Size(ctx.x)
    positions = op.Reshape(op.Range(b.scalar_int(0), count, b.scalar_int(1)), x_shape)
    picked = op.Reshape(op.Slice(positions, *ctx.inputs[1:]), b.ints([-1]))
    zeros = zeros_of(ctx.b, op.Reshape(count, b.ints([1])), ctx.dy)
    flat = op.ScatterElements(zeros, picked, op.Reshape(ctx.dy, b.ints([-1])), axis=0)
    return op.Reshape(flat, x_shape)


def _slice_region(ctx: GradContext) -> Region | None:
    """dy as a :class:`Region` of x's gradient where the Slice cuts one axis of static size with
    constant starts and ends at unit step, else None."""
    rank = rank_of(ctx.x)
    starts, ends = ctx.const_input(1), ctx.const_input(2)
    axes = ctx.const_input(3) if len(ctx.inputs) > 3 and ctx.inputs[3] is not None else np.array([0])
    if rank is None or ctx.x.shape is None or starts is None or ends is None or axes is None or axes.size != 1:
        return None
    axis = normalize_axis(int(axes.reshape(-1)[0]), rank)
    size = ctx.x.shape[axis]
    if not isinstance(size, int):
        return None

    def clamped(position: int) -> int:
        return min(max(position + size if position < 0 else position, 0), size)

    first, end = clamped(int(starts.reshape(-1)[0])), clamped(int(ends.reshape(-1)[0]))
    return Region(ctx.dy, axis, first, max(end - first, 0), rank, ctx.op.Shape(ctx.x))


@grad("Slice", versions=(13, None))
def _slice(ctx):
    steps = ctx.inputs[4] if len(ctx.inputs) > 4 else None
    unit = steps is None or (ctx.const_input(4) is not None and bool(np.all(ctx.const_input(4) == 1)))
    if not unit:
        return (_slice_grad_scatter(ctx),)
    return (_slice_region(ctx) or _slice_grad_pad(ctx),)


# -- gathers ---------------------------------------------------------------------------


@grad("Gather", versions=(13, None))
def _gather(ctx):
    dy, indices, axis = ctx.dy, ctx.inputs[1], ctx.attr("axis", 0)
    padding = ctx.node.metadata_props.get(names.PADDING_IDX_METADATA)
    if padding is not None:  # an embedding lookup whose padding row gets no gradient
        op, b = ctx.op, ctx.b
        rank = rank_of(ctx.x)
        if rank is None or indices.dtype is None:
            raise NotImplementedError("padding index metadata on a Gather of unknown rank or index type")
        trailing = rank - 1 - normalize_axis(axis, rank)
        is_padding = op.Equal(indices, b.const(np.array(int(padding), dtype=indices.dtype.numpy())))
        if trailing:
            is_padding = b.unsqueeze(is_padding, list(range(-trailing, 0)))
        dy = op.Where(is_padding, b.like(dy, 0.0), dy)
    rank = rank_of(ctx.x)
    size = None
    if rank is not None:
        axis = normalize_axis(axis, rank)
        size = ctx.x.shape[axis] if ctx.x.shape is not None else None
        run = _contiguous_constant_run(indices, size)
        if run is not None:
            return (_contiguous_gather_grad(ctx, dy, *run, axis, rank),)
    return (gather_grad(ctx, dy, ctx.op.Shape(ctx.x), indices, axis, size if isinstance(size, int) else None, rank),)


@grad("Compress", versions=(13, None))
def _compress(ctx):
    # Compress is a Gather of the positions where condition is true (x flattened without axis)
    op, b = ctx.op, ctx.b
    kept = op.Reshape(op.NonZero(ctx.inputs[1]), b.ints([-1]))
    axis = ctx.attr("axis")
    x_shape = op.Shape(ctx.x)
    if axis is None:
        flat_shape = op.Reshape(op.Size(ctx.x), b.ints([1]))
        flat = gather_grad(ctx, ctx.dy, flat_shape, kept, 0)
        return (op.Reshape(Rows.join(b, [flat])[0] if isinstance(flat, Rows) else flat, x_shape),)
    return (gather_grad(ctx, ctx.dy, x_shape, kept, axis),)


@grad("GatherElements", versions=(13, None))
def _gather_elements(ctx):
    op, b = ctx.op, ctx.b
    x, indices = ctx.inputs
    axis = ctx.attr("axis", 0)
    x_shape = op.Shape(x)
    index = _wrap_negative(ctx, indices, op.Gather(x_shape, b.ints([axis]), axis=0))
    if ctx.opset >= SCATTER_ADD_OPSET:
        return (op.ScatterElements(b.zeros_like(x), index, ctx.dy, axis=axis, reduction="add"),)
    # one-hot over the gathered axis: [*indices.shape, D], summed over that axis
    rank = rank_of(indices)
    if rank is None:
        raise ModelError(f"GatherElements gradient at opset {ctx.opset} needs the rank of {indices.name!r}")
    axis %= rank
    classes = op.Range(b.scalar_int(0), op.Reshape(op.Gather(x_shape, b.ints([axis]), axis=0), b.ints([])),
                       b.scalar_int(1))
    hits = op.Equal(b.unsqueeze(index, [-1]), classes)
    spread = op.Where(hits, b.unsqueeze(ctx.dy, [-1]), ctx.like(ctx.dy, 0.0))
    summed = b.reduce_sum(spread, [axis], keepdims=True)  # size 1 at axis, D last
    perm = list(range(rank + 1))
    perm[axis], perm[rank] = rank, axis  # swap the size-1 axis and the D axis
    dx = b.squeeze(op.Transpose(summed, perm=perm), [rank])
    # indices may be smaller than x in the other axes: zero-fill the rest
    missing = op.Sub(x_shape, op.Shape(dx))
    return (op.Pad(dx, op.Concat(op.Mul(missing, b.scalar_int(0)), missing, axis=0)),)


@grad("TopK", versions=(13, None))
def _top_k(ctx):
    # values = GatherElements(x, indices, axis): dy goes back to the positions picked. They are
    # distinct, so a plain scatter into zeros (no reduction) is exact. Ties pick one of the equal
    # elements, as the forward did (torch.topk's gradient does the same).
    indices = ctx.forward_output(1, ir.DataType.INT64, "indices")
    return (ctx.op.ScatterElements(ctx.b.zeros_like(ctx.x), indices, ctx.dy, axis=ctx.attr("axis", -1)), None)


@grad("GatherND", versions=(13, None))
def _gather_nd(ctx):
    # GatherND == Gather(x viewed as [B*F, *tail], flat index) with B the batch dims and
    # F the indexed dims; the flat index is b * F + (Horner over the index tuple).
    op, b = ctx.op, ctx.b
    x, indices = ctx.inputs
    batch_dims = ctx.attr("batch_dims", 0)
    depth = indices.shape[-1] if indices.shape is not None and len(indices.shape) else None
    if not isinstance(depth, int) or depth < 1:
        raise ModelError(f"GatherND gradient needs a static last dim >= 1 of indices {indices.name!r}")
    x_shape = op.Shape(x)
    flat = None
    for j in range(depth):
        dim = op.Gather(x_shape, b.scalar_int(batch_dims + j), axis=0)
        coord = _wrap_negative(ctx, op.Gather(indices, b.scalar_int(j), axis=-1), dim)
        flat = coord if flat is None else op.Add(op.Mul(flat, dim), coord)
    rows = _prod(ctx, op.Slice(x_shape, b.ints([batch_dims]), b.ints([batch_dims + depth])))
    if batch_dims:
        batches = _prod(ctx, op.Slice(x_shape, b.ints([0]), b.ints([batch_dims])))
        ones = b.ints([1] * (len(indices.shape) - 1 - batch_dims))
        batch_id = op.Reshape(op.Range(b.scalar_int(0), op.Reshape(batches, b.ints([])), b.scalar_int(1)),
                              op.Concat(op.Slice(op.Shape(indices), b.ints([0]), b.ints([batch_dims])), ones, axis=0))
        flat = op.Add(op.Mul(batch_id, rows), flat)
        rows = op.Mul(batches, rows)
    leading = batch_dims + depth
    if ctx.dy.dtype is None:
        view = op.Concat(rows, op.Slice(x_shape, b.ints([leading]), b.ints([_INT64_MAX])), axis=0)
        return (op.Reshape(gather_grad(ctx, ctx.dy, view, flat, 0), x_shape),)
    per_row = op.Concat(b.ints([-1]), op.Slice(x_shape, b.ints([leading]), b.ints([_INT64_MAX])), axis=0)
    rank = rank_of(x)
    return (Rows(op.Reshape(ctx.dy, per_row), op.Reshape(flat, b.ints([-1])), leading, x_shape,
                 row_rank=None if rank is None else rank - leading + 1),)


# -- scatters --------------------------------------------------------------------------


def _scatter_reduction(ctx: GradContext) -> str:
    reduction = ctx.attr("reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise NotImplementedError(f"reduction={reduction!r} (none, add, mul, max and min are supported)")
    return reduction


def _product_grads(ctx: GradContext, gather, scatter):
    """Gradients of a scatter with reduction mul, as PyTorch's ``scatter_reduce(reduce="prod")``
    gives them: each factor's is ``dy`` times the product of the others at its position. That is
    ``dy * y / factor`` where the factor is not 0; a factor that is the only zero among its
    position's updates gets the product of the others, computed again with it replaced by 1 (as
    does a zero of the data, whose product of the others is the updates' own)."""
    op, b = ctx.op, ctx.b
    data, _, updates = ctx.inputs
    y, dy = ctx.y, ctx.dy
    one, zero = ctx.like(y, 1.0), ctx.like(y, 0.0)
    d_data = d_updates = None
    if ctx.needs(0):
        data_is_zero = op.Equal(data, zero)
        masked_data = op.Where(data_is_zero, one, data)
        d_data = op.Div(op.Mul(dy, scatter(masked_data, updates, "mul")), masked_data)
    if ctx.needs(2):
        update_is_zero = op.Equal(updates, zero)
        zeros_there = gather(scatter(b.zeros_like(data), op.Cast(update_is_zero, to=int(y.dtype)), "add"))
        single_zero = op.And(update_is_zero, op.Equal(zeros_there, one))
        others = gather(op.Mul(dy, scatter(data, op.Where(single_zero, one, updates), "mul")))
        d_updates = op.Where(single_zero, others,
                             op.Div(gather(op.Mul(dy, y)), op.Where(update_is_zero, one, updates)))
    return d_data, None, d_updates


def _extremum_grads(ctx: GradContext, gather, scatter_add):
    """Gradients of a scatter with reduction max/min, as PyTorch's ``scatter_reduce`` (amax,
    amin) gives them: every element equal to its position's result (the data's own and the
    updates scattered there) gets an equal share of that position's gradient."""
    op = ctx.op
    data, _, updates = ctx.inputs
    y = ctx.y
    data_wins = op.Cast(op.Equal(data, y), to=int(y.dtype))
    update_wins = op.Cast(op.Equal(updates, gather(y)), to=int(y.dtype))
    share = op.Div(ctx.dy, scatter_add(data_wins, update_wins))  # the count is >= 1 where it matters
    d_data = op.Mul(share, data_wins) if ctx.needs(0) else None
    d_updates = op.Mul(gather(share), update_wins) if ctx.needs(2) else None
    return d_data, None, d_updates


@grad("ScatterND", versions=(13, None))
def _scatter_nd(ctx):
    # none: written positions take updates, so data's gradient is dy with them zeroed;
    # add: data passes dy through. updates read dy at the positions they were written to.
    op = ctx.op
    _, indices, updates = ctx.inputs
    reduction = _scatter_reduction(ctx)
    if reduction in ("max", "min", "mul"):
        depth = indices.shape[-1] if indices.shape is not None and len(indices.shape) else None
        if not isinstance(depth, int):
            raise NotImplementedError(f"reduction={reduction!r} with indices of unknown last dim")

        def gather(t):
            return op.GatherND(t, indices)

        def scatter(base, u, how="add"):
            return scatter_nd_by_elements(ctx.b.add_node, base, indices, u, how, depth)

        return _product_grads(ctx, gather, scatter) if reduction == "mul" else _extremum_grads(ctx, gather, scatter)
    d_data = d_updates = None
    if ctx.needs(0):
        d_data = ctx.dy if reduction == "add" else op.ScatterND(ctx.dy, indices, ctx.b.zeros_like(updates))
    if ctx.needs(2):
        d_updates = op.GatherND(ctx.dy, indices)
    return d_data, None, d_updates


@grad("ScatterElements", versions=(13, None))
def _scatter_elements(ctx):
    op = ctx.op
    _, indices, updates = ctx.inputs
    axis = ctx.attr("axis", 0)
    reduction = _scatter_reduction(ctx)
    if reduction in ("max", "min", "mul"):
        def gather(t):
            return op.GatherElements(t, indices, axis=axis)

        def scatter(base, u, how="add"):
            return op.ScatterElements(base, indices, u, axis=axis, reduction=how)

        return _product_grads(ctx, gather, scatter) if reduction == "mul" else _extremum_grads(ctx, gather, scatter)
    d_data = d_updates = None
    if ctx.needs(0):
        d_data = (ctx.dy if reduction == "add"
                  else op.ScatterElements(ctx.dy, indices, ctx.b.zeros_like(updates), axis=axis))
    if ctx.needs(2):
        d_updates = op.GatherElements(ctx.dy, indices, axis=axis)
    return d_data, None, d_updates


# -- writes of values at indices -----------------------------------------------------------


@grad("OneHot", versions=(11, None))
def _one_hot(ctx):
    # values = [off, on]: "on" fills the hot positions, "off" all the others
    op, b = ctx.op, ctx.b
    indices, depth, _ = ctx.inputs
    hot = op.OneHot(indices, depth, b.const([0, 1], dtype=ctx.dy.dtype), axis=ctx.attr("axis", -1))
    d_on = b.reduce_sum(op.Mul(ctx.dy, hot), None, keepdims=False)
    d_off = op.Sub(b.reduce_sum(ctx.dy, None, keepdims=False), d_on)
    return None, None, op.Concat(b.unsqueeze(d_off, [0]), b.unsqueeze(d_on, [0]), axis=0)


@grad("MaxUnpool", versions=(11, None))
def _max_unpool(ctx):
    # Y is zeros with X written at flat positions I (over the whole tensor, as MaxPool's
    # Indices): X reads dY back at them
    op, b = ctx.op, ctx.b
    flat_dy = op.Reshape(ctx.dy, b.ints([-1]))
    return (op.Gather(flat_dy, ctx.inputs[1], axis=0),) + (None,) * (len(ctx.inputs) - 1)


@grad("TensorScatter", versions=(24, None))
def _tensor_scatter(ctx):
    # present = past with update's rows written along ``axis`` from each batch's write index
    # (modulo the cache length when circular); the written positions never repeat
    op, b = ctx.op, ctx.b
    past, update = ctx.inputs[0], ctx.inputs[1]
    write_indices = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    rank = rank_of(past)
    if rank is None:
        raise ModelError(f"TensorScatter gradient needs the rank of {past.name!r}")
    axis = normalize_axis(ctx.attr("axis", -2), rank)
    axis_index = b.ints([axis])
    along_axis = [1] * rank
    along_axis[axis] = -1
    written = op.Reshape(op.Range(b.scalar_int(0), op.Reshape(op.Gather(op.Shape(update), axis_index, axis=0),
                                                                b.ints([])), b.scalar_int(1)), b.ints(along_axis))
    if write_indices is not None:
        written = op.Add(op.Reshape(op.Cast(write_indices, to=_INT64), b.ints([-1] + [1] * (rank - 1))), written)
    mode = ctx.attr("mode", "linear")
    if (mode.decode() if isinstance(mode, bytes) else mode) == "circular":
        written = op.Mod(written, op.Gather(op.Shape(past), axis_index, axis=0))
    written = op.Expand(written, op.Shape(update))
    d_past = op.ScatterElements(ctx.dy, written, b.zeros_like(update), axis=axis) if ctx.needs(0) else None
    d_update = op.GatherElements(ctx.dy, written, axis=axis) if ctx.needs(1) else None
    return (d_past, d_update, None)[:len(ctx.inputs)]
