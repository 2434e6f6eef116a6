"""Gradient-table rows for rules/reduce.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

_AXIS = np.int64

ROWS: list[Case] = [
    # -- reductions -------------------------------------------------------------------
    Case("ReduceSum", [I(2, 3, 4), C([1], np.int64)], attrs={"keepdims": 0}, id="ReduceSum-axis"),
    Case("ReduceSum", [I(2, 3, 4)], attrs={"keepdims": 1}, id="ReduceSum-all"),
    Case("ReduceSum", [I(2, 3, 4)], attrs={"axes": [-1], "keepdims": 0}, opsets=(11, 12), id="ReduceSum-axes-attr"),
    Case("ReduceSum", [I("N", 3), I(1, low=-2.0, high=2.0, dtype="int64", grad=False)], attrs={"keepdims": 0},
         id="ReduceSum-runtime-axes"),
    Case("ReduceSum", [I(2, 3), C(np.zeros([0], np.int64))], attrs={"noop_with_empty_axes": 1}, id="ReduceSum-noop"),
    Case("ReduceMean", [I("N", 3, 4), C([-1], np.int64)], attrs={"keepdims": 1}, opsets=(18, 23),
         id="ReduceMean-axis-input"),
    Case("ReduceMean", [I(2, 3, 4)], attrs={"axes": [0, 2], "keepdims": 0}, opsets=(11, 17),
         id="ReduceMean-axes-attr"),
    Case("ReduceMean", [I(2, 3, 4), I(1, low=-3.0, high=3.0, dtype="int64", grad=False)], attrs={"keepdims": 0},
         opsets=(18, 23), id="ReduceMean-runtime-axes"),
    Case("ReduceMean", [I(2, 3)], attrs={"keepdims": 0}, id="ReduceMean-all"),
    # continuous random inputs: no ties
    Case("ReduceMax", [I(2, 3, 4)], attrs={"axes": [1], "keepdims": 0}, opsets=(11, 17), id="ReduceMax-axes-attr"),
    Case("ReduceMax", [I("N", 3, 4), C([0, -1], _AXIS)], attrs={"keepdims": 0}, opsets=(18, 23),
         id="ReduceMax-axes-input"),
    Case("ReduceMax", [I(2, 3)], attrs={"keepdims": 0}, id="ReduceMax-all"),
    Case("ReduceMin", [I(2, 3, 4)], attrs={"axes": [-1], "keepdims": 1}, opsets=(13, 17), id="ReduceMin-axes-attr"),
    Case("ReduceMin", [I("N", 3, 4), C([1], _AXIS)], attrs={"keepdims": 0}, opsets=(18, 23),
         id="ReduceMin-axes-input"),
    Case("ReduceMin", [I(2, 3)], attrs={"noop_with_empty_axes": 1}, opsets=(18, 23), id="ReduceMin-noop"),
    Case("ReduceProd", [I(2, 3, 4)], attrs={"axes": [1], "keepdims": 0}, opsets=(13, 17), id="ReduceProd-axes-attr"),
    Case("ReduceProd", [I("N", 3, 4), C([-1], _AXIS)], attrs={"keepdims": 1}, opsets=(18, 23),
         id="ReduceProd-axes-input"),
    Case("ReduceProd", [I(2, 3)], attrs={"keepdims": 0}, id="ReduceProd-all"),
    Case("ReduceL1", [I(2, 3, 4, away_from=(0.0,))], attrs={"axes": [1], "keepdims": 0}, opsets=(13, 17),
         id="ReduceL1-axes-attr"),
    Case("ReduceL1", [I("N", 3, 4, away_from=(0.0,)), C([-1], _AXIS)], opsets=(18, 23), id="ReduceL1-axes-input"),
    Case("ReduceL2", [I(2, 3, 4)], attrs={"axes": [0, 2], "keepdims": 0}, opsets=(13, 17), id="ReduceL2-axes-attr"),
    Case("ReduceL2", [I("N", 3, 4), C([1], _AXIS)], attrs={"keepdims": 0}, opsets=(18, 23),
         id="ReduceL2-axes-input"),
    Case("ReduceSumSquare", [I(2, 3, 4)], attrs={"axes": [1], "keepdims": 0}, opsets=(13, 17),
         id="ReduceSumSquare-axes-attr"),
    Case("ReduceSumSquare", [I("N", 3, 4), C([-1], _AXIS)], opsets=(18, 23), id="ReduceSumSquare-axes-input"),
    Case("ReduceLogSum", [pos(2, 3, 4)], attrs={"axes": [1], "keepdims": 0}, opsets=(13, 17),
         id="ReduceLogSum-axes-attr"),
    Case("ReduceLogSum", [pos("N", 3, 4), C([0, 2], _AXIS)], attrs={"keepdims": 0}, opsets=(18, 23),
         id="ReduceLogSum-axes-input"),
    Case("ReduceLogSumExp", [I(2, 3, 4)], attrs={"axes": [2], "keepdims": 0}, opsets=(13, 17),
         id="ReduceLogSumExp-axes-attr"),
    Case("ReduceLogSumExp", [I("N", 3, 4), C([1], _AXIS)], opsets=(18, 23), id="ReduceLogSumExp-axes-input"),
    Case("ReduceLogSumExp", [I(2, 3)], attrs={"keepdims": 0}, id="ReduceLogSumExp-all"),
    # -- cumulative sums ----------------------------------------------------------------
    Case("CumSum", [I(2, 3, 4), C(np.array(1, _AXIS))], id="CumSum"),
    Case("CumSum", [I("N", 4), C(np.array(-1, np.int32))], attrs={"exclusive": 1}, id="CumSum-exclusive"),
    Case("CumSum", [I(2, 4), C(np.array(0, _AXIS))], attrs={"reverse": 1}, id="CumSum-reverse"),
    Case("CumSum", [I(2, 4), C(np.array(1, _AXIS))], attrs={"exclusive": 1, "reverse": 1},
         id="CumSum-exclusive-reverse"),
    # -- cumulative products (opset 26); inputs with exact zeros: tests/autodiff/test_cumprod.py
    Case("CumProd", [I(2, "N", 4), C(np.array(1, _AXIS))], opsets=(26, 28), id="CumProd"),
    Case("CumProd", [I("N", 4), C(np.array(-1, np.int32))], attrs={"exclusive": 1}, opsets=(26, 28),
         id="CumProd-exclusive"),
    Case("CumProd", [I(4, 3), C(np.array(0, _AXIS))], attrs={"exclusive": 1, "reverse": 1}, opsets=(26, 28),
         id="CumProd-exclusive-reverse"),
]
