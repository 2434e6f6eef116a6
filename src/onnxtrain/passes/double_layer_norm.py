"""Write a float64 LayerNormalization as the primitive ops of its definition, in float64.

ONNX's LayerNormalization keeps its statistics in ``stash_type``, float32 by default, and
onnxruntime has no kernel with float64 statistics: a float64 model (``.double()``, a gradient
check, a precision hunt) then trains with float32-accurate normalization (gradients ~1e-8
relative off). This pass rewrites

    Y, Mean, InvStdDev = LayerNormalization(X, Scale, B, axis=a, epsilon=e)

for a float64 ``X`` of known rank into ``Y = (X - mean) * inv_std * Scale + B`` over the axes
from ``a`` on, all in float64 (Mean and InvStdDev, where used, as float64 values). Standard ONNX
ops; the gradient then flows through the primitives' rules. float32 and lower keep the
LayerNormalization (and its hand-written gradient rule).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, constant_maker, mean_maker


class DoubleLayerNormPass(NodeRewritePass):
    """Rewrite a float64 ``LayerNormalization`` as float64 primitive ops."""

    def match(self, node: ir.Node, opset: int) -> int | None:
        if not is_onnx_op(node, "LayerNormalization") or not node.inputs:
            return None
        x = node.inputs[0]
        if x is None or x.dtype != ir.DataType.DOUBLE or x.shape is None or node.inputs[1] is None:
            return None
        return opset

    def rewrite(self, graph: ir.Graph, node: ir.Node, opset: int) -> None:
        x, scale = node.inputs[:2]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        rank = len(x.shape)
        axis = node.attributes.get("axis")
        axis = int(axis.value) if axis is not None else -1
        axes = list(range(axis % rank if rank else 0, rank))
        epsilon = node.attributes.get("epsilon")
        epsilon = float(epsilon.value) if epsilon is not None else 1e-5
        new_nodes = NewNodes(node, "layer_norm")
        add = new_nodes.add

        constant = constant_maker(add, np.float64)
        mean = mean_maker(add, axes, opset)

        x_mean = mean(x)
        centered = add("Sub", [x, x_mean])
        inv_std = add("Reciprocal", [add("Sqrt", [add("Add", [mean(add("Mul", [centered, centered])),
                                                               constant(epsilon)])])])
        y = add("Mul", [add("Mul", [centered, inv_std]), scale])
        if bias is not None:
            y = add("Add", [y, bias])
        y.type, y.shape = node.outputs[0].type, node.outputs[0].shape
        old, new = [node.outputs[0]], [y]
        for out, value in zip(node.outputs[1:], (x_mean, inv_std)):
            if out is not None and (out.uses() or out.is_graph_output()):
                value.dtype = ir.DataType.DOUBLE
                old.append(out)
                new.append(value)
        replace_nodes_and_values(graph, node, [node], new_nodes.nodes, old, new)
