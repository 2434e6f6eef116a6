"""Gradient rules: convolution and pooling.

Spatial geometry (pads from ``auto_pad``, output sizes) is computed with int64 Shape
arithmetic so symbolic batch and spatial dims work. Two tools recur:

* a transposed convolution without pads gives the "full" gradient of the padded
  input; ``_fit`` crops the pads off (and zero-fills input rows no window touched)
  with one Pad of possibly negative amounts (with static sizes the transposed
  convolution takes the pads and ``output_padding`` itself: no cropped copy);
* ``_correlate`` correlates two batched tensors over the batch axis, which is the
  weight gradient of Conv and of ConvTranspose (groups included).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from onnxtrain.autodiff.registry import Broadcast, GradContext, grad
from onnxtrain.autodiff.rules.index import SCATTER_ADD_OPSET
from onnxtrain.autodiff.rules.shape import reshape_exactly
from onnxtrain.ir.shapes import rank_of
from onnxtrain.passes.conv_patches import mark_patches

_INT64_MAX = np.iinfo(np.int64).max


def _tail(b, v: ir.Value, start: int = 2) -> ir.Value:
    """``Shape(v)[start:]`` (the spatial sizes of an NC... tensor)."""
    return b.op.Slice(b.op.Shape(v), b.ints([start]), b.ints([_INT64_MAX]))


def _head(b, v: ir.Value, count: int) -> ir.Value:
    """``Shape(v)[:count]``: leading sizes for a Reshape where the batch may be empty. Not the 0
    ("copy the dim") of a Reshape target beside a size computed from the shape: onnxruntime's
    ReshapeFusion turns such a target into a constant with a -1, which cannot be inferred when
    a dim is 0. Constants where the sizes are static."""
    dims = list(v.shape)[:count] if v.shape is not None and len(v.shape) >= count else []
    if len(dims) == count and all(isinstance(d, int) for d in dims):
        return b.ints(dims)
    return b.op.Slice(b.op.Shape(v), b.ints([0]), b.ints([count]))


def _group_width(b, v: ir.Value, group: int) -> ir.Value:
    """``Shape(v)[1:2] / group`` (the channels of one group)."""
    return b.op.Div(b.op.Slice(b.op.Shape(v), b.ints([1]), b.ints([2])), b.ints([group]))


def _spatial_rank(ctx) -> int:
    kernel = ctx.attr("kernel_shape")
    if kernel:
        return len(kernel)
    rank = rank_of(ctx.inputs[1]) if len(ctx.inputs) > 1 and ctx.inputs[1] is not None else rank_of(ctx.x)
    if rank is None:
        raise NotImplementedError(f"{ctx.node.op_type} gradient needs the rank of its inputs")
    return rank - 2


def _static_kernel(ctx, r: int) -> list[int] | None:
    """The kernel's spatial sizes, from ``kernel_shape`` or the weight's static shape; None if unknown."""
    kernel = ctx.attr("kernel_shape")
    if kernel:
        return [int(k) for k in kernel]
    shape = ctx.inputs[1].shape
    if shape is None or len(shape) != r + 2 or not all(isinstance(d, int) for d in shape[2:]):
        return None
    return [int(d) for d in shape[2:]]


def _ints_attr(ctx, name: str, r: int, default: int) -> list[int]:
    value = ctx.attr(name)
    return [int(v) for v in value] if value else [default] * r


def _extent(ctx, r: int, dilations) -> ir.Value:
    """Receptive extent (k - 1) * d + 1 of the kernel along each spatial axis."""
    op, b = ctx.op, ctx.b
    kernel = ctx.attr("kernel_shape")
    kernel = b.ints(kernel) if kernel else _tail(b, ctx.inputs[1])
    return op.Add(op.Mul(op.Sub(kernel, b.ints([1] * r)), b.ints(dilations)), b.ints([1] * r))


def _same_pads(ctx, total: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Split a total pad as auto_pad says: the odd pixel goes at the end for SAME_UPPER."""
    op = ctx.op
    half = op.Div(total, ctx.b.ints([2]))
    begin = half if ctx.attr("auto_pad", "NOTSET") == "SAME_UPPER" else op.Sub(total, half)
    return begin, op.Sub(total, begin)


