"""The gradient table: one row (or a few) per registered gradient rule.

Each row names an op, its attributes, its inputs (shape, sampling domain chosen away
from kinks and singular points, or a fixed constant value) and the opset range to
check at both ends. ``test_grad_table.py`` checks every row against central finite
differences through onnxruntime; a meta-test fails for any rule without a row.

Shapes may use strings for symbolic dims: the graph input then has that symbolic dim,
and the row is run with the concrete size in ``dims`` (default: a random size from 2 to 5,
fixed per row and opset by the row's seed; 3 in rows with constant inputs, whose indices
and labels are written for that size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class In:
    """One input of the op under test."""

    shape: tuple = ()
    low: float = -2.0
    high: float = 2.0
    value: Any = None  # a fixed value: passed as a constant initializer, not differentiated
    grad: bool = True  # differentiate w.r.t. this input (float inputs only)
    dtype: str = "float32"
    away_from: tuple = ()  # resample values closer than 0.05 to any of these points (kinks)


@dataclass
class Case:
    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    opsets: tuple = (13, 23)
    outputs: int = 1
    domain: str = ""
    id: str = ""
    dims: dict = field(default_factory=dict)  # symbolic dim name -> size used at run time
    rtol: float | None = None
    # "float32" for ops whose onnxruntime float64 kernel computes in float32 internally
    precision: str = "float64"
    # float graph inputs (named cap0, cap1, ...) that the node's subgraphs read without listing
    # them as node inputs (an If's branches); differentiated like the inputs
    captured: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.id or self.op


def I(*shape, **kw) -> In:  # noqa: E743  (short row syntax)
    return In(shape=shape, **kw)


def C(value, dtype=None) -> In:
    """A constant (non-differentiated) input."""
    arr = np.asarray(value, dtype=dtype)
    return In(shape=arr.shape, value=arr, grad=False, dtype=str(arr.dtype))


def pos(*shape, **kw) -> In:
    """A strictly positive input (log, sqrt, div denominators)."""
    return In(shape=shape, low=0.3, high=2.0, **kw)


def _all_rows() -> list[Case]:
    from tests.autodiff.rows import (conv, control, elementwise, index, linalg, loss, matmul, nn, recurrent,
                                     reduce, sampling, shape, spectral)

    rows: list[Case] = []
    for family in (elementwise, matmul, reduce, shape, index, conv, nn, loss, sampling, recurrent, control,
                   spectral, linalg):
        rows.extend(family.ROWS)
    return rows


CASES: list[Case] = _all_rows()
