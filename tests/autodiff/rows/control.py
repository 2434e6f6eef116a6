"""Gradient-table rows for rules/control.py (If): the branches read graph inputs by name."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tests.autodiff.grad_table import C, Case, I


def _branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])


# then: tanh(cap0) * cap1; else: cap0 * cap0 (cap1 unread: zeros from that branch)
_THEN = _branch("then", [helper.make_node("Tanh", ["cap0"], ["t"]),
                         helper.make_node("Mul", ["t", "cap1"], ["then_out"])], "then_out")
_ELSE = _branch("else", [helper.make_node("Mul", ["cap0", "cap0"], ["else_out"])], "else_out")
# a nested If in the then branch, on the same condition input
_NESTED = _branch("outer_then", [helper.make_node("If", ["in0"], ["inner"], then_branch=_THEN, else_branch=_ELSE),
                                 helper.make_node("Sigmoid", ["inner"], ["outer_out"])], "outer_out")

ROWS: list[Case] = [
    Case("If", [C(np.array(True))], attrs={"then_branch": _THEN, "else_branch": _ELSE}, captured=[I(2, 3), I(3)],
         id="If-then"),
    Case("If", [C(np.array(False))], attrs={"then_branch": _THEN, "else_branch": _ELSE}, captured=[I(2, 3), I(3)],
         id="If-else"),
    Case("If", [C(np.array(True))], attrs={"then_branch": _NESTED, "else_branch": _ELSE}, captured=[I(3), I(3)],
         id="If-nested"),
]
