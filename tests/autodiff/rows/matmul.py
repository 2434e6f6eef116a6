"""Gradient-table rows for rules/matmul.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

ROWS: list[Case] = [
    # -- matrix products --------------------------------------------------------------
    Case("MatMul", [I(3, 4), I(4, 5)], id="MatMul-2d"),
    Case("MatMul", [I(2, 3, 4), I(4, 5)], id="MatMul-batched-weight"),
    Case("MatMul", [I("N", 2, 3, 4), I(2, 4, 5)], id="MatMul-batch-broadcast-symbolic"),
    Case("MatMul", [I(4), I(2, 4, 5)], id="MatMul-vector-left"),
    Case("MatMul", [I(2, 3, 4), I(4)], id="MatMul-vector-right"),
]