def _forward_pads(ctx, r: int, x: ir.Value, y: ir.Value, strides, dilations):
    """(begin, end) pads of a Conv/pool, as int64 vectors or numpy arrays when static."""
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        op, b = ctx.op, ctx.b
        covered = op.Add(op.Mul(op.Sub(_tail(b, y), b.ints([1] * r)), b.ints(strides)), _extent(ctx, r, dilations))
        total = op.Max(op.Sub(covered, _tail(b, x)), b.ints([0] * r))
        return _same_pads(ctx, total)
    if auto_pad == "VALID":
        return np.zeros(r, np.int64), np.zeros(r, np.int64)
    pads = np.array(_ints_attr(ctx, "pads", 2 * r, 0), np.int64)
    return pads[:r], pads[r:]


def _as_value(b, v) -> ir.Value:
    return b.ints(v) if isinstance(v, np.ndarray) else v


def _pad(b, t: ir.Value, begin, end) -> ir.Value:
    """Zero-pad (negative: crop) the spatial axes of ``t``."""
    if isinstance(begin, np.ndarray) and isinstance(end, np.ndarray) and not begin.any() and not end.any():
        return t
    pads = b.op.Concat(b.ints([0, 0]), _as_value(b, begin), b.ints([0, 0]), _as_value(b, end), axis=0)
    return b.op.Pad(t, pads)


def _fit(b, full: ir.Value, x: ir.Value, begin) -> ir.Value:
    """Crop the gradient of the padded input to ``x``'s spatial extent (zeros where no window reached)."""
    op = b.op
    begin = _as_value(b, begin)
    end = op.Sub(op.Add(_tail(b, x), begin), _tail(b, full))
    return _pad(b, full, op.Neg(begin), end)


def _correlate(b, data: ir.Value, kern: ir.Value, group: int, r: int, strides, dilations,
               pads: list[int] | None = None) -> ir.Value:
    """out[g*Ck + k, c, t] = sum_{n, s} kern[n, g*Ck + k, s] * data[n, g*Cd + c, t + s*dilation...].

    The batch axis becomes the channel axis of a grouped Conv (kern acts as the weight); with
    ``pads`` (begin and end per spatial axis), of data padded with zeros by them, which that
    Conv reads as its own pads (no padded copy of data).
    """
    op = b.op
    spatial = list(range(2, 2 + r))
    if group == 1:
        data_t = op.Transpose(data, perm=[1, 0, *spatial])
        kern_t = op.Transpose(kern, perm=[1, 0, *spatial])
    else:
        # sizes spelled out where the batch may be empty (see _head)
        grouped = [2, 1, 0] + [a + 1 for a in spatial]  # (N, G, C, ...) -> (C, G, N, ...)
        d = op.Reshape(data, op.Concat(_head(b, data, 1), b.ints([group]), _group_width(b, data, group),
                                       _tail(b, data), axis=0))
        d = op.Transpose(d, perm=grouped)
        data_t = op.Reshape(d, op.Concat(b.ints([0, -1]), _tail(b, data), axis=0))  # (Cd, G*N, ...)
        k = op.Reshape(kern, op.Concat(_head(b, kern, 1), b.ints([group]), _group_width(b, kern, group),
                                       _tail(b, kern), axis=0))
        k = op.Transpose(k, perm=[1, 2, 0] + [a + 1 for a in spatial])  # (G, Ck, N, ...)
        channels = op.Slice(op.Shape(kern), b.ints([1]), b.ints([2]))
        kern_t = reshape_exactly(b, k, op.Concat(channels, _head(b, kern, 1), _tail(b, kern), axis=0))  # (G*Ck, N, ...)
    out = op.Conv(data_t, kern_t, group=group, strides=strides, dilations=dilations, pads=pads or [0] * (2 * r))
    return op.Transpose(out, perm=[1, 0, *spatial])


_MAX_PATCH_TAPS = 25  # kernels up to 5x5: the patch tensor holds that many copies of the input


# how the weight gradient's product over the patches runs (_correlate_by_patches)
_PER_SAMPLE = "per_sample"        # kern[n] @ patches[n]^T, summed over n
_PATCHES_FIRST = "patches_first"  # patches[n] @ kern[n]^T, summed over n, then transposed
_ONE_PRODUCT = "one_product"      # one product over batch and positions
# the most output channels for which patches_first wins on onnxruntime's CPU provider
_MAX_PATCHES_FIRST_CHANNELS = 64


