"""Gradient-table rows for rules/sampling.py (Resize).

Checked in float32 (onnxruntime's CPU Resize has no float64 kernel): inputs stay in [-1, 1].
Scales, sizes and roi are constants, as exporters emit them; the rule itself reads them at
run time, so a dynamic size works the same way (tests/test_torch_layer_zoo.py, ``align_corners``).
"""

from __future__ import annotations

import numpy as np

from tests.autodiff.grad_table import C, Case, I

_F32 = "float32"


def U(*shape, **kw):
    """A float input in [-1, 1]."""
    return I(*shape, low=-1.0, high=1.0, **kw)


def S(*scales):
    return C(np.array(scales, np.float32))


def Z(*sizes):
    return C(np.array(sizes, np.int64))


def _row(inputs, id, opsets=(13, 23), **attrs):
    return Case("Resize", inputs, attrs=attrs, opsets=opsets, id=f"Resize-{id}", precision=_F32)


ROWS: list[Case] = [
    # nearest: each output copies one input; the gradient sums the copies (all rounding modes)
    _row([U("N", 2, 3, 4), None, S(1, 1, 2, 2)], "nearest-x2-symbolic", mode="nearest"),
    _row([U(1, 2, 5, 4), None, S(1, 1, 1.5, 0.6)], "nearest-fractional-floor", mode="nearest",
         nearest_mode="floor", coordinate_transformation_mode="asymmetric"),
    _row([U(1, 2, 5, 4), None, S(1, 1, 1.7, 2.3)], "nearest-ceil-half-pixel", mode="nearest", nearest_mode="ceil"),
    _row([U(1, 1, 4, 6), None, None, Z(1, 1, 7, 3)], "nearest-sizes-prefer-ceil", mode="nearest",
         nearest_mode="round_prefer_ceil", coordinate_transformation_mode="align_corners"),
    # whole factors where nearest copies blocks (the gradient sums them, no matrix)
    _row([U("N", 2, 3, 4), None, S(1, 1, 3, 2)], "nearest-blocks-asymmetric-floor", mode="nearest",
         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    _row([U(1, 2, 3, 2), None, None, Z(1, 2, 6, 8)], "nearest-blocks-sizes-pytorch-half-pixel", mode="nearest",
         coordinate_transformation_mode="pytorch_half_pixel", nearest_mode="round_prefer_ceil"),
    _row([U(1, 2, 3, 4), None, S(1, 1, 2, 3)], "nearest-whole-factor-not-blocks", mode="nearest",
         coordinate_transformation_mode="asymmetric", nearest_mode="round_prefer_ceil"),
    # linear (bilinear on 4-D, trilinear on 5-D) under every coordinate transformation
    _row([U(2, 2, 3, 4), None, S(1, 1, 2, 2)], "linear-half-pixel", mode="linear"),
    _row([U(1, 2, 3, 4), None, None, Z(1, 2, 5, 7)], "linear-align-corners-sizes", mode="linear",
         coordinate_transformation_mode="align_corners"),
    # align_corners with a fractional scale: the output length is floor(n * scale), which
    # onnxruntime divides by and onnx's reference evaluator (the constant folder) does not
    _row([U(1, 2, 4, 5), None, S(1, 1, 1.7, 1.7)], "linear-align-corners-fractional-scale", mode="linear",
         coordinate_transformation_mode="align_corners"),
    _row([U(1, 1, 4, 5), None, S(1, 1, 1.7, 2.3)], "cubic-align-corners-fractional-scale", mode="cubic",
         coordinate_transformation_mode="align_corners"),
    _row([U(1, 2, 6, 5), None, S(1, 1, 0.5, 0.7)], "linear-downsample-pytorch-half-pixel", mode="linear",
         coordinate_transformation_mode="pytorch_half_pixel"),
    _row([U(1, 2, 3, 4), None, S(1, 1, 1.6, 1.3)], "linear-asymmetric", mode="linear",
         coordinate_transformation_mode="asymmetric"),
    _row([U(1, 1, 3, 3, 4), None, S(1, 1, 2, 1.5, 0.5)], "linear-3d", mode="linear"),
    _row([U(1, 2, 4, 4), C(np.array([0, 0, 0.2, 0.1, 1, 1, 0.8, 0.7], np.float32)), None, Z(1, 2, 3, 5)],
         "linear-tf-crop-and-resize", mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
         extrapolation_value=0.5),
    # cubic, with and without the outside taps, another coefficient
    _row([U(1, 2, 4, 5), None, S(1, 1, 1.5, 2)], "cubic", mode="cubic"),
    _row([U(1, 1, 5, 4), None, S(1, 1, 0.6, 1.75)], "cubic-exclude-outside", mode="cubic", exclude_outside=1,
         cubic_coeff_a=-0.5),
    # opset 18: antialiased downsampling, resizing only some axes, half_pixel_symmetric (19)
    _row([U(1, 2, 8, 6), None, S(1, 1, 0.5, 0.6)], "linear-antialias", opsets=(18, 23), mode="linear",
         antialias=1),
    _row([U(1, 2, 7, 6), None, S(1, 1, 0.4, 0.7)], "cubic-antialias", opsets=(18, 23), mode="cubic", antialias=1),
    _row([U("N", 3, 4, 5), None, S(2, 0.8)], "axes", opsets=(18, 23), mode="linear", axes=[-2, -1]),
    _row([U(1, 2, 3, 5), None, None, Z(6, 4)], "axes-sizes-nearest", opsets=(18, 23), mode="nearest", axes=[2, 3]),
    _row([U(1, 2, 5, 4), None, S(1, 1, 1.5, 0.5)], "half-pixel-symmetric", opsets=(19, 23), mode="linear",
         coordinate_transformation_mode="half_pixel_symmetric"),
]

# GridSample: a grid with points outside the image exercises every padding mode's taps; the mode
# attribute is left at its default (bilinear, called linear from opset 20). Rows differentiating the
# grid start at opset 20: onnxruntime has no float64 GridSample kernel before, and float32 finite
# differences step over the kinks at whole pixel positions. Opset 16 rows differentiate X only.
_GRID = np.array([[[[-1.25, 0.3], [0.9, -1.3], [0.2, 0.45]], [[1.3, 1.1], [-0.6, -0.95], [0.05, 1.2]]],
                  [[[0.7, -0.2], [-1.1, 1.25], [0.33, -0.71]], [[-0.4, 0.8], [1.05, 0.0], [-0.9, -1.15]]]],
                 np.float32)


def _grid_row(inputs, id, opsets=(20, 23), **attrs):
    return Case("GridSample", inputs, attrs=attrs, opsets=opsets, id=f"GridSample-{id}")


ROWS += [
    _grid_row([I(2, 2, 3, 4), I(2, 2, 3, 2, low=-1.3, high=1.3)], "zeros"),
    _grid_row([I("N", 3, 4, 3), I("N", 3, 2, 2, low=-1.3, high=1.3)], "zeros-align-corners-symbolic",
              align_corners=1),
    _grid_row([I(2, 2, 3, 4), I(2, 2, 3, 2, low=-1.3, high=1.3)], "border", padding_mode="border"),
    _grid_row([I(2, 1, 4, 3), I(2, 3, 2, 2, low=-2.5, high=2.5)], "reflection", padding_mode="reflection"),
    _grid_row([I(2, 1, 3, 4), I(2, 2, 3, 2, low=-2.5, high=2.5)], "reflection-align-corners",
              padding_mode="reflection", align_corners=1),
    # an axis of length 1 with aligned corners: every reflected tap reads its one pixel
    _grid_row([I(1, 1, 4, 1), I(1, 2, 3, 2, low=-1.3, high=1.3)], "reflection-align-corners-width-1",
              padding_mode="reflection", align_corners=1),
    _grid_row([I(1, 1, 1, 1), C(_GRID[:1])], "reflection-align-corners-single-pixel", opsets=(16, 23),
              padding_mode="reflection", align_corners=1),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "x-only-zeros", opsets=(16, 23)),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "x-only-reflection", opsets=(16, 23), padding_mode="reflection"),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "nearest-zeros", opsets=(16, 23), mode="nearest"),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "nearest-reflection-align-corners", opsets=(16, 23), mode="nearest",
              padding_mode="reflection", align_corners=1),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "nearest-border", mode="nearest", padding_mode="border"),
    # bicubic (4 x 4 taps, Keys' coefficient -0.75); called "bicubic" before opset 20, "cubic" from it
    _grid_row([I(2, 2, 4, 5), I(2, 2, 3, 2, low=-1.3, high=1.3)], "cubic", mode="cubic"),
    _grid_row([I(1, 2, 4, 5), I(1, 3, 2, 2, low=-2.5, high=2.5)], "cubic-reflection-align-corners",
              mode="cubic", padding_mode="reflection", align_corners=1),
    _grid_row([I(1, 1, 5, 4), I(1, 2, 2, 2, low=-1.3, high=1.3)], "cubic-border", mode="cubic",
              padding_mode="border"),
    _grid_row([I(2, 2, 3, 4), C(_GRID)], "bicubic-x-only", opsets=(16, 19), mode="bicubic"),
    _grid_row([I(1, 2, 2, 3, 2), I(1, 2, 2, 1, 3, low=-1.2, high=1.2)], "3d"),
    _grid_row([I(1, 1, 3, 2, 3), I(1, 2, 1, 2, 3, low=-1.2, high=1.2)], "3d-border-align-corners",
              padding_mode="border", align_corners=1),
]
