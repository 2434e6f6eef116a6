"""A Dropout that drops everything, written as onnxruntime can run it (training models only).

ONNX allows a Dropout ``ratio`` of 1 (every element dropped); onnxruntime's kernel takes ratios
in ``[0, 1)`` only and fails the run on 1 ("ratio must be in the range [0, 1)"), and the
gradient rule's ``dy * mask / (1 - ratio)`` would be ``0 / 0``. PyTorch's ``dropout(p=1)`` in
training returns ``input * 0`` (NaN where the input is not finite) and a zero gradient. This pass
writes each training-mode Dropout whose ratio is a constant of at least 1 as

    output = input * 0        mask = all False (ConstantOfShape)

whose gradient is zero. The ratio and ``training_mode`` must be constants: a ratio computed at run
time reaches onnxruntime's kernel as it is. It runs on the training model only, after the eval
model was copied (an eval model's Dropout is the identity whatever its ratio). ORTModule's
exports translate ``aten.native_dropout`` the same way (torch/_translations.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, constant_maker, hand_over


def _constant_input(node: ir.Node, index: int) -> np.ndarray | None:
    value = node.inputs[index] if len(node.inputs) > index else None
    tensor = get_const_tensor(value) if value is not None else None
    return None if tensor is None else np.asarray(tensor.numpy())


class FullDropoutPass(NodeRewritePass):
    """Write every training-mode Dropout of constant ratio >= 1 as ``input * 0`` and an all-False
    mask (module docstring)."""

    def match(self, node: ir.Node, opset: int) -> bool | None:
        if not is_onnx_op(node, "Dropout") or node.inputs[0] is None:
            return None
        ratio, training = _constant_input(node, 1), _constant_input(node, 2)
        if ratio is None or training is None or ratio.size != 1 or training.size != 1:
            return None
        return True if bool(training.reshape(-1)[0]) and float(ratio.reshape(-1)[0]) >= 1 else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: bool) -> None:
        x = node.inputs[0]
        new = NewNodes(node, "full_dropout")
        zero = constant_maker(new.add, x.dtype.numpy() if x.dtype is not None else np.float32)(0)
        replacements = [new.add("Mul", [x, zero])]
        if len(node.outputs) > 1:
            replacements.append(new.add("ConstantOfShape", [new.add("Shape", [x])],
                                        {"value": ir.tensor(np.zeros([1], np.bool_))}))
        for old, replacement in zip(node.outputs, replacements):
            replacement.type, replacement.shape = old.type, old.shape
        graph.insert_before(node, new.nodes)
        for old, replacement in zip(node.outputs, replacements):
            hand_over(graph, old, replacement, "dropped")
        graph.remove(node, safe=True)