def _weight_gradient_product(w: ir.Value, y: ir.Value) -> str:
    """How :func:`_correlate_by_patches` runs the product for a Conv of weight ``w`` and output
    ``y``: chosen by the output channels O and positions T where static (measured on
    onnxruntime's CPU provider, 2 threads, 3x3 kernels).

    Per sample the product is ``[O, T] @ [T, C*K]`` and the ``N*O*C*K`` per-sample results are
    summed after. Where ``O >= T`` (deep layers over small planes) that sum dwarfs the patches,
    and one ``[O, N*T] @ [N*T, C*K]`` product (the patches transposed in rows of T) wins: O = 256
    over 4x4, batch 32, 10.2 -> 1.8 ms; O = 128 over 8x8 3.6 -> 1.9 ms. Elsewhere, with few
    output channels, the product runs faster with the patches as its left operand (onnxruntime
    packs the right one, here the small ``[O, T]``): O = 32 over 32x32, batch 32, 2.7 -> 1.7 ms;
    O = 64 over 14x14, batch 64, 1.60 -> 1.39 ms; it loses from O = 96 on (O = 128 over 16x16:
    8.6 against 10.1 ms).
    """
    out_channels = w.shape[0] if w.shape is not None and len(w.shape) > 0 else None
    plane = y.shape[2:] if y.shape is not None and len(y.shape) > 2 else None
    if not isinstance(out_channels, int):
        return _PER_SAMPLE
    if plane is not None and all(isinstance(d, int) for d in plane) and out_channels >= int(np.prod(plane)):
        return _ONE_PRODUCT
    return _PATCHES_FIRST if out_channels <= _MAX_PATCHES_FIRST_CHANNELS else _PER_SAMPLE


def _correlate_by_patches(b, data: ir.Value, kern: ir.Value, kernel: list[int], strides, dilations,
                          channels: int | None, product: str = _PER_SAMPLE) -> ir.Value:
    """The ungrouped Conv weight gradient as one batched product with the input's patches.

    ``out[o, c, s] = sum_{n, t} kern[n, o, t] * data[n, c, t * stride + s * dilation]``: one
    strided Slice of ``data`` per kernel tap, stacked to ``patches[n, c * K + tap, t]``, then
    ``sum_n kern[n] @ patches[n]^T``. ONNX Runtime runs this several times faster than the
    correlation as a Conv (whose "kernel" would be the whole output plane). Not the patches as
    one grouped Conv with unit-vector kernels (im2col): twice as fast on onnxruntime's CPU
    provider (CNN conv2, ``[64, 32, 14, 14]``, 3x3: 1.26 against 2.2 ms), but onnxruntime-web's
    WebGPU provider computes that grouped Conv wrongly (the digits CNN's losses 0.09 off
    Python's after 20 steps). With ``channels`` (the input's, when static) known, the patches'
    node is marked so that CPU sessions make that Conv of them (passes/conv_patches.py).
    ``product`` says how the product runs (:func:`_weight_gradient_product`).
    """
    op = b.op
    r = len(kernel)
    spatial = list(range(2, 2 + r))
    out_size = _tail(b, kern)
    span = op.Add(op.Mul(op.Sub(out_size, b.ints([1] * r)), b.ints(strides)), b.ints([1] * r))
    plane = op.ReduceProd(out_size, keepdims=1)
    tap_shape = op.Concat(_head(b, data, 2), b.ints([1]), plane, axis=0)
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = b.ints([o * d for o, d in zip(offset, dilations)])
        tap = op.Slice(data, start, op.Add(start, span), b.ints(spatial), b.ints(strides))
        taps.append(op.Reshape(tap, tap_shape))
    patches = op.Concat(*taps, axis=2) if len(taps) > 1 else taps[0]  # (N, C, K, T)
    # sizes spelled out where the batch may be empty (see _head)
    taps_per_channel = int(np.prod(kernel))
    channel_taps = (b.ints([channels * taps_per_channel]) if channels is not None
                    else op.Mul(op.Slice(op.Shape(data), b.ints([1]), b.ints([2])), b.ints([taps_per_channel])))
    patches = op.Reshape(patches, op.Concat(_head(b, data, 1), channel_taps, plane, axis=0))  # (N, C*K, T)
    if channels is not None:
        mark_patches(patches.producer(), kernel, strides, dilations, channels)
    flat_kern = op.Reshape(kern, op.Concat(_head(b, kern, 2), plane, axis=0))  # (N, O, T)
    if product == _ONE_PRODUCT:
        rows = op.Reshape(op.Transpose(flat_kern, perm=[1, 0, 2]), b.ints([0, -1]))  # (O, N*T)
        patch_rows = op.Reshape(op.Transpose(patches, perm=[1, 0, 2]), b.ints([0, -1]))  # (C*K, N*T)
        summed = op.MatMul(rows, op.Transpose(patch_rows, perm=[1, 0]))  # (O, C*K)
    elif product == _PATCHES_FIRST:
        per_sample = op.MatMul(patches, op.Transpose(flat_kern, perm=[0, 2, 1]))  # (N, C*K, O)
        summed_t = b.reduce_sum(per_sample, [0], keepdims=False)  # (C*K, O)
        # the layout change last, on the weight's shape: a graph's final Transpose stays where it
        # is (onnxruntime moves a Transpose that a Reshape follows past it, as a node of its own
        # that its default order then runs first, with every node the gradient depends on)
        split = op.Reshape(summed_t, op.Concat(b.ints([-1, *kernel]), op.Slice(op.Shape(summed_t), b.ints([1]),
                                                                                b.ints([2])), axis=0))
        return op.Transpose(split, perm=[r + 1, *range(r + 1)])  # (O, C, *kernel)
    else:
        per_sample = op.MatMul(flat_kern, op.Transpose(patches, perm=[0, 2, 1]))  # (N, O, C*K)
        summed = b.reduce_sum(per_sample, [0], keepdims=False)
    return op.Reshape(summed, op.Concat(op.Slice(op.Shape(summed), b.ints([0]), b.ints([1])), b.ints([-1]),
                                        b.ints(kernel), axis=0))


