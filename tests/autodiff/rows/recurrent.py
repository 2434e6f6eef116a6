"""Gradient-table rows for rules/recurrent.py (LSTM, GRU, RNN).

onnxruntime's CPU kernels for these ops are float32 only, so the rows are checked in float32:
inputs stay in [-1, 1] and sizes small (hidden 2, 3 to 4 steps) so finite differences stay
accurate. Inputs by position: X, W, R, B, sequence_lens, initial_h, initial_c, P (the last two
LSTM's); ``outputs`` says how many of Y, Y_h, Y_c receive a gradient. Rows with a constant
``sequence_lens`` use a batch of 3 (as the table fixes symbolic dims of rows with constants).

Not here: ``layout`` 1, which onnxruntime's CPU kernels refuse to run (the forward the finite
differences need), and exact checks of ``clip`` and Relu: finite differences that step over
their kinks are off (the clip values below are ones whose rows' samples straddle no kink).
tests/autodiff/test_recurrent.py checks those against PyTorch autograd of the ops' semantics.
"""

from __future__ import annotations

import numpy as np

from tests.autodiff.grad_table import C, Case, I

H = 2  # hidden size
F32 = "float32"


def U(*shape, **kw):
    """A float input in [-1, 1]."""
    return I(*shape, low=-1.0, high=1.0, **kw)


def lengths(*values):
    """A constant sequence_lens input (int32, as the ops require)."""
    return C(np.array(values, np.int32))


