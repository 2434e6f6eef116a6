"""Large constant fills made at run time, not folded by onnxruntime into initializers.

A gradient graph fills buffers with zeros to scatter into: an embedding's gradient is a
``ScatterElements`` into ``ConstantOfShape([vocab, hidden])``. Its shape is a constant, so
onnxruntime's constant folding (which has no size limit) computes the fill when the session is
created and keeps it as an initializer for the session's lifetime: 31 MB for a BERT vocabulary
of 30522 x 256, 47 MB at MiniLM's 384, and every run copies it into the scatter's output
(an initializer is read-only, so the scatter cannot work in place in it).

This pass makes such a fill's shape depend on a value onnxruntime cannot fold, a run-time zero:
``Cast(Greater(RandomUniform([1], 0, 1), 2))`` (random ops are never folded; a draw from
[0, 1] is never above 2, so the zero is exact whatever the draw), added to the shape. The fill
then happens in each run, in the session's arena, where a scatter that reads it last can write
in place and its bytes are free again once it has run.

For sessions this process creates (:mod:`onnxtrain.runtime.fusions`); the artifacts on disk keep
their plain ``ConstantOfShape``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor

from onnxtrain.ir.nodes import is_onnx_op

# fills from this size on are made at run time; smaller ones stay foldable (a few run-time
# nodes each would cost more than the bytes they save)
DEFAULT_MIN_BYTES = 1 << 20
_DEFAULT_FILL_DTYPE = ir.DataType.FLOAT  # ConstantOfShape without a value attribute


def _fill_bytes(node: ir.Node) -> int | None:
    """The bytes ``node`` (a ConstantOfShape) fills when its shape input is a constant, else None."""
    shape = get_const_tensor(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
    if shape is None:
        return None
    value = node.attributes.get("value")
    dtype = value.value.dtype if value is not None else _DEFAULT_FILL_DTYPE
    return int(np.prod(np.asarray(shape.numpy()).reshape(-1), dtype=np.int64)) * dtype.itemsize


class RuntimeFillPass(ir.passes.InPlacePass):
    """Give every ``ConstantOfShape`` of the main graph with a constant shape of at least
    ``min_bytes`` a shape onnxruntime computes at run time (the same shape)."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES):
        super().__init__()
        self.min_bytes = min_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        fills = [node for node in graph if is_onnx_op(node, "ConstantOfShape")
                 and (_fill_bytes(node) or 0) >= self.min_bytes]
        if not fills:
            return ir.passes.PassResult(model, False)
        zero = self._runtime_zero(graph)
        for node in fills:
            shape = ir.node("Add", [node.inputs[0], zero], name=f"{node.name or node.outputs[0].name}/runtime_shape")
            shape.outputs[0].name = f"{node.outputs[0].name}/runtime_shape"
            shape.outputs[0].dtype = ir.DataType.INT64
            graph.insert_before(node, shape)
            node.replace_input_with(0, shape.outputs[0])
        return ir.passes.PassResult(model, True)

    @staticmethod
    def _runtime_zero(graph: ir.Graph) -> ir.Value:
        """``[0]`` (int64) computed at the start of every run."""
        draw = ir.node("RandomUniform", [], attributes={"shape": [1], "low": 0.0, "high": 1.0,
                                                        "dtype": int(ir.DataType.FLOAT)},
                       name="runtime_fill/draw")
        above = ir.node("Greater", [draw.outputs[0], ir.Value(name="runtime_fill/two",
                                                                const_value=ir.tensor(np.array([2.0], np.float32)))],
                        name="runtime_fill/above")
        zero = ir.node("Cast", [above.outputs[0]], attributes={"to": int(ir.DataType.INT64)}, name="runtime_fill/zero")
        for n, name in ((draw, "draw"), (above, "above"), (zero, "zero")):
            n.outputs[0].name = f"runtime_fill/{name}"
        graph.register_initializer(above.inputs[1])
        graph.insert_before(graph.node(0), [draw, above, zero])  # the graph has a fill: never empty
        return zero.outputs[0]
