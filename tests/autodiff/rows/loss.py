"""Gradient-table rows for rules/loss.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

I64 = np.int64
WEIGHTS = C(np.array([0.5, 2.0, 1.0, 0.25], np.float32))
LABELS_2D = C([[0, 3, 1], [2, 2, 0]], I64)  # [N=2, d1=3]
LABELS_2D_IGNORED = C([[0, -1, 1], [3, 2, -1]], I64)

ROWS: list[Case] = []
for op, opsets in (("SoftmaxCrossEntropyLoss", (12, 23)), ("NegativeLogLikelihoodLoss", (12, 23))):
    short = "SCE" if op.startswith("Softmax") else "NLL"
    ROWS += [
        Case(op, [I("N", 4), C([0, 3, 1], I64)], opsets=opsets, id=f"{short}-mean"),
        Case(op, [I(3, 4), C([2, 0, 1], I64)], attrs={"reduction": "sum"}, opsets=opsets, id=f"{short}-sum"),
        Case(op, [I(2, 4, 3), LABELS_2D], attrs={"reduction": "none"}, opsets=opsets, id=f"{short}-none-spatial"),
        Case(op, [I(2, 4, 3), LABELS_2D, WEIGHTS], opsets=opsets, id=f"{short}-mean-weights-spatial"),
        Case(op, [I(2, 4, 3, 2), C(np.array([[[0, 1], [3, 3], [2, 0]], [[1, 1], [0, 2], [3, 1]]]), I64), WEIGHTS],
             attrs={"reduction": "sum"}, opsets=opsets, id=f"{short}-sum-weights-2-spatial"),
        Case(op, [I(2, 4, 3), LABELS_2D_IGNORED], attrs={"ignore_index": -1}, opsets=opsets,
             id=f"{short}-mean-ignore"),
        Case(op, [I(2, 4, 3), LABELS_2D_IGNORED, WEIGHTS], attrs={"ignore_index": -1}, opsets=opsets,
             id=f"{short}-mean-weights-ignore"),
        Case(op, [I(4, 4), C([1, 2, 1, 0], I64), WEIGHTS], attrs={"ignore_index": 1, "reduction": "none"},
             opsets=opsets, id=f"{short}-none-weights-ignore-in-range"),
        Case(op, [I(4, 4), C([1, 2, 1, 3], I64)], attrs={"ignore_index": 1, "reduction": "sum"},
             opsets=opsets, id=f"{short}-sum-ignore-in-range"),
    ]
ROWS += [
    Case("SoftmaxCrossEntropyLoss", [I(2, 4, 3), LABELS_2D_IGNORED, WEIGHTS], attrs={"ignore_index": -1},
         outputs=2, opsets=(12, 23), id="SCE-log-prob-output"),
    Case("SoftmaxCrossEntropyLoss", [I(3, 4), C([0, 3, 3], I64)], attrs={"reduction": "none"},
         outputs=2, opsets=(12, 23), id="SCE-none-log-prob-output"),
]