def _static_output_padding(ctx, r: int, kernel: list[int] | None, begin, end, strides,
                           dilations) -> list[int] | None:
    """The ``output_padding`` that makes ``ConvTranspose(dy, w, pads=begin + end)`` exactly the
    input's gradient (the input rows past the last window, which no window reads), when the pads,
    the kernel and the spatial sizes are static and those rows are fewer than the stride; else None."""
    x_shape, y_shape = ctx.x.shape, ctx.y.shape
    if kernel is None or not isinstance(begin, np.ndarray) or not isinstance(end, np.ndarray):
        return None
    if x_shape is None or y_shape is None or len(x_shape) != r + 2 or len(y_shape) != r + 2:
        return None
    sizes, outs = list(x_shape)[2:], list(y_shape)[2:]
    if not all(isinstance(d, int) for d in sizes + outs):
        return None
    extra = [int(n + p0 + p1 - ((o - 1) * s + (k - 1) * d + 1))
             for n, p0, p1, o, s, k, d in zip(sizes, begin, end, outs, strides, kernel, dilations)]
    if not all(0 <= e < s for e, s in zip(extra, strides)):
        return None
    return extra


def _bias_grad(ctx, r: int) -> ir.Value:
    return ctx.b.reduce_sum(ctx.dy, [0, *range(2, 2 + r)], keepdims=False)


@grad("Conv", versions=(13, None))
def _conv(ctx):
    x, w = ctx.inputs[:2]
    b, op, dy = ctx.b, ctx.op, ctx.dy
    r = _spatial_rank(ctx)
    strides, dilations = _ints_attr(ctx, "strides", r, 1), _ints_attr(ctx, "dilations", r, 1)
    group = int(ctx.attr("group", 1))
    begin, end = _forward_pads(ctx, r, x, ctx.y, strides, dilations)
    kernel = _static_kernel(ctx, r)
    dx = dw = db = None
    if ctx.needs(0):
        output_padding = _static_output_padding(ctx, r, kernel, begin, end, strides, dilations)
        if output_padding is not None:  # ConvTranspose crops the pads itself: no cropped copy
            dx = op.ConvTranspose(dy, w, strides=strides, dilations=dilations, group=group,
                                  pads=[*begin.tolist(), *end.tolist()], output_padding=output_padding)
        else:
            full = op.ConvTranspose(dy, w, strides=strides, dilations=dilations, group=group)
            dx = _fit(b, full, x, begin)
    if ctx.needs(1):
        if group == 1 and kernel is not None and int(np.prod(kernel)) <= _MAX_PATCH_TAPS:
            static = w.shape is not None and len(w.shape) == r + 2 and isinstance(w.shape[1], int)
            dw = _correlate_by_patches(b, _pad(b, x, begin, end), dy, kernel, strides, dilations,
                                       int(w.shape[1]) if static else None, _weight_gradient_product(w, ctx.y))
        else:
            # strides and dilations swap roles; windows may reach past the kernel: crop to it
            if isinstance(begin, np.ndarray) and isinstance(end, np.ndarray):  # the Conv pads x itself
                dw = _correlate(b, x, dy, group, r, dilations, strides, [*begin.tolist(), *end.tolist()])
            else:
                dw = _correlate(b, _pad(b, x, begin, end), dy, group, r, dilations, strides)
            dw = op.Slice(dw, b.ints([0] * r), _tail(b, w), b.ints(list(range(2, 2 + r))))
    if ctx.needs(2):
        db = _bias_grad(ctx, r)
    return (dx, dw, db)[: len(ctx.inputs)]


