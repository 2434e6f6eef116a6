"""Gradient-table rows for rules/elementwise.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

ROWS: list[Case] = [
    # -- elementwise arithmetic ------------------------------------------------------
    Case("Add", [I(2, 3), I(3)], id="Add-broadcast"),
    Case("Add", [I("N", 3), I(1, 3)], id="Add-symbolic"),
    Case("Sub", [I(2, 1, 3), I(4, 1)], id="Sub-broadcast-both"),
    Case("Mul", [I("N", 4), I("N", 1)], id="Mul-symbolic-broadcast"),
    Case("Mul", [I(2, 3), I()], id="Mul-scalar"),
    Case("Div", [I(2, 3), pos(3)], id="Div-broadcast"),
    Case("Neg", [I(2, 3)]),
    Case("Identity", [I(2, 3)]),
    Case("Relu", [I(3, 4, away_from=(0.0,))]),
    Case("Exp", [I(3, 4)]),
    Case("Tanh", [I(3, 4)]),
    Case("Sigmoid", [I(3, 4)]),
]
