"""Resampling: Resize (F.interpolate, nn.Upsample) and GridSample (F.grid_sample).

Every Resize mode is separable: along each axis, output position ``i`` is a fixed weighted sum
of input positions (the weights depend on the axis' input and output lengths, its scale, its
roi and the node's attributes, never on the data). So along one axis Resize is a product with
an ``[m, n]`` matrix ``A``, and its gradient is the product with ``Aᵀ``. The rule builds ``A``
by resizing an ``n x n`` identity along its first axis with the node's own attributes and that
axis' scale or size: column ``j`` of the result is what input ``e_j`` contributes, whatever the
mode, coordinate transformation, rounding, cubic coefficient or antialiasing. With static
shapes and a constant scale or size the matrices are constants, resized by onnxruntime when the
graph is built (the kernel that runs the forward: onnx's reference implementation rounds
lengths and sample positions otherwise); with dynamic ones they are built at run time.
Nearest resizing of the last axis by a whole factor, under the transformations where it copies
each input to a block of outputs (PyTorch's ``nearest`` and ``nearest-exact`` upsampling), skips
the matrix: the gradient sums the blocks (a reshape and a sum over the innermost axis).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import GradContext, grad
from onnxtrain.ir.shapes import dims_equal, rank_of

_FLOAT = int(ir.DataType.FLOAT)
# the largest identity written into the graph as a constant: the folder's input limit (onnxscript's
# default, 8192 elements); a larger one is built at run time rather than stored in the model
_FOLDED_IDENTITY_SIZE = 8192


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
        elif x_shape is not None and y_shape is not None and dims_equal(x_shape[axis], y_shape[axis]):
            kept.add(axis)
    return [a for a in axes if a not in kept]


def _axis_matrix(ctx: GradContext, axis: int, k: int, count: int, uses_scales: bool) -> ir.Value:
    """``A`` of shape ``[m, n]`` (float32): Resize along ``axis`` (the ``k``-th of ``count`` resized
    axes) as a matrix, from an ``n x n`` identity resized along its first axis by the node's own
    scale (or size), roi and attributes, in onnxruntime: computed now where all of them are
    constants (onnx's reference implementation, which constant folding would run, rounds lengths
    and sample positions otherwise: 13 rows for 20 * 0.7 where onnxruntime makes 14, nearest one
    pixel over at 0.6, align_corners over the fractional length), else at run time."""
    op, b, node = ctx.op, ctx.b, ctx.node
    attributes = {name: attr.value for name, attr in node.attributes.items()
                  if name not in ("axes", "keep_aspect_ratio_policy", "extrapolation_value")}
    crop = _text(ctx.attr("coordinate_transformation_mode", "half_pixel")) == "tf_crop_and_resize"
    roi_given = crop and len(node.inputs) > 1 and node.inputs[1] is not None
    length = ctx.x.shape[axis] if ctx.x.shape is not None else None
    if isinstance(length, int) and length * length <= _FOLDED_IDENTITY_SIZE:
        matrix = _matrix_in_onnxruntime(ctx, axis, k, count, uses_scales, roi_given, length, attributes)
        if matrix is not None:
            return b.const(matrix)
    n = op.Gather(op.Shape(ctx.x), b.ints([axis]), axis=0)
    identity = op.EyeLike(op.ConstantOfShape(op.Concat(n, n, axis=0), value=ir.tensor(np.zeros([1], np.float32))))
    roi = None
    if roi_given:
        # roi (read under this transformation only, often empty otherwise) lists the starts of
        # the resized axes, then their ends
        roi = op.Cast(op.Gather(node.inputs[1], b.ints([k, k + count]), axis=0), to=_FLOAT)
        roi = op.Concat(op.Slice(roi, b.ints([0]), b.ints([1])), b.const(np.array([0.0], np.float32)),
                        op.Slice(roi, b.ints([1]), b.ints([2])), b.const(np.array([1.0], np.float32)), axis=0)
    if uses_scales:  # as the forward: by the scale (antialias widens its filter by the scale given)
        scale = op.Gather(node.inputs[2], b.ints([k]), axis=0)
        return op.Resize(identity, roi, op.Concat(scale, b.const(np.array([1.0], np.float32)), axis=0), **attributes)
    m = op.Gather(op.Shape(ctx.y), b.ints([axis]), axis=0)
    return op.Resize(identity, roi, None, op.Concat(m, n, axis=0), **attributes)


def _matrix_in_onnxruntime(ctx: GradContext, axis: int, k: int, count: int, uses_scales: bool, roi_given: bool,
                           length: int, attributes: dict) -> np.ndarray | None:
    """The axis matrix, resized now by onnxruntime's Resize (the forward's kernel), or None if
    the scale, size or roi is not a constant."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from onnxtrain.runtime.session import create_session, quiet_session_options

    if uses_scales:
        scales = ctx.const_input(2)
        if scales is None:
            return None
        scales, sizes = np.array([float(scales.reshape(-1)[k]), 1.0], np.float32), None
    else:
        m = ctx.y.shape[axis] if ctx.y.shape is not None else None
        if not isinstance(m, int):
            return None
        scales, sizes = None, np.array([m, length], np.int64)
    roi = None
    if roi_given:
        given = ctx.const_input(1)
        if given is None:
            return None
        given = given.reshape(-1)
        roi = np.array([given[k], 0.0, given[k + count], 1.0], np.float32)
    inits = [numpy_helper.from_array(np.eye(length, dtype=np.float32), "identity")]
    names_in = ["identity", "", "", ""]
    for position, (name, array) in enumerate((("roi", roi), ("scales", scales), ("sizes", sizes)), start=1):
        if array is not None:
            inits.append(numpy_helper.from_array(array, name))
            names_in[position] = name
    while names_in[-1] == "":
        names_in.pop()
    resize = helper.make_node("Resize", names_in, ["matrix"], **attributes)
    graph = helper.make_graph([resize], "axis_matrix", [], [helper.make_tensor_value_info("matrix", onnx.TensorProto.FLOAT,
                                                                                           None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", max(ctx.opset, 13))], ir_version=8)
    # quiet: onnx's shape inference may expect another length, onnxruntime's is the one
    options = quiet_session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = create_session(model.SerializeToString(), ["CPUExecutionProvider"], options, "Resize gradient's axis matrix")
    return session.run(None, {})[0]


# (coordinate transformation, nearest mode) pairs under which nearest resizing by a whole factor s
# copies input position q to outputs q*s .. q*s + s-1: the gradient sums those blocks
_BLOCK_COPIES = {("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("half_pixel", "round_prefer_ceil"),
                 ("pytorch_half_pixel", "round_prefer_floor"), ("pytorch_half_pixel", "round_prefer_ceil")}


def _block_factor(ctx: GradContext, axis: int, k: int, scales, sizes) -> int | None:
    """The whole factor s by which a nearest Resize copies each input position along ``axis`` to
    s adjacent outputs, or None (then the interpolation matrix is used)."""
    mode = (_text(ctx.attr("coordinate_transformation_mode", "half_pixel")),
            _text(ctx.attr("nearest_mode", "round_prefer_floor")))
    if _text(ctx.attr("mode", "nearest")) != "nearest" or mode not in _BLOCK_COPIES:
        return None
    if scales is not None and scales.size:
        factor = float(scales[k])
    else:
        length = ctx.x.shape[axis] if ctx.x.shape is not None else None
        if sizes is None or not isinstance(length, int) or length == 0:
            return None
        factor = int(sizes[k]) / length
    return int(factor) if factor >= 1 and factor == int(factor) else None


def _sum_last_axis_blocks(ctx: GradContext, g: ir.Value, factor: int) -> ir.Value:
    """``g`` with each run of ``factor`` positions along its last axis summed into one."""
    op, b = ctx.op, ctx.b
    split = op.Concat(op.Slice(op.Shape(g), b.ints([0]), b.ints([-1])), b.ints([-1, factor]), axis=0)
    return b.reduce_sum(op.Reshape(g, split), [-1], keepdims=False)


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
        # the last axis' blocks are contiguous: their sum beats the product from ~128 pixels up (a
        # [1, 16, 512, 512] gradient: 6.9 against 10.3 ms); a sum over a middle axis is slower
        factor = _block_factor(ctx, axis, axes.index(axis), scales if uses_scales else None, sizes) \
            if axis == rank - 1 else None
        if factor is not None:
            g = _sum_last_axis_blocks(ctx, g, factor)
            continue
        matrix = _axis_matrix(ctx, axis, axes.index(axis), len(axes), uses_scales)
        if g.dtype != ir.DataType.FLOAT:
            matrix = ctx.op.Cast(matrix, to=int(g.dtype))
        g = _contract(ctx, g, matrix, axis, rank)
    return (g,)


# -- GridSample -----------------------------------------------------------------------


def _reflect(ctx: GradContext, tap: ir.Value, low: ir.Value, high: ir.Value) -> ir.Value:
    """A pixel position reflected at ``low``/``high`` until inside, as onnxruntime's kernel
    reflects the positions of the taps (not the sampling coordinate). An axis of length 1 with
    aligned corners has ``low == high``: every tap reads it (not 0 / 0)."""
    op = ctx.op
    span = op.Sub(high, low)
    empty = op.LessOrEqual(span, ctx.like(span, 0.0))
    span = op.Where(empty, ctx.like(span, 1.0), span)

    def odd_turns_and_rest(distance):  # distance >= 0 past a bound, in whole spans and the rest
        turns = op.Floor(op.Div(distance, span))
        odd = op.Cast(op.Mod(op.Cast(turns, to=int(ir.DataType.INT64)), ctx.b.scalar_int(2)),
                      to=int(ir.DataType.BOOL))
        return odd, op.Sub(distance, op.Mul(turns, span))

    odd, rest = odd_turns_and_rest(op.Sub(low, tap))  # below low: an even count lands above low
    below = op.Where(odd, op.Sub(high, rest), op.Add(low, rest))
    odd, rest = odd_turns_and_rest(op.Sub(tap, high))  # above high: an even count lands below high
    above = op.Where(odd, op.Add(low, rest), op.Sub(high, rest))
    reflected = op.Where(op.Less(tap, low), below, op.Where(op.Greater(tap, high), above, tap))
    return op.Where(empty, op.Add(low, op.Mul(tap, ctx.like(tap, 0.0))), reflected)


def _grid_tap(ctx: GradContext, tap: ir.Value, size: ir.Value, padding: str, align: bool):
    """Where tap position ``tap`` (a float, integral) reads along an axis of length ``size``:
    (int64 position inside the axis, whether it reads the input at all or None if always)."""
    op = ctx.op
    last = op.Sub(size, ctx.like(size, 1.0))
    zero = ctx.like(tap, 0.0)
    valid = None
    if padding == "zeros":
        valid = op.And(op.GreaterOrEqual(tap, zero), op.LessOrEqual(tap, last))
        position = op.Min(op.Max(tap, zero), last)
    elif padding == "border":
        position = op.Min(op.Max(tap, zero), last)
    elif padding == "reflection":
        half = ctx.like(tap, 0.5)
        low, high = (zero, last) if align else (op.Neg(half), op.Sub(size, half))
        position = op.Floor(op.Max(_reflect(ctx, tap, low, high), zero))  # the kernel truncates
    else:
        raise NotImplementedError(f"padding_mode={padding!r}")
    return op.Cast(position, to=int(ir.DataType.INT64)), valid


_CUBIC_A = -0.75  # onnxruntime's (and PyTorch's) bicubic coefficient for GridSample


def _cubic_near(ctx: GradContext, s: ir.Value, derivative: bool) -> ir.Value:
    """Keys' cubic weight of a tap at distance ``s`` in [0, 1] (or its derivative in ``s``)."""
    op, a = ctx.op, _CUBIC_A
    if derivative:  # 3 (a + 2) s^2 - 2 (a + 3) s
        return op.Mul(s, op.Sub(op.Mul(ctx.like(s, 3 * (a + 2)), s), ctx.like(s, 2 * (a + 3))))
    return op.Add(op.Mul(op.Mul(s, s), op.Sub(op.Mul(ctx.like(s, a + 2), s), ctx.like(s, a + 3))), ctx.like(s, 1.0))


def _cubic_far(ctx: GradContext, s: ir.Value, derivative: bool) -> ir.Value:
    """Keys' cubic weight of a tap at distance ``s`` in [1, 2] (or its derivative in ``s``)."""
    op, a = ctx.op, _CUBIC_A
    if derivative:  # 3 a s^2 - 10 a s + 8 a
        return op.Add(op.Mul(s, op.Sub(op.Mul(ctx.like(s, 3 * a), s), ctx.like(s, 10 * a))), ctx.like(s, 8 * a))
    inner = op.Add(op.Mul(op.Sub(op.Mul(ctx.like(s, a), s), ctx.like(s, 5 * a)), s), ctx.like(s, 8 * a))
    return op.Sub(op.Mul(inner, s), ctx.like(s, 4 * a))


def _axis_taps(ctx: GradContext, point: ir.Value, mode: str) -> list[tuple[ir.Value, ir.Value | None, ir.Value | None]]:
    """The taps a sampling point reads along one axis: (position, weight, d weight / d point);
    the weights are None for nearest sampling (one tap, weight 1, no gradient)."""
    op = ctx.op
    if mode == "nearest":
        return [(op.Round(point), None, None)]  # half to even, as the kernel's nearbyint
    base = op.Floor(point)
    t = op.Sub(point, base)
    one = ctx.like(point, 1.0)
    if mode in ("bilinear", "linear"):
        return [(base, op.Sub(one, t), ctx.like(point, -1.0)), (op.Add(base, one), t, one)]
    # cubic: 4 taps from floor - 1, at distances t + 1, t, 1 - t, 2 - t
    near, far = op.Sub(one, t), op.Sub(ctx.like(point, 2.0), t)
    before = op.Add(t, one)
    return [(op.Sub(base, one), _cubic_far(ctx, before, False), _cubic_far(ctx, before, True)),
            (base, _cubic_near(ctx, t, False), _cubic_near(ctx, t, True)),
            (op.Add(base, one), _cubic_near(ctx, near, False), op.Neg(_cubic_near(ctx, near, True))),
            (op.Add(base, ctx.like(point, 2.0)), _cubic_far(ctx, far, False), op.Neg(_cubic_far(ctx, far, True)))]


@grad("GridSample", versions=(16, None))
def _grid_sample(ctx):
    # Y = sum over the taps around each sampling point of weight(point) * X[tap]: X's gradient
    # scatters dY * weight back to the taps; the grid's is dY * d weight / d point * X[tap]
    # summed over the taps and channels, times d point / d grid (the weights are products of
    # per-axis factors: linear or Keys' cubic; nearest sampling has no grid gradient).
    op, b = ctx.op, ctx.b
    x, grid = ctx.inputs
    rank = rank_of(x)
    if rank is None:
        raise NotImplementedError(f"the rank of {x.name!r} must be known")
    r = rank - 2
    mode = _text(ctx.attr("mode", "bilinear" if ctx.opset < 20 else "linear"))
    if mode not in ("bilinear", "linear", "nearest", "bicubic", "cubic"):
        raise NotImplementedError(f"mode={mode!r}")
    padding = _text(ctx.attr("padding_mode", "zeros"))
    align = bool(ctx.attr("align_corners", 0))
    x_shape = op.Shape(x)
    batch_channels = op.Slice(x_shape, b.ints([0]), b.ints([2]))
    one = ctx.like(grid, 1.0)
    lengths, points, axis_taps = [], [], []
    for axis in range(r):  # grid component r - 1 - axis addresses spatial axis ``axis``
        length = op.Gather(x_shape, b.ints([2 + axis]), axis=0)
        size = op.Reshape(op.Cast(length, to=int(grid.dtype)), b.ints([]))
        g = op.Gather(grid, b.scalar_int(r - 1 - axis), axis=-1)
        point = (op.Div(op.Mul(op.Add(g, one), op.Sub(size, one)), ctx.like(grid, 2.0)) if align else
                 op.Div(op.Sub(op.Mul(op.Add(g, one), size), one), ctx.like(grid, 2.0)))
        lengths.append((length, size))
        points.append(point)
        axis_taps.append(_axis_taps(ctx, point, mode))

    flat_points = op.Concat(op.Slice(x_shape, b.ints([0]), b.ints([1])), b.ints([1, -1]), axis=0)  # [N, 1, Q]
    taps = []  # per tap: (flat int64 index [N, 1, Q], weight [N, *out], per-axis (weight, slope), validity)
    for choice in itertools.product(*axis_taps):
        index, valid = None, None
        for axis, (tap, _, _) in enumerate(choice):
            length, size = lengths[axis]
            position, inside = _grid_tap(ctx, tap, size, padding, align)
            index = position if index is None else op.Add(op.Mul(index, length), position)
            if inside is not None:
                valid = inside if valid is None else op.And(valid, inside)
        weight = None
        for _, factor, _ in choice:
            if factor is not None:
                weight = factor if weight is None else op.Mul(weight, factor)
        if valid is not None:
            mask = op.Cast(valid, to=int(grid.dtype))
            weight = mask if weight is None else op.Mul(weight, mask)
        taps.append((op.Reshape(index, flat_points), weight, choice, valid))

    dy = op.Reshape(ctx.dy, op.Concat(batch_channels, b.ints([-1]), axis=0))  # [N, C, Q]
    per_channel = op.Concat(batch_channels, b.ints([1]), axis=0)
    flat_x = op.Reshape(x, op.Concat(batch_channels, b.ints([-1]), axis=0))  # [N, C, P]
    dx = dgrid = None
    if ctx.needs(0):
        indices = op.Concat(*(op.Expand(index, per_channel) for index, *_ in taps), axis=2)
        updates = op.Concat(*(dy if weight is None else op.Mul(dy, op.Reshape(weight, flat_points))
                              for _, weight, *_ in taps), axis=2)
        dx = op.Reshape(op.ScatterElements(b.zeros_like(flat_x), indices, updates, axis=2, reduction="add"), x_shape)
    if ctx.needs(1) and mode != "nearest":
        components = [None] * r
        values = [op.GatherElements(flat_x, op.Expand(index, per_channel), axis=2) for index, *_ in taps]
        point_shape = op.Shape(points[0])
        for axis in range(r):
            slope = None  # d y / d point along ``axis``, per channel: [N, C, Q]
            for (_, _, choice, valid), value in zip(taps, values):
                term = choice[axis][2]
                for other, (_, factor, _) in enumerate(choice):
                    if other != axis:
                        term = op.Mul(term, factor)
                if valid is not None:
                    term = op.Mul(term, op.Cast(valid, to=int(grid.dtype)))
                part = op.Mul(value, op.Reshape(op.Expand(term, point_shape), flat_points))
                slope = part if slope is None else op.Add(slope, part)
            length, size = lengths[axis]
            scale = op.Div(op.Sub(size, one) if align else size, ctx.like(grid, 2.0))
            summed = op.ReduceSum(op.Mul(dy, slope), b.ints([1]), keepdims=0)  # [N, Q]
            components[r - 1 - axis] = op.Unsqueeze(op.Mul(op.Reshape(summed, point_shape), scale), b.ints([-1]))
        dgrid = op.Concat(*components, axis=-1)
    elif ctx.needs(1):
        dgrid = b.zeros_like(grid)
    return dx, dgrid
