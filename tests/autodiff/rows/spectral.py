"""Gradient-table rows for rules/spectral.py (DFT, STFT).

DFT: real signals (last dim 1) and complex ones (last dim 2), forward and inverse, one-sided
outputs of even and odd lengths, one-sided inverses (``irfft``), a ``dft_length`` that pads and one that cuts, and an axis
other than the default (an attribute up to opset 19, an input from 20 on). STFT: overlapping
and gapped frames, a constant (Hann) or differentiated window, a frame length without a
window, one-sided or full spectra of real and complex signals.
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
    # one-sided inverses (irfft): half a spectrum to a real signal of even and odd lengths
    _row([I("N", 5, 2), _length(8)], "onesided-inverse-even", inverse=1, onesided=1),
    _row([I(2, 4, 2), _length(7)], "onesided-inverse-odd", inverse=1, onesided=1),
    _row([I(2, 6, 2), _length(8)], "onesided-inverse-more-bins", inverse=1, onesided=1),
    _row([I(2, 4, 3, 2), _length(6)], "onesided-inverse-axis-attribute", opsets=(17, 19), axis=1, inverse=1,
         onesided=1),
    _row([I(2, 3, 4, 2), _length(6), C(np.array(2, np.int64))], "onesided-inverse-axis-input", opsets=(20, 23),
         inverse=1, onesided=1),
]


def _stft(inputs, id, **attrs):
    return Case("STFT", inputs, attrs=attrs, opsets=(17, 23), id=f"STFT-{id}")


_HANN = C(np.hanning(10)[1:-1].astype(np.float32))  # 8 taps


ROWS += [
    _stft([I("N", 20, 1), _length(2), _HANN], "hann-overlapping"),
    _stft([I(2, 16, 1), _length(3), I(6)], "window-gradient-full", onesided=0),
    _stft([I(2, 15, 2), _length(4), I(5)], "complex", onesided=0),
    _stft([I(2, 17, 1), _length(6), None, _length(4)], "gapped-frames-no-window"),
]
