"""Gradient-table rows for rules/index.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

_MAX = np.iinfo(np.int64).max
_MIN = np.iinfo(np.int64).min

ROWS: list[Case] = [
    # -- Slice ------------------------------------------------------------------------------
    Case("Slice", [I("N", 5), C([1], np.int64), C([_MAX], np.int64), C([-1], np.int64)],
         id="Slice-to-end-negative-axis"),
    Case("Slice", [I("N", 6), C([-2, 0], np.int64), C([_MAX, -1], np.int64)],
         id="Slice-negative-starts-no-axes"),
    Case("Slice", [I(4, "N"), C([1, 10], np.int64), C([3, 20], np.int64), C([0, 1], np.int64),
                   C([1, 1], np.int64)], id="Slice-empty-unit-steps"),
    Case("Slice", [I("N", 7), C([-1], np.int64), C([_MIN], np.int64), C([1], np.int64), C([-2], np.int64)],
         id="Slice-negative-step-reverse"),
    Case("Slice", [I(5, "N", 4), C([4, 1], np.int64), C([0, _MAX], np.int64), C([0, -1], np.int64),
                   C([-1, 2], np.int64)], id="Slice-mixed-steps"),
    Case("Slice", [I(3, 8), C([1, 0], np.int32), C([3, 8], np.int32), C([1, 0], np.int32), C([1, 3], np.int32)],
         id="Slice-int32-strided"),
    # starts / steps computed at run time (graph inputs, not constants): -2.x samples to -2
    Case("Slice", [I("N", 6), I(1, low=-2.9, high=-2.1, dtype="int64", grad=False), C([_MAX], np.int64),
                   C([1], np.int64)], id="Slice-dynamic-starts"),
    Case("Slice", [I("N", 6), C([-1], np.int64), C([_MIN], np.int64), C([1], np.int64),
                   I(1, low=-2.9, high=-2.1, dtype="int64", grad=False)], id="Slice-dynamic-steps"),
    # -- Gather and friends (13-15: one-hot sums, 16+: ScatterND add) ---------------------------
    Case("Gather", [I("N", 3), C([0, 2, 0, -1], np.int64)], attrs={"axis": 1}, opsets=(13, 15),
         id="Gather-repeated-onehot"),
    Case("Gather", [I("N", 3), C([0, 2, 0, -1], np.int64)], attrs={"axis": 1}, opsets=(16, 23),
         id="Gather-repeated-scatter"),
    Case("Gather", [I(5, 4), C([[1, 1], [4, -5]], np.int64)], attrs={"axis": 0}, opsets=(13, 23),
         id="Gather-embedding-2d-indices"),
    Case("Gather", [I(2, "N", 4, 3), C([3, -1, 3], np.int32)], attrs={"axis": -2}, opsets=(13, 23),
         id="Gather-negative-axis-int32"),
    Case("Gather", [I(3, "N"), C(np.array(-1, np.int64))], attrs={"axis": 0}, opsets=(13, 23),
         id="Gather-scalar-index"),
    # constant runs a, a+1, ...: dy padded back (x[:, 0], im2col over a kernel of width 1)
    Case("Gather", [I("N", 5, 3), C(np.array(0, np.int64))], attrs={"axis": 1}, opsets=(13, 23),
         id="Gather-run-scalar-index"),
    Case("Gather", [I(2, "N", 6), C([[2, 3], [4, 5]], np.int64)], attrs={"axis": -1}, opsets=(13, 23),
         id="Gather-run-2d-indices"),
    Case("Gather", [I(4, 3, 1), C([[0]], np.int64)], attrs={"axis": 2}, opsets=(13, 23), id="Gather-run-unit-axis"),
    Case("Gather", [I(5, 4), C([-2, -1], np.int64)], attrs={"axis": 0}, opsets=(13, 23), id="Gather-run-negative"),
    # constant rows: sorted when the graph is built; each once, a plain scatter
    Case("Gather", [I("N", 3), C([[2, 0], [2, 1]], np.int64)], attrs={"axis": 0}, opsets=(13, 23),
         id="Gather-constant-repeated-rows"),
    Case("Gather", [I(5, 4), C([3, 0, -1], np.int64)], attrs={"axis": 0}, opsets=(13, 23), id="Gather-constant-rows-once"),
    # a few repeats (as_strided's overlapping windows): a table of each row's sources, summed;
    # one row repeated often: sorted when the graph is built, prefix sums
    Case("Gather", [I(7, 2), C([[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, -1]], np.int64)], attrs={"axis": 0},
         opsets=(13, 23), id="Gather-constant-windows"),
    Case("Gather", [I("N", 3), C([1, 1, 1, 1, 1, 0, 2, 1], np.int64)], attrs={"axis": 0}, opsets=(13, 23),
         id="Gather-constant-row-repeated-often"),
    # windows over a 1-D tensor's elements (as_strided of a flattened tensor): GatherElements
    Case("Gather", [I(10), C(np.add([[0], [2], [4], [6]], np.arange(4)), np.int64)], attrs={"axis": 0},
         opsets=(13, 23), id="Gather-constant-element-windows"),
    Case("Gather", [I("N"), C(np.add([[0], [2]], np.arange(4)), np.int64)], attrs={"axis": 0},
         opsets=(13, 23), dims={"N": 8}, id="Gather-constant-element-windows-dynamic"),
    # every row of a static table once: the rows reordered, no scatter
    Case("Gather", [I(4, 3), C([2, 0, -1, 1], np.int64)], attrs={"axis": 0}, opsets=(13, 23),
         id="Gather-constant-permutation"),
    Case("GatherElements", [I(3, "N"), C([[0, 2, 0], [1, 1, -1]], np.int64)], attrs={"axis": 1}, opsets=(13, 15),
         id="GatherElements-onehot"),
    Case("GatherElements", [I(3, "N"), C([[0, 2, 0], [1, 1, -1]], np.int64)], attrs={"axis": 1}, opsets=(16, 23),
         id="GatherElements-scatter"),
    Case("GatherElements", [I(3, 2, 4), C(np.array([[[2], [0]], [[2], [-1]]], np.int64))], attrs={"axis": -3},
         opsets=(13, 23), id="GatherElements-negative-axis-smaller"),
    Case("TopK", [I("N", 5), C([2], np.int64)], outputs=2, opsets=(13, 23), id="TopK-last-axis"),
    Case("TopK", [I(4, 3, 2), C([3], np.int64)], attrs={"axis": 0, "largest": 0, "sorted": 0}, outputs=2,
         opsets=(13, 23), id="TopK-smallest-axis0"),
    Case("GatherND", [I(3, 4, "N"), C([[0, 1], [2, -1], [0, 1]], np.int64)], id="GatherND-repeated"),
    Case("GatherND", [I(3, 4, 2), C([[[1], [0]], [[-1], [1]]], np.int64)], id="GatherND-depth1"),
    Case("GatherND", [I(2, 3, 4), C([[[1, 0], [1, 0]], [[2, 3], [0, -1]]], np.int64)], attrs={"batch_dims": 1},
         id="GatherND-batch-dims"),
    Case("Compress", [I("N", 4), C([True, False, True], np.bool_)], attrs={"axis": 1}, id="Compress-axis"),
    Case("Compress", [I(2, 3), C([False, True, True, False, True], np.bool_)], id="Compress-flat"),
    # -- scatters -------------------------------------------------------------------------------
    Case("ScatterND", [I(4, "N"), C([[1], [-1]], np.int64), I(2, "N")], id="ScatterND-rows"),
    Case("ScatterND", [I(3, 4), C([[0, 1], [2, 2], [1, 0]], np.int64), I(3)], id="ScatterND-elements"),
    Case("ScatterND", [I(3, 4), C([[0, 1], [0, 1]], np.int64), I(2)], attrs={"reduction": "add"},
         opsets=(16, 23), id="ScatterND-add-repeated"),
    Case("ScatterElements", [I(3, "N"), C([[0, 2], [1, -1]], np.int64), I(2, 2)], attrs={"axis": 1},
         id="ScatterElements-axis1"),
    Case("ScatterElements", [I(3, 4), C([[2, 0, 1, 0]], np.int64), I(1, 4)], attrs={"axis": -2},
         id="ScatterElements-negative-axis"),
    Case("ScatterElements", [I(3, 4), C([[0, 0], [1, 1]], np.int64), I(2, 2)],
         attrs={"axis": 1, "reduction": "add"}, opsets=(16, 23), id="ScatterElements-add-repeated"),
    # max/min (opset 18): data and updates compete per position; values are distinct (no ties)
    Case("ScatterElements", [I(3, 4), C([[0, 0, 3], [1, 1, 1], [2, 0, 2]], np.int64), I(3, 3)],
         attrs={"axis": 1, "reduction": "max"}, opsets=(18, 23), id="ScatterElements-max-repeated"),
    Case("ScatterElements", [I(4, "N"), C([[3], [0], [3]], np.int64), I(3, 1)],
         attrs={"axis": 0, "reduction": "min"}, opsets=(18, 23), id="ScatterElements-min"),
    Case("ScatterND", [I(4, 2), C([[1], [1], [3]], np.int64), I(3, 2)], attrs={"reduction": "max"},
         opsets=(18, 23), id="ScatterND-max-rows"),
    # mul (opset 16): each factor's gradient is the product of the others at its position
    Case("ScatterElements", [I(3, 4), C([[0, 0, 3], [1, 1, 1], [2, 0, 2]], np.int64), I(3, 3)],
         attrs={"axis": 1, "reduction": "mul"}, opsets=(16, 23), id="ScatterElements-mul-repeated"),
    Case("ScatterND", [I(4, 2), C([[1], [1], [3]], np.int64), I(3, 2)], attrs={"reduction": "mul"},
         opsets=(16, 23), id="ScatterND-mul-rows"),
    # -- writes of values at indices ---------------------------------------------------------
    Case("OneHot", [C([[0, 2], [-1, 5]], np.int64), C(np.array(3, np.int64)), I(2)], opsets=(13, 28), precision="float32",
         id="OneHot-values"),
    Case("OneHot", [C([1, 0, 1], np.int32), C(np.array([4], np.int32)), I(2)], attrs={"axis": 0}, precision="float32",
         opsets=(13, 28), id="OneHot-values-axis0"),
    Case("MaxUnpool", [I(2, 1, 2, 2), C([[[[0, 3], [9, 14]]], [[[16, 19], [26, 31]]]], np.int64)],
         attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, opsets=(13, 28), id="MaxUnpool"),
    Case("MaxUnpool", [I(1, 2, 3), C([[[1, 2, 6], [8, 9, 11]]], np.int64), C([1, 2, 7], np.int64)],
         attrs={"kernel_shape": [2], "strides": [2]}, opsets=(13, 28), id="MaxUnpool-output-shape"),
    Case("TensorScatter", [I(2, 3, 6, 4), I(2, 3, 2, 4), C([1, 4], np.int64)], opsets=(24, 28),
         id="TensorScatter-write-indices"),
    Case("TensorScatter", [I(2, 3, 5), I(2, 3, 3), C([3, 0], np.int64)], attrs={"mode": "circular", "axis": -1},
         opsets=(24, 28), id="TensorScatter-circular"),
    Case("TensorScatter", [I(2, 4, 3), I(2, 2, 3)], attrs={"axis": 1}, opsets=(24, 28), id="TensorScatter-prefill"),
]
