"""Antialiased bilinear and bicubic interpolation with PyTorch's weights.

``F.interpolate(mode="bilinear" | "bicubic", antialias=True)`` exports (torchlib) as an ONNX
``Resize(antialias=1)`` without the scale factors, and onnxruntime's antialias filter maps
coordinates otherwise than PyTorch's: with ``align_corners=True`` every size came out wrong
(0.6-0.9 off), and a scale factor that does not divide the size (0.4 on 8x10) 0.07 off.

PyTorch's antialiased kernels are separable: one set of weights per output row, another per
output column. These translations compute both matrices with PyTorch's own kernel at export time
(an identity along one axis, interpolated, is that axis' weights), and the output is two matrix
products, ``A_h @ x @ A_w^T``: PyTorch's numbers, and a gradient (two products) that onnxtrain's
MatMul rule already has. The sizes must be static; otherwise the export refuses
(NotImplementedError) and ORTModule runs the module in PyTorch.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op


def _static(dim) -> int:
    if not isinstance(dim, int):
        raise NotImplementedError("antialiased interpolation of a size known only at run time")
    return dim


def _axis_weights(kernel, in_size: int, out_size: int, align_corners: bool, scale, axis: int, dtype):
    """``[out_size, in_size]``: row i holds the weights PyTorch's ``kernel`` gives the inputs of
    output i along ``axis`` (0: height, 1: width)."""
    import torch

    # one image per input position (a batch of in_size), two wide across the other axis: the
    # kernel takes another path for an axis of length 1, whose weights are not the general ones
    basis = torch.eye(in_size, dtype=dtype)
    if axis == 0:
        images = basis.reshape(in_size, 1, in_size, 1).expand(in_size, 1, in_size, 2).contiguous()
        return kernel(images, [out_size, 2], align_corners, scale, None)[:, 0, :, 0].T.contiguous()
    images = basis.reshape(in_size, 1, 1, in_size).expand(in_size, 1, 2, in_size).contiguous()
    return kernel(images, [2, out_size], align_corners, None, scale)[:, 0, 0, :].T.contiguous()


def _interpolate(kernel, input, output_size, align_corners: bool, scales):
    import torch

    shape = list(input.shape)
    in_h, in_w = _static(shape[-2]), _static(shape[-1])
    scales = list(scales) if scales is not None else [None, None]
    if output_size is None:  # ATen's compute_output_size: a double product, truncated
        output_size = [int(in_h * scales[0]), int(in_w * scales[1])]
    out_h, out_w = (_static(d) for d in output_size)
    element_type = input.dtype if input.dtype is not None else ir.DataType.FLOAT
    dtype = {ir.DataType.DOUBLE: torch.float64}.get(element_type, torch.float32)
    rows = _axis_weights(kernel, in_h, out_h, align_corners, scales[0], 0, dtype)
    columns = _axis_weights(kernel, in_w, out_w, align_corners, scales[1], 1, dtype)
    rows = op.CastLike(op.Constant(value=ir.tensor(rows.numpy())), input)
    columns_t = op.CastLike(op.Constant(value=ir.tensor(columns.T.contiguous().numpy())), input)
    return op.MatMul(rows, op.MatMul(input, columns_t))


def bilinear2d_aa(self, output_size, align_corners: bool, scales_h=None, scales_w=None):
    """``aten._upsample_bilinear2d_aa``: PyTorch's weights (module docstring)."""
    import torch
    return _interpolate(torch.ops.aten._upsample_bilinear2d_aa.default, self, output_size, align_corners,
                        [scales_h, scales_w])


def bilinear2d_aa_vec(input, output_size, align_corners: bool, scale_factors=None):
    """``aten._upsample_bilinear2d_aa.vec``: :func:`bilinear2d_aa`."""
    import torch
    return _interpolate(torch.ops.aten._upsample_bilinear2d_aa.default, input, output_size, align_corners,
                        scale_factors)


def bicubic2d_aa(self, output_size, align_corners: bool, scales_h=None, scales_w=None):
    """``aten._upsample_bicubic2d_aa``: PyTorch's weights (module docstring)."""
    import torch
    return _interpolate(torch.ops.aten._upsample_bicubic2d_aa.default, self, output_size, align_corners,
                        [scales_h, scales_w])


def bicubic2d_aa_vec(input, output_size, align_corners: bool, scale_factors=None):
    """``aten._upsample_bicubic2d_aa.vec``: :func:`bicubic2d_aa`."""
    import torch
    return _interpolate(torch.ops.aten._upsample_bicubic2d_aa.default, input, output_size, align_corners,
                        scale_factors)


def translations() -> dict:
    """This module's entries of the exporter's ``custom_translation_table``."""
    import torch

    aten = torch.ops.aten
    return {
        aten._upsample_bilinear2d_aa.default: bilinear2d_aa,
        aten._upsample_bilinear2d_aa.vec: bilinear2d_aa_vec,
        aten._upsample_bicubic2d_aa.default: bicubic2d_aa,
        aten._upsample_bicubic2d_aa.vec: bicubic2d_aa_vec,
    }