ROWS: list[Case] = [
    # -- LSTM (gates iofc: W/R are [directions, 4*hidden, ...]) -----------------------------
    Case("LSTM", [U("S", "N", 3), U(1, 4 * H, 3), U(1, 4 * H, H), U(1, 8 * H), None, U(1, "N", H), U(1, "N", H)],
         attrs={"hidden_size": H}, outputs=3, precision=F32, opsets=(13, 23), id="LSTM-forward-symbolic-all-outputs"),
    Case("LSTM", [U(4, 2, 2), U(1, 4 * H, 2), U(1, 4 * H, H)], attrs={"hidden_size": H, "direction": "reverse"},
         outputs=2, precision=F32, opsets=(13, 23), id="LSTM-reverse-no-bias-no-initial-state"),
    Case("LSTM", [U(3, "N", 2), U(2, 4 * H, 2), U(2, 4 * H, H), U(2, 8 * H), None, U(2, "N", H), U(2, "N", H)],
         attrs={"hidden_size": H, "direction": "bidirectional", "layout": 0}, outputs=3, precision=F32,
         opsets=(14, 23), id="LSTM-bidirectional-symbolic-batch"),
    Case("LSTM", [U(3, 2, 2), U(1, 4 * H, 2), U(1, 4 * H, H), U(1, 8 * H), None, U(1, 2, H), U(1, 2, H),
                  U(1, 3 * H)], attrs={"hidden_size": H}, outputs=3, precision=F32, opsets=(13, 23),
         id="LSTM-peepholes"),
    Case("LSTM", [U(3, 2, 2), U(2, 4 * H, 2), U(2, 4 * H, H), None, None, None, None, U(2, 3 * H)],
         attrs={"hidden_size": H, "direction": "bidirectional"}, outputs=2, precision=F32, opsets=(13, 23),
         id="LSTM-bidirectional-peepholes-only"),
    Case("LSTM", [U(3, 2, 2), U(1, 4 * H, 2), U(1, 4 * H, H), U(1, 8 * H), None, U(1, 2, H), U(1, 2, H),
                  U(1, 3 * H)], attrs={"hidden_size": H, "input_forget": 1}, outputs=3, precision=F32,
         opsets=(13, 23), id="LSTM-input-forget-peepholes"),
    Case("LSTM", [U(4, "N", 2), U(2, 4 * H, 2), U(2, 4 * H, H), U(2, 8 * H), lengths(4, 1, 3), U(2, "N", H),
                  U(2, "N", H)], attrs={"hidden_size": H, "direction": "bidirectional"}, outputs=3, precision=F32,
         opsets=(13, 23), id="LSTM-bidirectional-sequence-lens"),
    Case("LSTM", [U(3, "N", 2), U(1, 4 * H, 2), U(1, 4 * H, H), None, lengths(0, 3, 2), U(1, "N", H),
                  U(1, "N", H)], attrs={"hidden_size": H, "direction": "reverse"}, outputs=3, precision=F32,
         opsets=(13, 23), id="LSTM-reverse-sequence-lens-with-empty-sequence"),
    Case("LSTM", [U(3, 2, 2), U(1, 4 * H, 2), U(1, 4 * H, H), U(1, 8 * H)],
         attrs={"hidden_size": H, "clip": 0.7}, outputs=2, precision=F32, opsets=(13, 23), id="LSTM-clip"),
    Case("LSTM", [U(3, 2, 2), U(1, 4 * H, 2), U(1, 4 * H, H), U(1, 8 * H)],
         attrs={"hidden_size": H, "activations": ["Tanh", "Relu", "Sigmoid"]}, outputs=3, precision=F32,
         opsets=(13, 23), id="LSTM-activations"),
    Case("LSTM", [U("S", 2, 2), U(1, 4 * H, 2, grad=False), U(1, 4 * H, H, grad=False)],
         attrs={"hidden_size": H}, precision=F32, opsets=(13, 23), id="LSTM-input-gradient-only"),
    # -- GRU (gates zrh) ------------------------------------------------------------------------
    Case("GRU", [U("S", "N", 3), U(1, 3 * H, 3), U(1, 3 * H, H), U(1, 6 * H), None, U(1, "N", H)],
         attrs={"hidden_size": H}, outputs=2, precision=F32, opsets=(13, 23), id="GRU-forward-symbolic"),
    Case("GRU", [U("S", 2, 2), U(1, 3 * H, 2), U(1, 3 * H, H), U(1, 6 * H), None, U(1, 2, H)],
         attrs={"hidden_size": H, "linear_before_reset": 1}, outputs=2, precision=F32, opsets=(13, 23),
         id="GRU-linear-before-reset"),
    Case("GRU", [U(4, 2, 2), U(1, 3 * H, 2), U(1, 3 * H, H)],
         attrs={"hidden_size": H, "direction": "reverse", "linear_before_reset": 1}, outputs=2, precision=F32,
         opsets=(13, 23), id="GRU-reverse-linear-before-reset-no-bias"),
    Case("GRU", [U(3, "N", 2), U(2, 3 * H, 2), U(2, 3 * H, H), U(2, 6 * H), None, U(2, "N", H)],
         attrs={"hidden_size": H, "direction": "bidirectional"}, outputs=2, precision=F32, opsets=(13, 23),
         id="GRU-bidirectional"),
    Case("GRU", [U(3, "N", 2), U(2, 3 * H, 2), U(2, 3 * H, H), U(2, 6 * H), lengths(2, 3, 1)],
         attrs={"hidden_size": H, "direction": "bidirectional", "linear_before_reset": 1, "clip": 0.6},
         outputs=2, precision=F32, opsets=(13, 23), id="GRU-bidirectional-sequence-lens-clip"),
    Case("GRU", [U(3, 2, 2), U(1, 3 * H, 2), U(1, 3 * H, H), U(1, 6 * H)],
         attrs={"hidden_size": H, "activations": ["Tanh", "Relu"]}, outputs=2, precision=F32, opsets=(13, 23),
         id="GRU-activations"),
    # -- RNN --------------------------------------------------------------------------------------
    Case("RNN", [U("S", "N", 3), U(1, H, 3), U(1, H, H), U(1, 2 * H), None, U(1, "N", H)],
         attrs={"hidden_size": H}, outputs=2, precision=F32, opsets=(13, 23), id="RNN-forward-symbolic"),
    Case("RNN", [U(4, 2, 2), U(1, H, 2), U(1, H, H)], attrs={"hidden_size": H, "direction": "reverse"},
         outputs=2, precision=F32, opsets=(13, 23), id="RNN-reverse-no-bias"),
    Case("RNN", [U(3, "N", 2), U(2, H, 2), U(2, H, H), U(2, 2 * H), None, U(2, "N", H)],
         attrs={"hidden_size": H, "direction": "bidirectional"}, outputs=2, precision=F32, opsets=(13, 23),
         id="RNN-bidirectional"),
    Case("RNN", [U(4, "N", 2), U(2, H, 2), U(2, H, H), U(2, 2 * H), lengths(3, 1, 4), U(2, "N", H)],
         attrs={"hidden_size": H, "direction": "bidirectional", "activations": ["Relu", "Sigmoid"], "clip": 1.2},
         outputs=2, precision=F32, opsets=(13, 23), id="RNN-bidirectional-sequence-lens-relu-clip"),
]
