"""A transposed matrix times a vector, as a product with a one-column matrix.

onnxruntime (1.32, CPU, optimization level 2 and up) fuses ``MatMul(Transpose(A), v)``, the
transpose swapping A's last two axes, into ``com.microsoft.FusedMatMul(A, v, transA=1)``, and
that kernel computes a wrong result when ``v`` is 1-D: ``W.T @ u`` of a ``[3, 4]`` W comes out
off by units, silently (the same graph is right with optimizations off). PyTorch code writes it
as ``torch.mv(W.T, u)``, ``W.H @ u`` (spectral normalization's power iteration), ``x.mT @ v``;
gradient rules may too. This pass writes such a product as
``Squeeze(MatMul(Transpose(A), Unsqueeze(v, -1)), -1)``: the same values (the reshapes are views),
and with a ``[K, 1]`` column the fused kernel is right. Standard ops, so artifacts keep running
on any onnxruntime, where the same fusion would meet the same kernel.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass

_AXES_INPUT_OPSET = 13  # Unsqueeze/Squeeze take their axes as an input from opset 13 on


def _swaps_last_two(node: ir.Node | None) -> bool:
    if not is_onnx_op(node, "Transpose"):
        return False
    perm = node.attributes.get("perm")
    if perm is None:  # reverses all axes: swaps the last two only for a 2-D input
        x = node.inputs[0]
        return x.shape is not None and len(x.shape) == 2
    perm = list(perm.value)
    return len(perm) >= 2 and perm[-2:] == [len(perm) - 1, len(perm) - 2]


class ColumnVectorProductPass(NodeRewritePass):
    """Rewrite ``MatMul(Transpose(A), v)`` with a 1-D ``v`` as a product with the column ``[K, 1]``."""

    def match(self, node: ir.Node, opset: int) -> bool | None:
        if not is_onnx_op(node, "MatMul") or len(node.inputs) != 2 or None in node.inputs:
            return None
        matrix, vector = node.inputs
        if vector.shape is None or len(vector.shape) != 1 or not _swaps_last_two(matrix.producer()):
            return None
        return opset >= _AXES_INPUT_OPSET

    def rewrite(self, graph: ir.Graph, node: ir.Node, axes_as_input: bool) -> None:
        matrix, vector = node.inputs
        new = NewNodes(node, "column")
        last = [-1]
        if axes_as_input:
            axes = new.add("Constant", [], attributes={"value": ir.tensor(last, dtype=ir.DataType.INT64)})
            column = new.add("Unsqueeze", [vector, axes])
            product = new.add("MatMul", [matrix, column])
            out = new.add("Squeeze", [product, axes])
        else:
            column = new.add("Unsqueeze", [vector], attributes={"axes": last})
            product = new.add("MatMul", [matrix, column])
            out = new.add("Squeeze", [product], attributes={"axes": last})
        old = node.outputs[0]
        out.dtype, out.shape = old.dtype, old.shape
        replace_nodes_and_values(graph, node, [node], new.nodes, [old], [out])
