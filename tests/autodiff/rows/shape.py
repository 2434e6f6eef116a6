"""Gradient-table rows for rules/shape.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

ROWS: list[Case] = [
    # -- reshape-like ---------------------------------------------------------------
    Case("Reshape", [I("N", 3, 4), C([0, -1], np.int64)], opsets=(11, 23), id="Reshape-copy-dim"),
    Case("Reshape", [I(2, 3, 4), C([4, 6], np.int64)], attrs={"allowzero": 1}, opsets=(14, 23),
         id="Reshape-allowzero"),
    Case("Flatten", [I("N", 2, 3, 2)], attrs={"axis": 2}, opsets=(11, 23), id="Flatten-axis"),
    Case("Flatten", [I(2, 3, 4)], attrs={"axis": -1}, opsets=(11, 23), id="Flatten-negative-axis"),
    Case("Squeeze", [I("N", 1, 3)], attrs={"axes": [-2]}, opsets=(11, 12), id="Squeeze-axes-attr"),
    Case("Squeeze", [I("N", 1, 3, 1), C([1, -1], np.int64)], opsets=(13, 23), id="Squeeze-axes-input"),
    Case("Squeeze", [I(1, 3, 1)], opsets=(11, 23), id="Squeeze-no-axes"),
    Case("Unsqueeze", [I("N", 3)], attrs={"axes": [0, -1]}, opsets=(11, 12), id="Unsqueeze-axes-attr"),
    Case("Unsqueeze", [I("N", 3), C([1, -1], np.int64)], opsets=(13, 23), id="Unsqueeze-axes-input"),
    Case("Transpose", [I("N", 3, 4)], opsets=(11, 23), id="Transpose-default-perm"),
    Case("Transpose", [I(2, "N", 3, 4)], attrs={"perm": [2, 0, 3, 1]}, opsets=(11, 23), id="Transpose-perm"),
    # -- broadcast, concat, split, tile ----------------------------------------------------
    Case("Expand", [I(3, 1), C([2, 3, 4], np.int64)], id="Expand-rank-up"),
    Case("Expand", [I("N", 1, 4), C([1, 3, 1], np.int64)], id="Expand-symbolic"),
    Case("Concat", [I("N", 2), I("N", 3), I("N", 1)], attrs={"axis": -1}, opsets=(11, 23),
         id="Concat-negative-axis"),
    Case("Concat", [I("N", 3), I("M", 3)], attrs={"axis": 0}, dims={"N": 2, "M": 4}, opsets=(11, 23),
         id="Concat-symbolic-axis"),
    Case("Concat", [I(2, 3), I(2, 3, grad=False)], attrs={"axis": 0}, opsets=(11, 23), id="Concat-one-needs"),
    Case("Split", [I("N", 5)], attrs={"axis": -1, "split": [2, 3]}, outputs=2, opsets=(11, 12),
         id="Split-attr"),
    Case("Split", [I("N", 6)], attrs={"axis": 1}, outputs=3, opsets=(11, 17), id="Split-equal"),
    Case("Split", [I(5, "N"), C([1, 4], np.int64)], attrs={"axis": 0}, outputs=2, opsets=(13, 17),
         id="Split-input"),
    Case("Split", [I("N", 5)], attrs={"axis": -1, "num_outputs": 2}, outputs=2, opsets=(18, 23),
         id="Split-num-outputs-uneven"),
    Case("Tile", [I("N", 3), C([2, 1], np.int64)], id="Tile-symbolic"),
    Case("Tile", [I(2, 1, 3), C([1, 4, 2], np.int64)], id="Tile-3d"),
    # -- pad ------------------------------------------------------------------------------
    Case("Pad", [I("N", 3), C([0, 2, 1, 0], np.int64)], opsets=(11, 23), id="Pad-constant"),
    Case("Pad", [I(3, 4), C([1, -1, -2, 2], np.int64), I()], opsets=(11, 23),
         id="Pad-constant-negative-and-value"),
    Case("Pad", [I("N", 3, 4), C([1, 2, 0, 1], np.int64), None, C([-1, 1], np.int64)], opsets=(18, 23),
         id="Pad-constant-axes"),
    Case("Pad", [I("N", 4), C([1, 2, 0, 3], np.int64)], attrs={"mode": "edge"}, opsets=(11, 23), id="Pad-edge"),
    Case("Pad", [I(3, "N"), C([2, 1, 1, 2], np.int64)], attrs={"mode": "reflect"}, dims={"N": 4},
         opsets=(11, 23), id="Pad-reflect"),
    Case("Pad", [I(2, 3, 4), C([2, 1], np.int64), None, C([-1], np.int64)], attrs={"mode": "reflect"},
         opsets=(18, 23), id="Pad-reflect-axes"),
    Case("Pad", [I("N", 3), C([0, 4, 0, 2], np.int64)], attrs={"mode": "wrap"}, opsets=(19, 23), id="Pad-wrap"),
    # negative pads crop first; the wrap then repeats the cropped data (onnxruntime's order)
    Case("Pad", [I(2, 5), C([0, -1, 0, 3], np.int64)], attrs={"mode": "wrap"}, opsets=(19, 23), id="Pad-wrap-crop-begin"),
    Case("Pad", [I(3, 5), C([1, 2, 0, -2], np.int64)], attrs={"mode": "wrap"}, opsets=(19, 23), id="Pad-wrap-crop-end"),
    # -- triangular, depth/space ---------------------------------------------------------------
    Case("Trilu", [I("N", 3, 4)], opsets=(14, 23), id="Trilu-upper"),
    Case("Trilu", [I(4, 5), C(np.array(-1, np.int64))], attrs={"upper": 0}, opsets=(14, 23), id="Trilu-lower-k"),
    Case("ReverseSequence", [I(4, 3, 2), C(np.array([4, 1, 2], np.int64))], opsets=(13, 23),
         id="ReverseSequence-time-major"),
    Case("ReverseSequence", [I(3, 5), C(np.array([2, 5, 0], np.int64))], attrs={"batch_axis": 0, "time_axis": 1},
         opsets=(13, 23), id="ReverseSequence-batch-major"),
    Case("DepthToSpace", [I("N", 8, 2, 3)], attrs={"blocksize": 2}, opsets=(11, 23), id="DepthToSpace-DCR"),
    Case("DepthToSpace", [I("N", 8, 2, 3)], attrs={"blocksize": 2, "mode": "CRD"}, opsets=(11, 23),
         id="DepthToSpace-CRD"),
    Case("SpaceToDepth", [I("N", 2, 4, 6)], attrs={"blocksize": 2}, opsets=(11, 23)),
]
