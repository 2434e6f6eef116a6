"""Values of a static shape with a zero-sized dim read an empty constant instead.

Such a value holds no elements: whatever computes it, its content is the same. A graph exported
for an empty batch (ORTModule keeps a size of 0 static) has many of them, and onnxruntime's
optimizer mishandles some: it drops an ``Expand`` from ``[1, 5]`` to ``[0, 5]`` as a no-op (so the
gradient of a sum over an empty batch came back as ``[1, 5]``), and its shape inference refuses
a ``Reshape`` whose target holds a 0 without ``allowzero`` (gradients of gathers, pixel shuffles
and resizes). Replacing each such value by a constant of its shape, its producer then dropped
where nothing else reads it, leaves onnxruntime nothing to get wrong. Graph outputs keep their
names (an ``Identity`` of the constant). Values of symbolic or unknown shape are left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes.dce import RemoveUnusedNodesPass


def _empty_shape(value: ir.Value) -> tuple[int, ...] | None:
    """``value``'s shape where it is static and holds a 0, its dtype known; else None."""
    if not isinstance(value.type, ir.TensorType) or value.dtype is None or value.shape is None:
        return None
    dims = tuple(value.shape)
    if not all(isinstance(d, int) for d in dims) or 0 not in dims:
        return None
    return dims


class EmptyTensorsPass(ir.passes.InPlacePass):
    """Uses of a value with a static zero-sized dim (module docstring) read an empty constant."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for value in [*graph.inputs, *(o for node in graph for o in node.outputs)]:
            producer = value.producer()
            if producer is not None and is_onnx_op(producer, "Constant"):
                continue
            shape = _empty_shape(value)
            if shape is None or (not value.uses() and not value.is_graph_output()):
                continue
            empty = ir.node("Constant", [], attributes={"value": ir.tensor(np.zeros(shape, value.dtype.numpy()))},
                            name=f"{value.name}.empty")
            empty.outputs[0].name = f"{value.name}.empty"
            empty.outputs[0].type, empty.outputs[0].shape = ir.TensorType(value.dtype), ir.Shape(shape)
            first = producer if producer is not None else (next(iter(graph), None))
            if first is None:
                graph.append(empty)
            else:
                graph.insert_before(first, empty)
            if value.is_graph_output():  # an Identity of the constant takes its place and name
                kept = ir.node("Identity", [empty.outputs[0]], name=f"{value.name}.identity")
                graph.insert_after(empty, kept)
                name = value.name
                value.name = f"{name}.replaced"
                kept.outputs[0].name = name
                kept.outputs[0].type, kept.outputs[0].shape = ir.TensorType(value.dtype), ir.Shape(shape)
                for i in [i for i, o in enumerate(graph.outputs) if o is value]:
                    graph.outputs[i] = kept.outputs[0]
            value.replace_all_uses_with(empty.outputs[0])
            modified = True
        if modified:
            RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified)
