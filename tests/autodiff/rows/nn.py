"""Gradient-table rows for rules/nn.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

F32 = np.float32

ROWS: list[Case] = [
    # -- Softmax / LogSoftmax (models below opset 13 are upgraded to 13 on load) -----
    Case("Softmax", [I("N", 3, 4)], id="Softmax-default-axis"),
    Case("Softmax", [I("N", 3, 4)], attrs={"axis": 1}, id="Softmax-axis1"),
    Case("Softmax", [I(2, 3, 4)], attrs={"axis": 1}, opsets=(11, 12), id="Softmax-2d-coerced"),
    Case("LogSoftmax", [I("N", 5)], id="LogSoftmax"),
    Case("LogSoftmax", [I(2, "N", 4)], attrs={"axis": -2}, id="LogSoftmax-axis-2"),
    Case("LogSoftmax", [I(2, 3, 4)], attrs={"axis": 1}, opsets=(11, 12), id="LogSoftmax-2d-coerced"),
    # -- LayerNormalization ----------------------------------------------------------
    Case("LayerNormalization", [I("N", 3, 4), I(4), I(4)], opsets=(17, 23), id="LayerNorm-last-axis"),
    Case("LayerNormalization", [I("N", 3, 4), I(3, 4)], attrs={"axis": 1, "epsilon": 1e-3},
         opsets=(17, 23), id="LayerNorm-axis1-no-bias"),
    Case("LayerNormalization", [I(2, 3, 4), I(1, 4), I(4)], attrs={"axis": -1},
         opsets=(17, 23), id="LayerNorm-broadcast-scale"),
    Case("LayerNormalization", [I("N", 3, 4), I(4), I(4)], attrs={"stash_type": 1}, outputs=3,
         opsets=(17, 23), id="LayerNorm-mean-invstd-outputs"),
    Case("LayerNormalization", [I("N", 3, 4), I(4), I(4)], attrs={"stash_type": 0},
         opsets=(17, 23), id="LayerNorm-stash-type-0"),
    # -- BatchNormalization ----------------------------------------------------------
    # training mode needs all 3 outputs (shape inference insists); momentum 1 keeps the
    # running statistics independent of X, since they are not differentiated
    Case("BatchNormalization", [I("N", 3, 4, 2), I(3), I(3), I(3), pos(3)], opsets=(9, 13),
         id="BatchNorm-inference-9"),
    Case("BatchNormalization", [I("N", 3, 4, 2), I(3), I(3), I(3), pos(3)], opsets=(14, 23),
         id="BatchNorm-inference"),
    Case("BatchNormalization", [I(4, 3), I(3), I(3), C(np.zeros(3, F32)), C(np.ones(3, F32))],
         attrs={"training_mode": 0, "epsilon": 1e-3}, opsets=(14, 23), id="BatchNorm-inference-2d"),
    Case("BatchNormalization", [I("N", 3, 4), I(3), I(3), C(np.zeros(3, F32)), C(np.ones(3, F32))],
         attrs={"training_mode": 1, "momentum": 1.0}, outputs=3, opsets=(14, 23), dims={"N": 4},
         id="BatchNorm-training"),
    Case("BatchNormalization", [I(5, 2), I(2), I(2), C(np.zeros(2, F32)), C(np.ones(2, F32))],
         attrs={"training_mode": 1, "momentum": 1.0}, outputs=3, opsets=(14, 23), id="BatchNorm-training-2d"),
    # -- InstanceNormalization -------------------------------------------------------
    Case("InstanceNormalization", [I("N", 3, 5), I(3), I(3)], id="InstanceNorm"),
    # -- LpNormalization ------------------------------------------------------------
    Case("LpNormalization", [I("N", 3, 4)], opsets=(13, 23), id="LpNormalization-l2-last-axis"),
    Case("LpNormalization", [I(3, 4, away_from=(0.0,))], attrs={"axis": 0, "p": 1}, opsets=(13, 23),
         id="LpNormalization-l1"),
    # -- LRN (float32: onnxruntime's LRN and the rule's Conv have no float64 kernels) -----
    Case("LRN", [I("N", 5, 3, 2)], attrs={"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 2.0}, opsets=(13, 23),
         id="LRN-odd-size", precision="float32"),
    Case("LRN", [I(2, 6, 1, 4)], attrs={"size": 5, "alpha": 0.3}, opsets=(13, 23), id="LRN-defaults",
         precision="float32"),  # onnxruntime's kernel takes odd sizes and 4-D inputs only
    Case("InstanceNormalization", [I(2, 2, 3, 3), I(2), I(2)], attrs={"epsilon": 1e-3}, id="InstanceNorm-2d"),
    # -- Dropout (random masks are checked exactly in test_dropout.py) ---------------
    Case("Dropout", [I("N", 4)], opsets=(12, 23), id="Dropout-no-mode"),
    Case("Dropout", [I(3, 4), C(np.array(0.5, F32)), C(np.array(False))], opsets=(12, 23),
         id="Dropout-inference"),
    Case("Dropout", [I("N", 4), C(np.array(0.0, F32)), C(np.array(True))], opsets=(12, 23), outputs=2,
         id="Dropout-training-ratio0-mask"),
    Case("Dropout", [I("N", 4), C(np.array(0.0, F32)), C(np.array(True))], opsets=(12, 23),
         id="Dropout-training-ratio0"),
    Case("Dropout", [I(3, 4), C(np.array(0.0, F32)), I(dtype="bool", grad=False, low=1, high=2)],
         opsets=(12, 23), id="Dropout-runtime-mode"),
]