def _conv_transpose_begin_pads(ctx, r: int, x: ir.Value, strides, dilations):
    """Leading pads a ConvTranspose crops off its full output (see the ONNX spec's equations)."""
    output_shape = ctx.attr("output_shape")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if not output_shape and auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        return np.array(_ints_attr(ctx, "pads", 2 * r, 0)[:r], np.int64)
    op, b = ctx.op, ctx.b
    full = op.Add(op.Add(op.Mul(op.Sub(_tail(b, x), b.ints([1] * r)), b.ints(strides)), _extent(ctx, r, dilations)),
                  b.ints(_ints_attr(ctx, "output_padding", r, 0)))
    wanted = b.ints(output_shape[-r:]) if output_shape else op.Mul(_tail(b, x), b.ints(strides))
    total = op.Max(op.Sub(full, wanted), b.ints([0] * r))
    half = op.Div(total, b.ints([2]))
    # the spec's "else" branch (SAME_LOWER and explicit output_shape) puts the odd pixel first
    return half if auto_pad == "SAME_UPPER" else op.Sub(total, half)


@grad("ConvTranspose", versions=(13, None))
def _conv_transpose(ctx):
    x, w = ctx.inputs[:2]
    b, op = ctx.b, ctx.op
    r = _spatial_rank(ctx)
    strides, dilations = _ints_attr(ctx, "strides", r, 1), _ints_attr(ctx, "dilations", r, 1)
    group = int(ctx.attr("group", 1))
    begin = _as_value(b, _conv_transpose_begin_pads(ctx, r, x, strides, dilations))
    # place dy in the un-cropped output of length s*(H-1) + (k-1)*d + 1 (output_padding dropped)
    full = op.Add(op.Mul(op.Sub(_tail(b, x), b.ints([1] * r)), b.ints(strides)), _extent(ctx, r, dilations))
    dy_full = _pad(b, ctx.dy, begin, op.Sub(op.Sub(full, _tail(b, ctx.dy)), begin))
    dx = dw = db = None
    if ctx.needs(0):
        dx = op.Conv(dy_full, w, strides=strides, dilations=dilations, group=group)
    if ctx.needs(1):
        dw = _correlate(b, dy_full, x, group, r, dilations, strides)
    if ctx.needs(2):
        db = _bias_grad(ctx, r)
    return (dx, dw, db)[: len(ctx.inputs)]


_POOL_ATTRS = ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad", "count_include_pad")


def _pool_attrs(ctx) -> dict:
    return {name: ctx.attr(name) for name in _POOL_ATTRS if ctx.attr(name) is not None}


def _max_pool_indices(ctx) -> ir.Value:
    """Row-major flat arg-max indices, batch and channel offsets included (ONNX's definition)."""
    if len(ctx.outputs) > 1 and int(ctx.attr("storage_order", 0)) == 0:
        return ctx.outputs[1]
    indices = ctx.op.MaxPool(ctx.x, _outputs=2, **_pool_attrs(ctx))[1]
    indices.type = ir.TensorType(ir.DataType.INT64)
    return indices


def _tiles_the_input(ctx) -> bool:
    """Whether the MaxPool's windows tile its input without overlap or padding.

    That is strides == kernel_shape, dilations 1, no pads (``auto_pad`` NOTSET with zero
    ``pads``, or VALID) and ``ceil_mode`` 0: each input element lies in at most one window, and
    the rows and columns past the last whole window lie in none.
    """
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    r = len(kernel)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    return (_ints_attr(ctx, "strides", r, 1) == kernel
            and _ints_attr(ctx, "dilations", r, 1) == [1] * r
            and int(ctx.attr("ceil_mode", 0)) == 0
            and (auto_pad == "VALID" or (auto_pad == "NOTSET" and not any(_ints_attr(ctx, "pads", 2 * r, 0)))))


def _window_positions(b, kernel: list[int], covered, static_covered: list[int] | None) -> ir.Value:
    """Each element's row-major position inside its window, as float32 of shape ``covered``."""
    op = b.op
    r = len(kernel)
    tap_stride = [int(np.prod(kernel[i + 1:])) for i in range(r)]
    if static_covered is not None:
        grids = np.meshgrid(*(np.arange(e) % k * t for e, k, t in zip(static_covered, kernel, tap_stride)),
                            indexing="ij")
        return b.const(np.sum(grids, axis=0).astype(np.float32))
    total = None
    for i, (k, t) in enumerate(zip(kernel, tap_stride)):
        size = op.Reshape(op.Slice(covered, b.ints([i]), b.ints([i + 1])), b.ints([]))
        along = op.Mul(op.Mod(op.Range(b.scalar_int(0), size, b.scalar_int(1)), b.scalar_int(k)), b.scalar_int(t))
        along = op.Reshape(along, b.ints([-1 if axis == i else 1 for axis in range(r)]))
        total = along if total is None else op.Add(total, along)
    return op.Cast(total, to=int(ir.DataType.FLOAT))


