"""Reducing ``ScatterND`` nodes written as ``ScatterElements``, which onnxruntime computes exactly.

onnxruntime's CPU ``ScatterND`` kernel loses updates to repeated positions when its session has
more than one thread (:mod:`onnxtrain.ir.scatter`): a model's own ``index_put(...,
accumulate=True)`` or ``scatter_reduce`` exported as a reducing ScatterND, an ``EmbeddingBag``
(its translation gathers rows into bags with one), or a gradient built before this was known.
This pass rewrites every ``ScatterND`` with a ``reduction`` (add, mul, max, min) of the main
graph into :func:`~onnxtrain.ir.scatter.scatter_nd_by_elements`. A ScatterND without reduction
is left alone (where its indices repeat, ONNX leaves the result undefined anyway), and so is one
whose index tuple length is not static.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.ir.scatter import scatter_nd_by_elements
from onnxtrain.passes.rewrite import NodeRewritePass, hand_over


class ReducingScatterNDPass(NodeRewritePass):
    """Rewrite every reducing ``ScatterND`` into an exact ``ScatterElements`` (module docstring)."""

    def match(self, node: ir.Node, opset: int) -> int | None:
        if not is_onnx_op(node, "ScatterND") or node.attributes.get_string("reduction", "none") == "none":
            return None
        indices = node.inputs[1]
        depth = indices.shape[-1] if indices.shape is not None and len(indices.shape) else None
        return depth if isinstance(depth, int) and depth >= 1 else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: int) -> None:
        nodes = NewNodes(node, "by_elements")
        data, indices, updates = node.inputs
        out = scatter_nd_by_elements(nodes.add, data, indices, updates,
                                     node.attributes.get_string("reduction"), plan)
        old = node.outputs[0]
        out.type, out.shape = old.type, old.shape
        graph.insert_before(node, nodes.nodes)
        hand_over(graph, old, out, "scatter_nd")
        graph.remove(node, safe=True)
