"""Gradient-table rows for rules/conv.py.

ORT has no float64 Conv/ConvTranspose/pool kernels, so these rows are checked in
float32: inputs stay in [-1, 1] and shapes small so finite differences stay accurate.
"""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401


def U(*shape, **kw):
    """A float input in [-1, 1]."""
    return I(*shape, low=-1.0, high=1.0, **kw)


def W(*shape, **kw):
    """A float input in [-100, 100] for max pooling: wide gaps between a window's largest values
    keep the finite-difference step (0.01 in float32) from switching the arg-max."""
    return I(*shape, low=-100.0, high=100.0, **kw)


ROWS: list[Case] = [
    # -- Conv -------------------------------------------------------------------------
    Case("Conv", [U(2, 3, 5, 6), U(4, 3, 3, 3), U(4)], opsets=(13, 23), id="Conv-2d-bias"),
    Case("Conv", [U("N", 2, 7, 6), U(3, 2, 3, 2)], attrs={"strides": [2, 2], "pads": [1, 0, 2, 1]},
         opsets=(13, 23), id="Conv-2d-strides-pads-symbolic"),
    Case("Conv", [U(2, 2, 9, 8), U(2, 2, 2, 3)], attrs={"dilations": [2, 3], "strides": [1, 2], "pads": [1, 1, 0, 2]},
         opsets=(13, 23), id="Conv-2d-dilations"),
    Case("Conv", [U(2, 4, 6, 5), U(6, 2, 3, 3), U(6)], attrs={"group": 2, "pads": [1, 1, 1, 1]},
         opsets=(13, 23), id="Conv-2d-groups"),
    # a depthwise conv with TensorFlow's uneven "same" pads: its weight gradient's Conv pads x itself
    Case("Conv", [U(2, 4, 7, 6), U(4, 1, 3, 3)], attrs={"group": 4, "pads": [0, 1, 1, 0], "strides": [2, 2]},
         opsets=(13, 23), id="Conv-depthwise-uneven-pads"),
    Case("Conv", [U("N", 2, 9), U(2, 1, 3)], attrs={"group": 2, "pads": [2, 1], "dilations": [2]},
         opsets=(13, 23), id="Conv-1d-depthwise-dilated-pads"),
    Case("Conv", [U("N", 3, 6, 5), U(3, 1, 3, 3)], attrs={"group": 3, "strides": [2, 1]},
         opsets=(13, 23), id="Conv-2d-depthwise"),
    Case("Conv", [U(2, 3, 7), U(2, 3, 3), U(2)], attrs={"strides": [2], "pads": [1, 2]},
         opsets=(13, 23), id="Conv-1d"),
    Case("Conv", [U(1, 2, 4, 5, 4), U(2, 2, 2, 3, 2)], attrs={"strides": [1, 2, 1], "pads": [1, 0, 0, 0, 1, 1]},
         opsets=(13, 23), id="Conv-3d"),
    Case("Conv", [U("N", 2, "H", "W"), U(3, 2, 3, 3)], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
         dims={"N": 2, "H": 7, "W": 6}, opsets=(13, 23), id="Conv-same-upper-symbolic-spatial"),
    Case("Conv", [U("N", 2, "H", "W"), U(2, 2, 3, 3)], attrs={"strides": [2, 2], "pads": [1, 0, 0, 1]},
         dims={"H": 6, "W": 7}, opsets=(13, 23), id="Conv-pads-symbolic-spatial"),
    Case("Conv", [U(2, 2, 6, 7), U(3, 2, 2, 4)], attrs={"auto_pad": "SAME_LOWER", "strides": [1, 2]},
         opsets=(13, 23), id="Conv-same-lower"),
    Case("Conv", [U(2, 2, 7, 6), U(3, 2, 3, 2)], attrs={"auto_pad": "VALID", "strides": [2, 3]},
         opsets=(13, 23), id="Conv-valid"),
    # stride 1: pads, dilations, one channel, 1-D to 3-D
    Case("Conv", [U(2, 3, 6, 5), U(4, 3, 3, 2)], attrs={"pads": [1, 0, 2, 1], "dilations": [2, 1]},
         opsets=(13, 23), id="Conv-2d-stride1-pads-dilations"),
    Case("Conv", [U("N", 2, 9), U(3, 2, 4)], attrs={"pads": [2, 1], "dilations": [2]}, opsets=(13, 23),
         id="Conv-1d-stride1-symbolic-batch"),
    Case("Conv", [U(1, 2, 4, 3, 5), U(2, 2, 2, 2, 3)], attrs={"pads": [1, 0, 1, 0, 1, 1]}, opsets=(13, 23),
         id="Conv-3d-stride1"),
    Case("Conv", [U(2, 1, 6, 6), U(3, 1, 3, 3)], attrs={"auto_pad": "SAME_UPPER"}, opsets=(13, 23),
         id="Conv-stride1-same-upper-one-channel"),
    # kernels of more than 25 taps take the correlation-as-Conv path instead of patches
    Case("Conv", [U(2, 2, 8, 7), U(2, 2, 6, 5)], attrs={"strides": [1, 2], "pads": [1, 0, 0, 1]},
         opsets=(13, 23), id="Conv-large-kernel"),
    Case("Conv", [U(2, 2, 5, 6), U(3, 2, 2, 2)], attrs={"strides": [2, 2]}, opsets=(13, 23),
         id="Conv-stride-skips-last-row"),
    # at least as many output channels as output positions: the weight gradient sums the batch
    # inside one product
    Case("Conv", [U("N", 3, 4, 4), U(8, 3, 3, 3), U(8)], attrs={"strides": [2, 2], "pads": [1, 1, 1, 1]},
         opsets=(13, 23), id="Conv-more-channels-than-positions-symbolic-batch"),
    Case("Conv", [U(3, 2, 5, 4), U(6, 2, 2, 3)], attrs={"dilations": [2, 1]}, opsets=(13, 23),
         id="Conv-more-channels-than-positions-dilated"),
]
ROWS += [
    # -- ConvTranspose ----------------------------------------------------------------
    Case("ConvTranspose", [U(2, 3, 4, 5), U(3, 2, 3, 3), U(2)], opsets=(13, 23), id="ConvTranspose-2d-bias"),
    Case("ConvTranspose", [U("N", 2, 3, 4), U(2, 3, 3, 2)],
         attrs={"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2]},
         opsets=(13, 23), id="ConvTranspose-strides-pads-output-padding-symbolic"),
    Case("ConvTranspose", [U(2, 4, 3, 4), U(4, 2, 2, 3), U(4)],
         attrs={"group": 2, "dilations": [2, 1], "strides": [1, 2]}, opsets=(13, 23),
         id="ConvTranspose-groups-dilations"),
    Case("ConvTranspose", [U(2, 3, 5), U(3, 1, 3)], attrs={"group": 3, "strides": [2], "pads": [1, 1]},
         opsets=(13, 23), id="ConvTranspose-1d-depthwise"),
    Case("ConvTranspose", [U("N", 2, "H", 4), U(2, 2, 3, 3)], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
         dims={"H": 3}, opsets=(13, 23), id="ConvTranspose-same-upper-symbolic-spatial"),
    Case("ConvTranspose", [U(1, 2, 3, 4), U(2, 2, 2, 3)], attrs={"auto_pad": "SAME_LOWER", "strides": [2, 2]},
         opsets=(13, 23), id="ConvTranspose-same-lower"),
    Case("ConvTranspose", [U(1, 2, 3, 3), U(2, 1, 3, 3)], attrs={"output_shape": [6, 5], "strides": [2, 2]},
         opsets=(13, 23), id="ConvTranspose-output-shape"),
]
ROWS += [
    # -- pooling ----------------------------------------------------------------------
    # MaxPool: opsets 13-15 scatter residue classes, 16+ scatter-add; overlapping windows
    # (stride < kernel) make several outputs pick the same input.
    Case("MaxPool", [W("N", 2, 5, 6)], attrs={"kernel_shape": [3, 3], "strides": [1, 2], "pads": [1, 1, 1, 0]},
         opsets=(13, 23), id="MaxPool-2d-overlap-pads-symbolic"),
    # windows that tile the input (strides == kernel, no pads): the ArgMax-by-window rule,
    # rows and columns past the last whole window get zeros (tests/autodiff/test_max_pool.py: ties)
    Case("MaxPool", [W(2, 2, 4, 6)], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, opsets=(13, 23),
         id="MaxPool-2d-disjoint"),
    Case("MaxPool", [W("N", "C", "H", "W")], attrs={"kernel_shape": [2, 2], "strides": [2, 2]},
         dims={"N": 2, "C": 3, "H": 7, "W": 9}, opsets=(13, 23), id="MaxPool-2d-tiling-7x9-symbolic"),
    Case("MaxPool", [W(2, 3, 11)], attrs={"kernel_shape": [3], "strides": [3], "auto_pad": "VALID"},
         opsets=(13, 23), id="MaxPool-1d-tiling-valid"),
    Case("MaxPool", [W(2, 2, 5, 4, 7)], attrs={"kernel_shape": [2, 2, 3], "strides": [2, 2, 3]},
         opsets=(13, 23), id="MaxPool-3d-tiling"),
    Case("MaxPool", [W(2, 3, 7, 6)], attrs={"kernel_shape": [2, 3], "strides": [2, 1], "dilations": [2, 1],
                                            "ceil_mode": 1, "pads": [0, 1, 1, 1]},
         opsets=(13, 23), id="MaxPool-2d-dilations-ceil"),
    Case("MaxPool", [W(2, 3, 8)], attrs={"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_UPPER"},
         opsets=(13, 23), id="MaxPool-1d-same-upper"),
    Case("MaxPool", [W(1, 2, 4, 3, 4)], attrs={"kernel_shape": [2, 2, 2], "strides": [1, 1, 2], "storage_order": 1},
         outputs=1, opsets=(13, 23), id="MaxPool-3d-storage-order"),
    Case("AveragePool", [U("N", 2, 5, 6)], attrs={"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]},
         opsets=(13, 23), id="AveragePool-2d-pads-exclude-symbolic"),
    Case("AveragePool", [U(2, 2, 5, 6)], attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                                "count_include_pad": 1, "ceil_mode": 1},
         opsets=(13, 23), id="AveragePool-2d-include-pad-ceil"),
    Case("LpPool", [U("N", 2, 5, 6, away_from=(0.0,))], attrs={"kernel_shape": [2, 3], "strides": [2, 1],
         "pads": [1, 0, 0, 1]}, opsets=(13, 23), id="LpPool-2d-p2-pads"),
    Case("LpPool", [U(2, 2, 7, away_from=(0.0,))], attrs={"kernel_shape": [3], "strides": [2], "p": 3},
         opsets=(13, 23), id="LpPool-1d-p3"),
    Case("LpPool", [U(1, 2, 5, 5, away_from=(0.0,))], attrs={"kernel_shape": [2, 2], "p": 1, "dilations": [2, 1],
         "ceil_mode": 1, "strides": [2, 2]}, opsets=(18, 23), id="LpPool-2d-p1-dilations-ceil"),
    # onnxruntime 1.32 has no GlobalLpPool kernel past opset 21
    Case("GlobalLpPool", [U("N", 3, 4, 2)], opsets=(13, 21), id="GlobalLpPool-p2"),
    Case("GlobalLpPool", [U(2, 3, 5, away_from=(0.0,))], attrs={"p": 3}, opsets=(13, 21), id="GlobalLpPool-p3"),
    # -- Col2Im (F.fold) ---------------------------------------------------------------
    Case("Col2Im", [U("N", 2 * 4, 6), C(np.array([3, 4], np.int64)), C(np.array([2, 2], np.int64))],
         opsets=(18, 23), id="Col2Im-2d"),
    Case("Col2Im", [U(2, 3 * 6, 6), C(np.array([5, 4], np.int64)), C(np.array([3, 2], np.int64))],
         attrs={"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 1, 0]}, opsets=(18, 23),
         id="Col2Im-2d-strides-dilations-pads"),
    Case("Col2Im", [U(1, 2 * 3, 4), C(np.array([7], np.int64)), C(np.array([3], np.int64))],
         attrs={"strides": [2], "pads": [1, 1]}, opsets=(18, 23), id="Col2Im-1d"),
    Case("AveragePool", [U(2, 2, 6, 6)], attrs={"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 0, 0, 0],
                                                "ceil_mode": 1},
         opsets=(13, 23), id="AveragePool-2d-exclude-pad-ceil"),
    Case("AveragePool", [U("N", 2, "H", "W")], attrs={"kernel_shape": [3, 2], "strides": [2, 2],
                                                    "auto_pad": "SAME_UPPER", "count_include_pad": 1},
         dims={"H": 7, "W": 6}, opsets=(13, 23), id="AveragePool-same-upper-symbolic-spatial"),
    Case("AveragePool", [U(2, 3, 8)], attrs={"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_LOWER"},
         opsets=(13, 23), id="AveragePool-1d-same-lower"),
    Case("AveragePool", [U(2, 2, 8, 7)], attrs={"kernel_shape": [2, 2], "dilations": [2, 3], "pads": [1, 1, 0, 1],
                                                "count_include_pad": 1},
         opsets=(19, 23), id="AveragePool-2d-dilations"),
    Case("AveragePool", [U(1, 2, 4, 3, 5)], attrs={"kernel_shape": [2, 2, 3], "strides": [2, 1, 2]},
         opsets=(13, 23), id="AveragePool-3d"),
    Case("GlobalAveragePool", [U("N", 3, 4, 5)], opsets=(13, 23), id="GlobalAveragePool-symbolic"),
    Case("GlobalAveragePool", [U(2, 3, 6)], opsets=(13, 23), id="GlobalAveragePool-1d"),
    Case("GlobalMaxPool", [W("N", 2, 2, 2)], opsets=(13, 23), id="GlobalMaxPool-symbolic"),
]
