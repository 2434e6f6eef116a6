"""A training-mode Dropout whose mask nothing reads, kept by every onnxruntime (training models).

onnxruntime's ``EliminateDropout`` rewrite removes any Dropout whose ``mask`` output nothing
reads, as if the session were inference, whatever its ``training_mode``. In a training model
the gradient's rule reads the mask, unless no gradient passes through the Dropout: behind a
frozen feature extractor (a new head trained on top, the personalization recipe) the training
step then ran without dropping anything, in every runtime (ORTModule disables the rewrite for its
own sessions; a training model's file must hold in onnxruntime-web and mobile too). This pass
makes such a mask read, at the cost of one elementwise select per step:

    output, mask = Dropout(input, ratio, training_mode)     output' = Where(mask, output, 0)

``output'`` is ``output`` (dropped elements are 0 already). A Dropout whose ratio is a constant 0
(nothing dropped) or whose ``training_mode`` is a constant false is left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.full_dropout import _constant_input
from onnxtrain.passes.rewrite import NodeRewritePass, constant_maker, hand_over


def _constant_scalar(node: ir.Node, index: int) -> float | None:
    array = _constant_input(node, index)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


class KeptDropoutPass(NodeRewritePass):
    """Make every training-mode Dropout's mask read (module docstring)."""

    def match(self, node: ir.Node, opset: int) -> bool | None:
        if not is_onnx_op(node, "Dropout") or node.inputs[0] is None or len(node.inputs) < 3 \
                or node.inputs[2] is None:
            return None  # no training_mode input: an inference Dropout (opset 12+)
        if _constant_scalar(node, 2) == 0 or _constant_scalar(node, 1) == 0:
            return None
        mask = node.outputs[1] if len(node.outputs) > 1 else None
        return True if mask is None or not mask.uses() and not mask.is_graph_output() else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: bool) -> None:
        new = NewNodes(node, "kept_dropout")
        dropout = ir.node("Dropout", list(node.inputs), {name: attr.value for name, attr in node.attributes.items()},
                          num_outputs=2, name=node.name)
        output, mask = dropout.outputs
        output.type, output.shape = node.outputs[0].type, node.outputs[0].shape
        mask.type, mask.shape = ir.TensorType(ir.DataType.BOOL), node.outputs[0].shape
        zero = constant_maker(new.add, output.dtype.numpy() if output.dtype is not None else np.float32)(0)
        kept = new.add("Where", [mask, output, zero])
        kept.type, kept.shape = output.type, output.shape
        graph.insert_before(node, [dropout, *new.nodes])
        hand_over(graph, node.outputs[0], kept, "dropped")
        graph.remove(node, safe=True)
