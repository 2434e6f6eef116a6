"""Gradient-table rows for rules/spectral.py (DFT).

Real signals (last dim 1) and complex ones (last dim 2), forward and inverse, one-sided
outputs of even and odd lengths, a ``dft_length`` that pads and one that cuts, and an axis
other than the default (an attribute up to opset 19, an input from 20 on).
"""

from __future__ import annotations

import numpy as np

from tests.autodiff.grad_table import C, Case, I


def _row(inputs, id, opsets=(17, 23), **attrs):
    return Case("DFT", inputs, attrs=attrs, opsets=opsets, id=f"DFT-{id}")


def _length(n):
    return C(np.array(n, np.int64))


ROWS: list[Case] = [
    _row([I("N", 6, 1)], "real"),
    _row([I(2, 6, 2)], "complex"),
    _row([I(2, 5, 2)], "complex-inverse", inverse=1),
    _row([I(2, 5, 1)], "real-inverse", inverse=1),
    _row([I("N", 8, 1)], "onesided-even", onesided=1),
    _row([I(2, 7, 1)], "onesided-odd", onesided=1),
    _row([I(2, 5, 1), _length(8)], "onesided-padded", onesided=1),
    _row([I(2, 6, 2), _length(4)], "cut"),
    _row([I(2, 4, 2), _length(7)], "inverse-padded", inverse=1),
    _row([I(2, 3, 5, 1)], "axis-attribute", opsets=(17, 19), axis=2, onesided=1),
    _row([I(2, 5, 3, 2)], "axis-attribute-negative", opsets=(17, 19), axis=-3),
    _row([I(2, 3, 5, 1), None, C(np.array(2, np.int64))], "axis-input", opsets=(20, 23), onesided=1),
    _row([I(2, 5, 3, 2), _length(6), C(np.array(-3, np.int64))], "axis-input-negative-padded", opsets=(20, 23)),
]
