"""Nearest-neighbour interpolation that reads the input pixels PyTorch's kernel reads.

``F.interpolate(mode="nearest")`` exports (torchlib) as an ONNX ``Resize`` with the scale factor.
onnxruntime finds each output position's source by dividing by the float scale; PyTorch's kernel
multiplies by ``float(1 / scale)`` and floors. With a scale such as 0.3 the two disagree at some
positions (output 9 of a length-97 input: 9 / 0.3f = 29.99999, 9 * float(1 / 0.3) = 30.0), so
ORTModule's outputs and gradients were one pixel over from eager's there.

These translations compute PyTorch's source indices, per spatial axis (ATen's ``nearest_idx`` and
``nearest_neighbor_exact_compute_source_index``, float32 arithmetic as the kernel's):

    nearest:        min(floor(i * s), in - 1)          (2-D: i when out == in, i >> 1 when out == 2 in)
    nearest-exact:  min(floor((i + 0.5) * s), in - 1)

with ``s = float(1 / scale)`` where a scale factor is given, else ``float(in) / out``. Where the
sizes are static the indices are constants, and the cheapest exact form is chosen per axis:
nothing (identity), a strided ``Slice`` (downsampling by an integer), an integer-factor ``Resize``
(onnxruntime divides by an integer exactly: U-Net's 2x upsampling keeps its one kernel), else a
``Gather`` of the indices. With symbolic sizes the indices are computed in the graph. Gradients
follow: Gather's, Slice's and Resize's rules scatter back to the pixels read. (Where a 1-D or 3-D
output comes out equal to or twice the input, PyTorch's backward kernel copies and shifts, unlike
its forward, and fails its own gradcheck: ours is the gradient of the forward both compute.)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _scale_of(scale: float | None, in_size: int, out_size: int) -> np.float32:
    """ATen's ``compute_scales_value``: the source step per output position, as a float32."""
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(in_size) / np.float32(out_size)


def source_indices(in_size: int, out_size: int, scale: float | None, exact: bool,
                   shortcuts: bool = False) -> np.ndarray:
    """PyTorch's CPU kernel's source index of every output position along one axis. ``shortcuts``:
    an equal size copies and a double size shifts (ATen's ``nearest_idx``, which the 2-D kernel
    uses; the 1-D and 3-D ones apply the formula at every size)."""
    positions = np.arange(out_size, dtype=np.int64)
    step = _scale_of(scale, in_size, out_size)
    if exact:  # (i + 0.5) is a double, times the float step, rounded to float by floorf
        source = np.floor(((positions + 0.5) * np.float64(step)).astype(np.float32))
    elif shortcuts and out_size == in_size:
        return positions
    elif shortcuts and out_size == 2 * in_size:
        return positions >> 1
    else:
        source = np.floor(positions.astype(np.float32) * step)
    return np.minimum(source.astype(np.int64), in_size - 1)


