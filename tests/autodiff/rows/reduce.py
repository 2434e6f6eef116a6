"""Gradient-table rows for rules/reduce.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

ROWS: list[Case] = [
    # -- reductions -------------------------------------------------------------------
    Case("ReduceSum", [I(2, 3, 4), C([1], np.int64)], attrs={"keepdims": 0}, id="ReduceSum-axis"),
    Case("ReduceSum", [I(2, 3, 4)], attrs={"keepdims": 1}, id="ReduceSum-all"),
    Case("ReduceMean", [I("N", 3, 4), C([-1], np.int64)], attrs={"keepdims": 1}, opsets=(18, 23),
         id="ReduceMean-axis-input"),
    Case("ReduceMean", [I(2, 3, 4)], attrs={"axes": [0, 2], "keepdims": 0}, opsets=(13, 17),
         id="ReduceMean-axes-attr"),
]
