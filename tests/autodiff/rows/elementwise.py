"""Gradient-table rows for rules/elementwise.py."""

from __future__ import annotations

import numpy as np  # noqa: F401

from tests.autodiff.grad_table import C, Case, I, pos  # noqa: F401

_F32 = np.float32

ROWS: list[Case] = [
    # -- elementwise arithmetic ------------------------------------------------------
    Case("Add", [I(2, 3), I(3)], id="Add-broadcast"),
    Case("Add", [I("N", 3), I(1, 3)], id="Add-symbolic"),
    Case("Sub", [I(2, 1, 3), I(4, 1)], id="Sub-broadcast-both"),
    Case("Mul", [I("N", 4), I("N", 1)], id="Mul-symbolic-broadcast"),
    Case("Mul", [I(2, 3), I()], id="Mul-scalar"),
    Case("Div", [I(2, 3), pos(3)], id="Div-broadcast"),
    Case("Pow", [pos(2, 3), I(3, low=-1.5, high=1.5)], id="Pow-both-broadcast"),
    Case("Pow", [pos("N", 3), I("N", 1)], id="Pow-symbolic"),
    Case("Pow", [I(2, 3), C(np.array(3.0, _F32))], id="Pow-negative-base"),
    Case("Pow", [I(2, 3), C(np.array(2, np.int64))], id="Pow-int-exponent"),
    Case("Pow", [I(3), C(np.array([[2.0]], _F32))], id="Pow-square-broadcast"),
    Case("Mod", [I(2, 3, low=2.1, high=3.1), I(3, low=1.6, high=2.0)], attrs={"fmod": 1}, id="Mod-broadcast"),
    Case("Mod", [I("N", 3, low=-3.1, high=-2.1), I(1, low=1.6, high=2.0)], attrs={"fmod": 1},
         id="Mod-negative-symbolic"),
    Case("Neg", [I(2, 3)]),
    Case("Identity", [I(2, 3)]),
    Case("Cast", [I("N", 3)], attrs={"to": 1}, id="Cast-float"),
    Case("Cast", [I(2, 3)], attrs={"to": 11}, id="Cast-double"),
    Case("CastLike", [I(2, 3), C(np.zeros([1], np.float64))], opsets=(15, 23)),
    # -- variadic -------------------------------------------------------------------------
    Case("Sum", [I(2, 1, 3), I(4, 1), I(3)], id="Sum-broadcast"),
    Case("Sum", [I("N", 3), I(1, 3)], id="Sum-symbolic"),
    Case("Mean", [I(2, 3), I(3), I(1, 1)], id="Mean-broadcast"),
    # continuous random inputs: no ties
    Case("Max", [I(2, 3), I(3), I(2, 1)], id="Max-broadcast"),
    Case("Max", [I(2, 3)], id="Max-single"),
    Case("Min", [I("N", 3), I(3)], id="Min-symbolic"),
    Case("Where", [C(np.array([[True, False, True], [False, False, True]])), I(2, 3), I(3)],
         id="Where-broadcast"),
    Case("Where", [C(np.array([True, False, True])), I("N", 3), I(1)], id="Where-symbolic"),
    Case("Clip", [I(2, 3, away_from=(-1.0, 1.0))], attrs={"min": -1.0, "max": 1.0}, opsets=(6, 10),
         id="Clip-attrs"),
    Case("Clip", [I(2, 3, away_from=(-1.0, 1.0)), C(np.array(-1.0, _F32)), C(np.array(1.0, _F32))],
         opsets=(11, 23), id="Clip-const-bounds"),
    Case("Clip", [I("N", 3), I(low=-1.5, high=-0.5), I(low=0.5, high=1.5)], opsets=(11, 23),
         id="Clip-bounds-grad"),
    Case("Clip", [I(2, 3), I(low=-1.0, high=0.0)], opsets=(11, 23), id="Clip-min-only"),
    Case("Clip", [I(2, 3), None, I(low=0.0, high=1.0)], opsets=(11, 23), id="Clip-max-only"),
    # -- unary math -------------------------------------------------------------------------
    Case("Sqrt", [pos("N", 3)]),
    Case("Reciprocal", [I(3, 4, away_from=(0.0,))]),
    Case("Log", [pos(3, 4)]),
    Case("Exp", [I(3, 4)]),
    Case("Abs", [I(3, 4, away_from=(0.0,))]),
    Case("Erf", [I(3, 4)]),
    Case("Sin", [I(3, 4)]),
    Case("Cos", [I(3, 4)]),
    Case("Tan", [I(3, 4, low=-1.2, high=1.2)]),
    Case("Atan", [I(3, 4)]),
    Case("Asin", [I(3, 4, low=-0.9, high=0.9)]),
    Case("Acos", [I(3, 4, low=-0.9, high=0.9)]),
    Case("Sinh", [I(3, 4)]),
    Case("Cosh", [I(3, 4)]),
    Case("Asinh", [I(3, 4)]),
    Case("Acosh", [I(3, 4, low=1.2, high=3.0)]),
    Case("Atanh", [I(3, 4, low=-0.9, high=0.9)]),
    # -- activations ------------------------------------------------------------------------
    Case("Relu", [I(3, 4, away_from=(0.0,))]),
    Case("Tanh", [I(3, 4)]),
    Case("Sigmoid", [I(3, 4)]),
    Case("Softplus", [I(3, 4)]),
    Case("Softsign", [I(3, 4)]),
    Case("LeakyRelu", [I("N", 4, away_from=(0.0,))], attrs={"alpha": 0.1}),
    Case("LeakyRelu", [I(3, 4, away_from=(0.0,))], id="LeakyRelu-default"),
    Case("PRelu", [I(2, 3, 4, away_from=(0.0,)), I(3, 1)], id="PRelu-broadcast"),
    Case("PRelu", [I("N", 4, away_from=(0.0,)), I(4)], id="PRelu-symbolic"),
    Case("ThresholdedRelu", [I(3, 4, away_from=(0.5,))], attrs={"alpha": 0.5}),
    # onnxruntime's float64 Shrink computes in float32
    Case("Shrink", [I("N", 4, away_from=(-0.3, 0.3))], attrs={"lambd": 0.3, "bias": 0.2}, opsets=(13, 23),
         precision="float32"),
    Case("Shrink", [I(3, 4, away_from=(-0.5, 0.5))], opsets=(13, 23), id="Shrink-defaults", precision="float32"),
    Case("Elu", [I(3, 4, away_from=(0.0,))], attrs={"alpha": 0.7}),
    Case("Selu", [I(3, 4, away_from=(0.0,))]),
    Case("Celu", [I(3, 4, away_from=(0.0,))], attrs={"alpha": 0.8}),
    Case("HardSigmoid", [I(3, 4, low=-3.0, high=3.0, away_from=(-2.5, 2.5))], id="HardSigmoid-default"),
    Case("HardSigmoid", [I(3, 4, away_from=(-0.8, 1.2))], attrs={"alpha": 0.5, "beta": 0.4}),
    Case("HardSwish", [I(3, 4, low=-4.0, high=4.0, away_from=(-3.0, 3.0))], opsets=(14, 23)),
    Case("Mish", [I(3, 4)], opsets=(18, 23)),
    Case("Swish", [I(3, 4)], attrs={"alpha": 1.3}, opsets=(24, 24)),
    Case("Gelu", [I("N", 4)], opsets=(20, 23), id="Gelu-erf"),
    Case("Gelu", [I(3, 4)], attrs={"approximate": "tanh"}, opsets=(20, 23), id="Gelu-tanh"),
]
