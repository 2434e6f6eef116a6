"""Gradient-table rows for rules/control.py (If, Scan): the subgraphs read graph inputs by name (cap0, ...)."""

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


def _vi(name, elem=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def _body(name, nodes, inputs, outputs):
    return helper.make_graph(nodes, name, [_vi(n, *spec) for n, spec in inputs], [_vi(n, *spec) for n, spec in outputs])


F = TensorProto.FLOAT
# a state and a scanned slice: s' = tanh(s * x + cap0), y = s' * s' (reads cap0 from outside)
_RECURRENCE = _body("recurrence", [helper.make_node("Mul", ["s", "x"], ["sx"]),
                                   helper.make_node("Add", ["sx", "cap0"], ["pre"]),
                                   helper.make_node("Tanh", ["pre"], ["s_next"]),
                                   helper.make_node("Mul", ["s_next", "s_next"], ["y"])],
                    [("s", (F, [2])), ("x", (F, [2]))], [("s_next", (F, [2])), ("y", (F, [2]))])
# no state: two scanned slices mapped (y = sin(a) * b + cap0)
_MAP = _body("map", [helper.make_node("Sin", ["a"], ["sa"]), helper.make_node("Mul", ["sa", "b"], ["ab"]),
                     helper.make_node("Add", ["ab", "cap0"], ["y"])],
             [("a", (F, [3])), ("b", (F, [3]))], [("y", (F, [3]))])
# an integer counter state beside a float one: s' = s + x * float(i), i' = i + 1; the state
# passes through unchanged as well (a body output that is its input)
_COUNTER = _body("counter", [helper.make_node("Cast", ["i"], ["fi"], to=F),
                             helper.make_node("Mul", ["x", "fi"], ["xi"]),
                             helper.make_node("Add", ["s", "xi"], ["s_next"]),
                             helper.make_node("Add", ["i", "one"], ["i_next"]),
                             helper.make_node("Exp", ["s"], ["y"])],
                 [("s", (F, [2])), ("i", (TensorProto.INT64, [])), ("x", (F, [2]))],
                 [("s_next", (F, [2])), ("i_next", (TensorProto.INT64, [])), ("y", (F, [2]))])
_COUNTER.initializer.append(helper.make_tensor("one", TensorProto.INT64, [], [1]))

ROWS += [
    Case("Scan", [I(2), I(3, 2)], attrs={"body": _RECURRENCE, "num_scan_inputs": 1}, outputs=2, captured=[I(2)],
         opsets=(9, 23), id="Scan-recurrence"),
    # the slices along axis 1, the last first; the outputs stacked along axis 1, the last first
    Case("Scan", [I(2), I(2, 4)], attrs={"body": _RECURRENCE, "num_scan_inputs": 1, "scan_input_axes": [1],
                                         "scan_input_directions": [1], "scan_output_axes": [1],
                                         "scan_output_directions": [1]},
         outputs=2, captured=[I(2)], opsets=(9, 23), id="Scan-axis-1-reversed"),
    Case("Scan", [I(4, 3), I(4, 3)], attrs={"body": _MAP, "num_scan_inputs": 2, "scan_input_directions": [0, 1]},
         captured=[I(3)], opsets=(9, 23), id="Scan-no-state"),
    Case("Scan", [I(2), C(np.array(1, np.int64)), I(3, 2)], attrs={"body": _COUNTER, "num_scan_inputs": 1},
         outputs=3, opsets=(9, 23), id="Scan-integer-state"),
]

B = TensorProto.BOOL
_LOOP_IO = [("iter", (TensorProto.INT64, [])), ("cond", (B, []))]
# s' = tanh(s * cap0 + iter), y = s' * s'; the condition passes through
_LOOP_TANH = _body("loop_tanh", [helper.make_node("Cast", ["iter"], ["fi"], to=F),
                                 helper.make_node("Mul", ["s", "cap0"], ["sc"]),
                                 helper.make_node("Add", ["sc", "fi"], ["pre"]),
                                 helper.make_node("Tanh", ["pre"], ["s_next"]),
                                 helper.make_node("Mul", ["s_next", "s_next"], ["y"]),
                                 helper.make_node("Identity", ["cond"], ["cond_out"])],
                   [*_LOOP_IO, ("s", (F, [2]))], [("cond_out", (B, [])), ("s_next", (F, [2])), ("y", (F, [2]))])
# stops after its third iteration (iter < 2); s' = s * cap0 + sin(s), y = exp(s')
_LOOP_STOPS = _body("loop_stops", [helper.make_node("Less", ["iter", "two"], ["cond_out"]),
                                   helper.make_node("Mul", ["s", "cap0"], ["sc"]),
                                   helper.make_node("Sin", ["s"], ["ss"]),
                                   helper.make_node("Add", ["sc", "ss"], ["s_next"]),
                                   helper.make_node("Exp", ["s_next"], ["y"])],
                    [*_LOOP_IO, ("s", (F, [2]))], [("cond_out", (B, [])), ("s_next", (F, [2])), ("y", (F, [2]))])
_LOOP_STOPS.initializer.append(helper.make_tensor("two", TensorProto.INT64, [], [2]))
# two states, the second passed through unchanged: a' = a * b + cap0, b' = b; no scan output
_LOOP_PASS = _body("loop_pass", [helper.make_node("Mul", ["a", "b"], ["ab"]),
                                 helper.make_node("Add", ["ab", "cap0"], ["a_next"])],
                   [*_LOOP_IO, ("a", (F, [3])), ("b", (F, [3]))],
                   [("cond", (B, [])), ("a_next", (F, [3])), ("b", (F, [3]))])

ROWS += [
    Case("Loop", [C(np.array(3, np.int64)), None, I(2)], attrs={"body": _LOOP_TANH}, outputs=2, captured=[I(2)],
         opsets=(11, 23), id="Loop-trip-count"),
    Case("Loop", [C(np.array(6, np.int64)), C(np.array(True)), I(2)], attrs={"body": _LOOP_STOPS}, outputs=2,
         captured=[I(2)], opsets=(11, 23), id="Loop-stops-early"),
    Case("Loop", [C(np.array(3, np.int64)), C(np.array(True)), I(3), I(3)], attrs={"body": _LOOP_PASS}, outputs=2,
         captured=[I(3)], opsets=(11, 23), id="Loop-state-passed-through"),
]