def _static_axis(x, rank: int, axis: int, indices: np.ndarray, in_size: int):
    """``x`` (of ``rank``) read at ``indices`` along ``axis`` in the cheapest exact form."""
    out_size = len(indices)
    if out_size == in_size and np.array_equal(indices, np.arange(in_size)):
        return x
    if out_size and out_size < in_size and in_size % out_size == 0:
        factor = in_size // out_size
        if np.array_equal(indices, np.arange(out_size) * factor):
            return op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[in_size]),
                            op.Constant(value_ints=[axis]), op.Constant(value_ints=[factor]))
    if out_size > in_size and out_size % in_size == 0:
        factor = out_size // in_size
        if np.array_equal(indices, np.arange(out_size) // factor):
            scales = np.ones(rank, np.float32)
            scales[axis] = factor
            return op.Resize(x, None, op.Constant(value=ir.tensor(scales)), mode="nearest",
                             coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    return op.Gather(x, op.Constant(value=ir.tensor(indices)), axis=axis)


def _dynamic_axis(x, axis: int, out_size, scale: float | None, exact: bool, shortcuts: bool):
    """``x`` read along ``axis`` at indices computed in the graph (a symbolic input or output size).
    ``out_size`` is an int or a 1-element int64 value; ``shortcuts`` as in :func:`source_indices`."""
    in_size = op.Shape(x, start=axis, end=axis + 1)
    out = op.Constant(value_ints=[out_size]) if isinstance(out_size, int) else out_size
    if scale is not None and scale > 0:
        step = op.Constant(value=ir.tensor(np.float32(1.0 / scale)))
    else:
        step = op.Div(op.Cast(in_size, to=ir.DataType.FLOAT), op.Cast(out, to=ir.DataType.FLOAT))
    positions = op.Range(op.Constant(value=ir.tensor(np.float32(0))), op.Cast(op.Squeeze(out), to=ir.DataType.FLOAT),
                         op.Constant(value=ir.tensor(np.float32(1))))
    if exact:
        positions = op.Add(positions, op.Constant(value=ir.tensor(np.float32(0.5))))
    source = op.Cast(op.Floor(op.Mul(positions, step)), to=ir.DataType.INT64)
    source = op.Min(source, op.Sub(in_size, op.Constant(value_ints=[1])))
    if shortcuts and not exact:
        counting = op.Range(op.Constant(value_int=0), op.Squeeze(out), op.Constant(value_int=1))
        two = op.Constant(value_ints=[2])
        source = op.Where(op.Equal(out, in_size), counting,
                          op.Where(op.Equal(out, op.Mul(in_size, two)), op.Div(counting, two), source))
    return op.Gather(x, source, axis=axis)


def _interpolate(x, output_size, scales, exact: bool):
    shape = list(x.shape)  # the values made below are not shaped: sizes come from the input's
    rank = len(shape)
    spatial = len(scales) if output_size is None else len(output_size)
    scales = list(scales) if scales is not None else [None] * spatial
    for d in range(spatial):
        axis = rank - spatial + d
        scale = scales[d]
        in_size = _static(shape[axis])
        if output_size is not None:
            out_size = output_size[d]
        elif in_size is not None:
            out_size = int(in_size * scale)  # ATen's compute_output_size: a double, truncated
        else:  # floor(in * scale) at run time
            out_size = op.Cast(op.Floor(op.Mul(op.Cast(op.Shape(x, start=axis, end=axis + 1), to=ir.DataType.DOUBLE),
                                               op.Constant(value=ir.tensor(np.array([scale], np.float64))))),
                               to=ir.DataType.INT64)
        if in_size is not None and isinstance(out_size, int):
            indices = source_indices(in_size, out_size, scale, exact, shortcuts=spatial == 2)
            x = _static_axis(x, rank, axis, indices, in_size)
        else:
            x = _dynamic_axis(x, axis, out_size, scale, exact, shortcuts=spatial == 2)
    return x


def upsample_nearest_vec(input, output_size=None, scale_factors=None):
    """``aten.upsample_nearest{1,2,3}d.vec``: PyTorch's source pixels (module docstring)."""
    return _interpolate(input, output_size, scale_factors, exact=False)


def upsample_nearest_exact_vec(input, output_size=None, scale_factors=None):
    """``aten._upsample_nearest_exact{1,2,3}d.vec``: PyTorch's source pixels, half-pixel centres."""
    return _interpolate(input, output_size, scale_factors, exact=True)


def upsample_nearest1d(input, output_size, scales=None):
    """``aten.upsample_nearest1d``: as :func:`upsample_nearest_vec`."""
    return _interpolate(input, output_size, [scales], exact=False)


def upsample_nearest2d(input, output_size, scales_h=None, scales_w=None):
    """``aten.upsample_nearest2d``: as :func:`upsample_nearest_vec`."""
    return _interpolate(input, output_size, [scales_h, scales_w], exact=False)


def upsample_nearest3d(input, output_size, scales_d=None, scales_h=None, scales_w=None):
    """``aten.upsample_nearest3d``: as :func:`upsample_nearest_vec`."""
    return _interpolate(input, output_size, [scales_d, scales_h, scales_w], exact=False)


def upsample_nearest_exact1d(input, output_size, scales=None):
    """``aten._upsample_nearest_exact1d``: as :func:`upsample_nearest_exact_vec`."""
    return _interpolate(input, output_size, [scales], exact=True)


def upsample_nearest_exact2d(input, output_size, scales_h=None, scales_w=None):
    """``aten._upsample_nearest_exact2d``: as :func:`upsample_nearest_exact_vec`."""
    return _interpolate(input, output_size, [scales_h, scales_w], exact=True)


def upsample_nearest_exact3d(input, output_size, scales_d=None, scales_h=None, scales_w=None):
    """``aten._upsample_nearest_exact3d``: as :func:`upsample_nearest_exact_vec`."""
    return _interpolate(input, output_size, [scales_d, scales_h, scales_w], exact=True)


def translations() -> dict:
    """This module's entries of the exporter's ``custom_translation_table``."""
    import torch

    aten = torch.ops.aten
    table = {}
    for n, plain, exact in ((1, upsample_nearest1d, upsample_nearest_exact1d),
                            (2, upsample_nearest2d, upsample_nearest_exact2d),
                            (3, upsample_nearest3d, upsample_nearest_exact3d)):
        table[getattr(aten, f"upsample_nearest{n}d").vec] = upsample_nearest_vec
        table[getattr(aten, f"upsample_nearest{n}d").default] = plain
        table[getattr(aten, f"_upsample_nearest_exact{n}d").vec] = upsample_nearest_exact_vec
        table[getattr(aten, f"_upsample_nearest_exact{n}d").default] = exact
    return table