# element types the window rule spreads with Resize (ONNX Runtime's CPU provider has no float64 Resize)
_RESIZE_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _max_pool_by_windows(ctx) -> ir.Value:
    """MaxPool's input gradient for windows that tile the input, without MaxPool's ``Indices``.

    The covered part of the input (the rows and columns past the last whole window are left
    out) is viewed as ``[N, C, O1, k1, ..., Or, kr]`` and transposed to ``[N, C, O1, ..., Or,
    k1, ..., kr]``, so that each window's elements lie together in row-major window order;
    ArgMax over them picks each window's first largest element (the element ``Indices``
    names). Nearest-neighbour Resize spreads the winner's tap and the output gradient over the
    windows, and an element receives the gradient where the winner's tap is its own position in
    its window. A zero Pad restores the left-out remainder. Standard ops that onnxruntime-web's
    WebGPU provider runs (it cannot compute MaxPool's ``Indices``), and no ScatterElements. On
    ONNX Runtime's CPU provider the one Transpose costs a fraction of the per-tap strided
    Slices it replaced (CNN 2x2 pools, batch 64: 4 Slices and a Concat ~5 ms, the Transpose
    0.7 ms).
    """
    op, b, x = ctx.op, ctx.b, ctx.x
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    r = len(kernel)
    spatial = list(range(2, 2 + r))
    static_covered = None
    if x.shape is not None and len(x.shape) == r + 2 and all(isinstance(d, int) for d in x.shape[2:]):
        sizes = [int(d) for d in x.shape[2:]]
        static_covered = [s // k * k for s, k in zip(sizes, kernel)]
        covered = b.ints(static_covered)
        remainder = np.array(sizes, np.int64) - np.array(static_covered, np.int64)
    else:
        covered = op.Mul(op.Div(_tail(b, x), b.ints(kernel)), b.ints(kernel))  # floor: sizes are >= 0
        remainder = op.Sub(_tail(b, x), covered)
    if static_covered is not None:
        body = x if not remainder.any() else op.Slice(x, b.ints([0] * r), covered, b.ints(spatial))
        window_counts = [b.ints([s // k]) for s, k in zip(static_covered, kernel)]
    else:
        body = op.Slice(x, b.ints([0] * r), covered, b.ints(spatial))
        counts = op.Div(covered, b.ints(kernel))
        window_counts = [op.Slice(counts, b.ints([i]), b.ints([i + 1])) for i in range(r)]
    # [N, C, O1 * k1, ...] -> [N, C, O1, k1, ...] -> [N, C, O1, ..., Or, k1, ..., kr] -> [N, C, O1, ..., Or, K]
    split = op.Reshape(body, op.Concat(_head(b, body, 2), *(d for o, k in zip(window_counts, kernel)
                                                             for d in (o, b.ints([k]))), axis=0))
    perm = [0, 1, *range(2, 2 + 2 * r, 2), *range(3, 3 + 2 * r, 2)]
    windows = split if r == 1 else op.Reshape(op.Transpose(split, perm=perm),
                                              b.ints([0] * (2 + r) + [int(np.prod(kernel))]))
    winner = op.Cast(op.ArgMax(windows, axis=-1, keepdims=0, select_last_index=0), to=int(ir.DataType.FLOAT))
    covered_shape = op.Concat(op.Slice(op.Shape(x), b.ints([0]), b.ints([2])), covered, axis=0)

    def spread(t: ir.Value) -> ir.Value:  # [N, C, O1, ...] -> [N, C, O1 * k1, ...], each value over its window
        if t.dtype in _RESIZE_DTYPES:
            return op.Resize(t, None, None, covered_shape, mode="nearest",
                             coordinate_transformation_mode="asymmetric", nearest_mode="floor")
        # e.g. float64, which ONNX Runtime's CPU Resize lacks: [N, C, O1, 1, ...] expanded to [N, C, O1, k1, ...]
        window_axes = [3 + 2 * i for i in range(r)]
        expanded = op.Expand(b.unsqueeze(t, window_axes), b.ints([1, 1, *(d for k in kernel for d in (1, k))]))
        return op.Reshape(expanded, covered_shape)

    is_winner = op.Equal(spread(winner), _window_positions(b, kernel, covered, static_covered))
    grad_covered = b.keep_where(is_winner, spread(ctx.dy))
    return _pad(b, grad_covered, np.zeros(r, np.int64), remainder)


def _max_pool_by_indices(ctx) -> ir.Value:
    """MaxPool's input gradient for any configuration: each output's gradient is added (scattered)
    at the flat position MaxPool's ``Indices`` output names."""
    op, b = ctx.op, ctx.b
    kernel = ctx.attr("kernel_shape")
    r = len(kernel)
    strides, dilations = _ints_attr(ctx, "strides", r, 1), _ints_attr(ctx, "dilations", r, 1)
    indices = _max_pool_indices(ctx)
    zeros = op.ConstantOfShape(op.Reshape(op.Size(ctx.x), b.ints([1])),
                               value=ir.tensor(np.zeros([1], ctx.x.dtype.numpy())))
    spatial = list(range(2, 2 + r))

    def scatter(dy, idx, **kw):
        return op.ScatterElements(zeros, op.Reshape(idx, b.ints([-1])), op.Reshape(dy, b.ints([-1])), axis=0, **kw)

    if ctx.opset >= SCATTER_ADD_OPSET:
        flat = scatter(ctx.dy, indices, reduction="add")
    else:
        # no scatter-add before opset 16: windows of outputs m = ceil(extent / stride) apart are
        # disjoint, so scatter each residue class of outputs mod m separately and sum.
        period = [-(-((k - 1) * d + 1) // s) for k, s, d in zip(kernel, strides, dilations)]
        parts = []
        for start in itertools.product(*(range(m) for m in period)):
            pick = (b.ints(list(start)), b.ints([_INT64_MAX] * r), b.ints(spatial), b.ints(period))
            parts.append(scatter(op.Slice(ctx.dy, *pick), op.Slice(indices, *pick)))
        flat = parts[0] if len(parts) == 1 else op.Sum(*parts)
    return op.Reshape(flat, op.Shape(ctx.x))


@grad("MaxPool", versions=(13, None))
def _max_pool(ctx):
    """Windows that tile the input: :func:`_max_pool_by_windows` (no ``Indices``, which
    onnxruntime-web's WebGPU provider cannot compute); any other configuration:
    :func:`_max_pool_by_indices`."""
    if _tiles_the_input(ctx):
        return (_max_pool_by_windows(ctx),)
    return (_max_pool_by_indices(ctx),)


@grad("AveragePool", versions=(13, None))
def _average_pool(ctx):
    x, y, dy = ctx.x, ctx.y, ctx.dy
    op, b = ctx.op, ctx.b
    kernel = ctx.attr("kernel_shape")
    r = len(kernel)
    strides, dilations = _ints_attr(ctx, "strides", r, 1), _ints_attr(ctx, "dilations", r, 1)
    begin, end = _forward_pads(ctx, r, x, y, strides, dilations)
    # y = window_sum(x) / divisor. Pooling ones gives valid_count / divisor whatever the
    # count_include_pad and ceil_mode rules; a Conv of zero-padded ones counts the valid cells.
    ones = op.ConstantOfShape(op.Concat(b.ints([1, 1]), _tail(b, x), axis=0),
                              value=ir.tensor(np.ones([1], x.dtype.numpy())))
    box = b.const(np.ones([1, 1, *kernel], x.dtype.numpy()))
    reach = b.ints([(k - 1) * d for k, d in zip(kernel, dilations)])  # room for ceil_mode windows
    valid = op.Conv(_pad(b, ones, begin, op.Add(_as_value(b, end), reach)), box, strides=strides, dilations=dilations)
    valid = op.Slice(valid, b.ints([0] * r), _tail(b, y), b.ints(list(range(2, 2 + r))))
    scale = op.Div(op.AveragePool(ones, **_pool_attrs(ctx)), valid)
    return (_window_sum_adjoint(ctx, op.Mul(dy, scale), kernel, strides, dilations, begin),)


def _window_sum_adjoint(ctx: GradContext, g: ir.Value, kernel, strides, dilations, begin) -> ir.Value:
    """The gradient of x for ``y = sum of x over each pooling window`` with ``dy = g``: every
    window's g added back over its cells (a ConvTranspose with a box of ones), cut to x."""
    op, b, x = ctx.op, ctx.b, ctx.x
    box = b.const(np.ones([1, 1, *kernel], x.dtype.numpy()))
    per_channel = op.Reshape(g, op.Concat(b.ints([-1, 1]), _tail(b, g), axis=0))
    full = op.ConvTranspose(per_channel, box, strides=strides, dilations=dilations)
    return op.Reshape(_fit(b, full, x, begin), op.Shape(x))


def _lp_slope(ctx: GradContext, norm: ir.Value) -> ir.Value:
    """d norm / d x divided by what the adjoint sums: sign(x) |x|^(p-1) / norm^(p-1) for a
    p-norm ``norm`` of cells including x (x / norm for p = 2, sign(x) for p = 1)."""
    op, x, p = ctx.op, ctx.x, ctx.attr("p", 2)
    if p == 1:
        return op.Sign(x)
    if p == 2:
        return op.Div(x, norm)
    return op.Mul(op.Sign(x), op.Pow(op.Div(op.Abs(x), norm), ctx.like(x, p - 1)))


@grad("LpPool", versions=(11, None))
def _lp_pool(ctx):
    # y = (window sum of |x|^p)^(1/p): dx = sign(x) |x|^(p-1) * window adjoint of dy * y^(1-p)
    op, x, y = ctx.op, ctx.x, ctx.y
    kernel = ctx.attr("kernel_shape")
    r, p = len(kernel), ctx.attr("p", 2)
    strides, dilations = _ints_attr(ctx, "strides", r, 1), _ints_attr(ctx, "dilations", r, 1)
    begin, _ = _forward_pads(ctx, r, x, y, strides, dilations)
    if p == 1:
        return (op.Mul(op.Sign(x), _window_sum_adjoint(ctx, ctx.dy, kernel, strides, dilations, begin)),)
    weighted = op.Mul(ctx.dy, op.Pow(y, ctx.like(y, 1 - p)))
    cell = op.Mul(op.Sign(x), op.Pow(op.Abs(x), ctx.like(x, p - 1))) if p != 2 else x
    return (op.Mul(cell, _window_sum_adjoint(ctx, weighted, kernel, strides, dilations, begin)),)


@grad("GlobalAveragePool", versions=(13, None))
def _global_average_pool(ctx):
    op = ctx.op
    count = op.Cast(op.ReduceProd(_tail(ctx.b, ctx.x), keepdims=0), to=int(ctx.x.dtype))
    return (Broadcast(op.Div(ctx.dy, count)),)


@grad("GlobalLpPool", versions=(2, None))
def _global_lp_pool(ctx):
    return (ctx.op.Mul(ctx.dy, _lp_slope(ctx, ctx.y)),)


@grad("GlobalMaxPool", versions=(13, None))
def _global_max_pool(ctx):
    op, b = ctx.op, ctx.b
    flat = op.Reshape(ctx.x, op.Concat(_head(b, ctx.x, 2), op.ReduceProd(_tail(b, ctx.x), keepdims=1), axis=0))
    first_max = op.ArgMax(flat, axis=2, keepdims=1)  # one winner per (n, c), like MaxPool's Indices
    dx = op.ScatterElements(b.zeros_like(flat), first_max, op.Reshape(ctx.dy, b.ints([0, 0, 1])), axis=2)
    return (op.Reshape(dx, op.Shape(ctx.x)),)


@grad("Col2Im", versions=(18, None))
def _col2im(ctx):
    # Col2Im adds column blocks into an image (F.fold); its adjoint cuts the image's gradient back
    # into blocks (F.unfold): a Conv of each channel with one one-hot kernel per block position,
    # same strides, dilations and pads, gives exactly the blocks in Col2Im's column order.
    op, b = ctx.op, ctx.b
    block = ctx.const_input(2)
    if block is None:
        raise NotImplementedError("block_shape must be a constant")
    block = [int(k) for k in np.asarray(block).reshape(-1)]
    r, count = len(block), int(np.prod(block))
    picks = np.zeros([count, 1, *block], ctx.dy.dtype.numpy())
    for position, cell in enumerate(itertools.product(*(range(k) for k in block))):
        picks[(position, 0, *cell)] = 1
    per_channel = op.Reshape(ctx.dy, op.Concat(b.ints([-1, 1]), _tail(b, ctx.dy), axis=0))
    blocks = op.Conv(per_channel, b.const(picks), strides=_ints_attr(ctx, "strides", r, 1),
                     dilations=_ints_attr(ctx, "dilations", r, 1), pads=_ints_attr(ctx, "pads", 2 * r, 0))
    return op.Reshape(blocks, op.Shape(ctx.x)), None, None
