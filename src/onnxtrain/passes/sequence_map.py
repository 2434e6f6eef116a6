"""``SequenceAt`` of a ``SequenceMap`` over a ``SequenceConstruct``, written as the map's body on
that one element.

The dynamo exporter writes ``torch.atleast_1d/2d/3d`` of several tensors (and so ``torch.hstack``,
``vstack``, ``dstack`` and ``column_stack``, which call them) as a sequence of the tensors, a
``SequenceMap`` whose body reshapes one, and a ``SequenceAt`` per result. Sequences have no
gradient rules, so such a model could not train. Where the index of a ``SequenceAt`` is a
constant and every sequence the map reads is a ``SequenceConstruct``, this pass clones the body
for that element in front of the ``SequenceAt`` and hands its output over; the sequence nodes
left unread are removed by dead-code elimination.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, hand_over


def _constant_index(value: ir.Value) -> int | None:
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return int(tensor.numpy().reshape(()))


def _element(value: ir.Value, index: int) -> ir.Value | None:
    """``value``'s ``index``-th element where it is a ``SequenceConstruct``'s; a tensor as it is;
    None for another sequence (or a value of unknown type)."""
    construct = value.producer()
    if construct is not None and is_onnx_op(construct, "SequenceConstruct"):
        count = len(construct.inputs)
        return construct.inputs[index] if -count <= index < count else None
    return value if isinstance(value.type, ir.TensorType) else None


class SequenceMapAtPass(NodeRewritePass):
    """Write each constant-index ``SequenceAt`` of a ``SequenceMap`` as the map's body on that
    element (module docstring)."""

    def match(self, node: ir.Node, opset: int) -> tuple[list[ir.Value], int] | None:
        if not is_onnx_op(node, "SequenceAt"):
            return None
        index = _constant_index(node.inputs[1])
        mapped = node.inputs[0].producer()
        if index is None or mapped is None or not is_onnx_op(mapped, "SequenceMap"):
            return None
        position = mapped.outputs.index(node.inputs[0])
        elements = [_element(value, index) for value in mapped.inputs]
        if any(element is None for element in elements):
            return None
        return elements, position

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: tuple[list[ir.Value], int]) -> None:
        elements, position = plan
        body = node.inputs[0].producer().attributes["body"].as_graph().clone(allow_outer_scope_values=True)
        for inner, element in zip(body.inputs, elements):
            for usage in list(inner.uses()):
                usage.node.replace_input_with(usage.idx, element)
        result = body.outputs[position]
        if result in body.inputs:  # a body that returns its element as it is
            result = elements[body.inputs.index(result)]
        clones = list(body)
        body.outputs.clear()  # a value may be the output of one graph only
        body.remove(clones)
        prefix = f"{node.name or node.outputs[0].name}/body"
        for clone in clones:
            clone.name = f"{prefix}/{clone.name}"
            for out in clone.outputs:
                out.name = f"{prefix}/{out.name}"
        graph.insert_before(node, clones)
        if result.shape is None:
            result.type, result.shape = node.outputs[0].type, node.outputs[0].shape
        hand_over(graph, node.outputs[0], result, "sequence_at")
        graph.remove(node, safe=True)
