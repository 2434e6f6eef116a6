"""Dead-node removal: onnx_ir's ``RemoveUnusedNodesPass`` after one batch removal of the main
graph's dead nodes.

onnx_ir's pass removes each dead node with its own ``Graph.remove(node, safe=True)``, and each
such call builds a set of the graph's outputs: quadratic where a graph has many outputs and many
dead nodes. A forward graph cut out of a joint one (passes/partition.py) has both: every saved
activation is an output, and the backward's nodes are dead. RWKV's (a 128-step recurrence
unrolled over 4 layers, ~70k dead nodes) spent ~100 of its first step's ~400 s (profiled) there.
Here the main graph's dead nodes (read by nothing, or only by other dead nodes, and not graph
outputs) are found in one reverse walk and removed in one call; onnx_ir's pass then does the
rest as before (subgraphs, unused optional outputs, trailing empty inputs).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass as _OnnxIrRemoveUnusedNodesPass


class RemoveUnusedNodesPass(ir.passes.InPlacePass):
    """Remove the nodes whose outputs nothing reads (module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = frozenset(graph.outputs)
        dead: set[ir.Node] = set()
        for node in reversed(graph):
            if all(value not in outputs and all(use.node in dead for use in value.uses()) for value in node.outputs):
                dead.add(node)
        if dead:
            graph.remove(dead, safe=True)
        modified = _OnnxIrRemoveUnusedNodesPass()(model).modified
        return ir.passes.PassResult(model, bool(dead) or modified)
