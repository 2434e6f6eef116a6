"""Scatters that accumulate low-precision values do it in float32.

The gradients of gathers, embeddings, pools and a few losses add the incoming gradient into place
with ``ScatterND`` / ``ScatterElements`` of ``reduction="add"``. onnxruntime's CPU kernels have
no float16 or bfloat16 reduction ("MLFloat16 data type is not supported with ScatterND opset 16
when reduction is 'add'"), so a float16 model's training step failed; and where a kernel exists,
a sum of many float16 terms loses the small ones. This pass casts the data and the updates of
every reducing scatter of float16/bfloat16 values to float32 and the result back::

    ScatterND(data, indices, updates, reduction="add")
    -> Cast(ScatterND(Cast(data, float), indices, Cast(updates, float), reduction="add"), float16)

(the data is usually zeros, the updates the gradient). Standard ops only; float32 and float64
scatters are left as they are. It runs after autodiff on every training graph.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, hand_over

_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_SCATTERS = ("ScatterND", "ScatterElements")


class FloatAccumulationPass(NodeRewritePass):
    """Run every reducing ``ScatterND`` / ``ScatterElements`` of float16 or bfloat16 data in
    float32 (module docstring)."""

    def match(self, node: ir.Node, opset: int) -> ir.DataType | None:
        if not is_onnx_op(node, *_SCATTERS) or node.attributes.get_string("reduction", "none") == "none":
            return None
        dtype = node.inputs[0].dtype if node.inputs[0] is not None else None
        return dtype if dtype in _LOW else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: ir.DataType) -> None:
        before, after = NewNodes(node, "float_accumulation"), NewNodes(node, "float_accumulation_out")
        for index in (0, 2):  # data, updates
            node.replace_input_with(index, before.add("Cast", [node.inputs[index]], {"to": int(ir.DataType.FLOAT)}))
        out = node.outputs[0]
        low = after.add("Cast", [out], {"to": int(plan)})
        low.shape = out.shape
        out.type = ir.TensorType(ir.DataType.FLOAT)  # a new type object: ``out.dtype = ...`` edits a shared one
        graph.insert_before(node, before.nodes)
        graph.insert_after(node, after.nodes)
        hand_over(graph, out, low, "float")
