"""Reducing scatters written so that onnxruntime computes them exactly.

onnxruntime's CPU ``ScatterND`` splits its index rows over the session's intra-op threads and,
with a ``reduction``, reads, combines and writes each target row without guarding rows that
name the same position: where indices repeat and the session has more than one thread, some
updates are lost, differently from run to run (an embedding's gradient over a batch of
repeated tokens came out 5-40% off; microsoft/onnxruntime issue 18048). Its ``ScatterElements``
kernel walks the updates in one thread and is exact. So a reducing ``ScatterND`` is written as
a ``ScatterElements`` along the first axis of a ``[rows, slice]`` view of its data, the rows
being the positions its index tuples name (:func:`scatter_nd_by_elements`); gradient rules
add with ``ScatterElements`` directly, or sort (an embedding's rows: autodiff/rules/index.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

_INT64_MAX = int(np.iinfo(np.int64).max)

AddNode = Callable[..., ir.Value]  # add(op_type, inputs, attributes) -> the node's output


def scatter_nd_by_elements(add: AddNode, data: ir.Value, indices: ir.Value, updates: ir.Value, reduction: str,
                           depth: int) -> ir.Value:
    """What ``ScatterND(data, indices, updates, reduction=reduction)`` computes, as a
    ``ScatterElements`` (module docstring); ``depth`` is the static last dim of ``indices``, the
    number of leading data dims an index tuple names. ``add`` makes a node (``NewNodes.add``,
    ``GraphBuilder.add_node``). Needs opset 16 (18 for max/min), as the reducing ScatterND does."""

    def ints(values) -> ir.Value:
        return add("Constant", [], {"value": ir.tensor(np.asarray(values, np.int64))})

    shape = add("Shape", [data])
    flat = None  # the row each index tuple names, counted over the first ``depth`` dims
    for j in range(depth):
        size = add("Gather", [shape, ints(j)], {"axis": 0})
        coord = add("Gather", [indices, ints(j)], {"axis": -1})
        coord = add("Where", [add("Less", [coord, ints(0)]), add("Add", [coord, size]), coord])
        flat = coord if flat is None else add("Add", [add("Mul", [flat, size]), coord])
    rows = add("ReduceProd", [add("Slice", [shape, ints([0]), ints([depth])])], {"keepdims": 1})
    row_size = add("ReduceProd", [add("Slice", [shape, ints([depth]), ints([_INT64_MAX])])], {"keepdims": 1})
    update_view = add("Concat", [add("Reshape", [add("Size", [flat]), ints([1])]), row_size], {"axis": 0})
    index = add("Expand", [add("Reshape", [flat, ints([-1, 1])]), update_view])
    scattered = add("ScatterElements", [add("Reshape", [data, add("Concat", [rows, row_size], {"axis": 0})],
                                            {"allowzero": 1}),
                                        index, add("Reshape", [updates, update_view], {"allowzero": 1})],
                    {"axis": 0, "reduction": reduction})
    return add("Reshape", [scattered, shape], {"allowzero": 1})
