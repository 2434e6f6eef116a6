"""Switch training-mode ops to inference behaviour (for eval and inference models).

Exporters in training mode emit Dropout with ``training_mode`` true and
BatchNormalization with ``training_mode=1`` (batch statistics). An eval model must
evaluate, so Dropout becomes the identity and BatchNormalization uses its running
statistics.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.ir.nodes import is_onnx_op


class InferenceModePass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in model.graph:
            if not is_onnx_op(node):
                continue
            if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
                node.replace_input_with(2, None)  # no training_mode input: inference (identity)
                modified = True
            elif node.op_type == "BatchNormalization" and (
                    _int_attr(node, "training_mode") == 1 or (model.graph.opset_imports.get("", 0) < 14
                                                             and len(node.outputs) > 1)):
                if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
                    continue  # the running statistics are used: leave the node as it is
                node.attributes.pop("training_mode", None)
                node.resize_outputs(1)
                modified = True
        return ir.passes.PassResult(model, modified)


def _int_attr(node: ir.Node, name: str) -> int | None:
    attr = node.attributes.get(name)
    return None if attr is None else attr.value
