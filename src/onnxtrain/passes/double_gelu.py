"""Write a float64 tanh-approximate Gelu as the primitive ops of its definition, in float64.

onnxruntime's float64 ``Gelu(approximate="tanh")`` kernel is accurate to ~1e-9 only (its
constants are float32), where PyTorch's float64 GELU, and onnxruntime's float64 Tanh, are
exact to rounding: a float64 model (``.double()``, a gradient check, a precision hunt) would
see float32-grade activations. This pass rewrites it as

    Y = 0.5 * X * (1 + Tanh(sqrt(2 / pi) * (X + 0.044715 * X^3)))

in float64 (standard ops; the gradient then flows through the primitives' rules). The exact
``Gelu`` (``approximate="none"``) needs ``Erf``, which onnxruntime has no float64 kernel for,
and float32 and lower keep the fused op.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, constant_maker

_CUBIC = 0.044715


def _approximate(node: ir.Node) -> str:
    attr = node.attributes.get("approximate")
    value = attr.value if attr is not None else "none"
    return value.decode() if isinstance(value, bytes) else value


class DoubleTanhGeluPass(NodeRewritePass):
    """Rewrite a float64 ``Gelu(approximate="tanh")`` as float64 primitive ops."""

    def match(self, node: ir.Node, opset: int) -> bool | None:
        if not is_onnx_op(node, "Gelu") or not node.inputs or node.inputs[0] is None:
            return None
        return True if node.inputs[0].dtype == ir.DataType.DOUBLE and _approximate(node) == "tanh" else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: bool) -> None:
        x = node.inputs[0]
        new_nodes = NewNodes(node, "gelu")
        add = new_nodes.add
        constant = constant_maker(add, np.float64)
        cube = add("Mul", [add("Mul", [x, x]), x])
        inner = add("Mul", [add("Add", [x, add("Mul", [cube, constant(_CUBIC)])]), constant(math.sqrt(2 / math.pi))])
        y = add("Mul", [add("Mul", [x, constant(0.5)]), add("Add", [add("Tanh", [inner]), constant(1.0)])])
        y.type, y.shape = node.outputs[0].type, node.outputs[0].shape
        replace_nodes_and_values(graph, node, [node], new_nodes.nodes, [node.outputs[0]], [y])
