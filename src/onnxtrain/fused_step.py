"""The fused training step: forward, backward and optimizer update as one graph.

A training step of the artifacts is two session runs: the training model writes the
accumulated gradients, the optimizer model reads them back and writes the new parameters.
When no gradient accumulation is asked for (the step starts from ``lazy_reset_grad``),
both fit in one graph: the training model with ``lazy_reset_grad`` fixed to true (its
gradient outputs are then the raw gradients: no accumulation branch, no copy) followed by
the optimizer model reading those gradients directly. One run then does the whole step,
and ONNX Runtime plans the memory of gradients and updates together.

Inputs of the fused model: the training model's inputs without the accumulation buffers
and ``lazy_reset_grad``, then the optimizer model's inputs that the training model does
not already provide (``learning_rate``, ``step``, the optimizer states, the loss-scale
growth tracker). Outputs: the training model's outputs (the gradient outputs keep their
``<p>_grad.accumulation.out`` names and hold this batch's gradients), then the optimizer
model's outputs. :mod:`onnxtrain.api` builds it at run time from the artifacts' files.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxtrain import names
from onnxtrain.errors import ModelError
from onnxtrain.ir.nodes import is_onnx_op
from onnxtrain.passes.dce import RemoveUnusedNodesPass

# prefix for the optimizer model's internal value and node names inside the fused graph
_OPTIMIZER_SCOPE = "optimizer/"


def build_fused_step_model(training: ir.Model, optimizer: ir.Model) -> ir.Model:
    """Join ``training`` and ``optimizer`` (both consumed) into one fused training-step model.

    Raises ModelError when the two models do not follow the artifact contract
    (docs/artifacts.md) closely enough to be joined.
    """
    _check_opsets(training, optimizer)
    graph = training.graph
    _fix_reset_to_true(graph)
    RemoveUnusedNodesPass()(training)  # the accumulating side (buffer + grad) is dead now
    _drop_accumulation_buffers(graph)

    train_values = {v.name: v for v in graph.inputs}
    grad_outputs = {v.name: v for v in graph.outputs if v.name.endswith(names.ACCUMULATION_OUT_SUFFIX)}
    opt_graph = optimizer.graph
    new_inputs = []
    for value in list(opt_graph.inputs):
        source = train_values.get(value.name)
        if source is None and value.name.endswith(names.GRAD_SUFFIX):
            param = value.name[: -len(names.GRAD_SUFFIX)]
            source = grad_outputs.get(names.accumulation_out_name(param))
        if source is not None:
            value.replace_all_uses_with(source)
        else:
            new_inputs.append(value)
    opt_outputs = list(opt_graph.outputs)
    taken = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    for node in list(opt_graph):
        opt_graph.remove(node, safe=False)
        _rename_into_scope(node)
        graph.append(node)
    opt_graph.inputs.clear()
    opt_graph.outputs.clear()
    graph.inputs.extend(new_inputs)
    for value in opt_outputs:
        if value.is_graph_input() or value.name in taken:
            raise ModelError(f"optimizer model output {value.name!r} clashes with a training model value")
        graph.outputs.append(value)
    for domain, version in optimizer.opset_imports.items():
        training.opset_imports.setdefault(domain, version)
    for key, text in optimizer.metadata_props.items():
        training.metadata_props.setdefault(key, text)
    graph.name = "fused training step"
    return training


def _fix_reset_to_true(graph: ir.Graph) -> None:
    """Take the "fresh gradients" side of every If or Where on ``lazy_reset_grad``."""
    reset = next((v for v in graph.inputs if v.name == names.LAZY_RESET_GRAD), None)
    if reset is None:
        raise ModelError(f"the training model has no {names.LAZY_RESET_GRAD!r} input")
    users = [node for node, _ in reset.uses()]
    unknown = [n.name or n.op_type for n in users
               if not is_onnx_op(n, "If", "Where") or n.graph is not graph
               or n.inputs[0] is not reset]
    if unknown:
        raise ModelError(f"the training model uses {names.LAZY_RESET_GRAD!r} other than as the condition of a "
                         f"top-level If or Where (nodes {unknown[:4]}): its accumulation cannot be removed")
    for node in users:
        if node.op_type == "Where":
            _replace_output(graph, node.outputs[0], node.inputs[1])
        else:
            _inline_then_branch(graph, node)
        for inner in node.attributes["else_branch"].as_graph().all_nodes() if node.op_type == "If" else ():
            for i in range(len(inner.inputs)):  # let go of the accumulation buffers
                inner.replace_input_with(i, None)
        graph.remove(node, safe=True)
    graph.inputs.remove(reset)


def _inline_then_branch(graph: ir.Graph, node: ir.Node) -> None:
    branch = node.attributes["then_branch"].as_graph()
    for inner in list(branch):
        branch.remove(inner, safe=False)
        graph.insert_before(node, inner)
    inner_outputs = list(branch.outputs)
    branch.outputs.clear()
    for out, inner_out in zip(node.outputs, inner_outputs):
        _replace_output(graph, out, _skip_identity(graph, inner_out))


def _skip_identity(graph: ir.Graph, value: ir.Value) -> ir.Value:
    """The input of the Identity that produces ``value`` (the branch's copy), when that is free to take its name."""
    node = value.producer()
    if node is None or node.op_type != "Identity" or value.uses():
        return value
    source = node.inputs[0]
    if source is None or source.is_graph_input() or source.is_graph_output() or source.is_initializer():
        return value
    graph.remove(node, safe=True)
    return source


def _replace_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Make ``new`` take ``old``'s place: its graph output slot, its uses and its name."""
    name = old.name
    if new.is_graph_output() or new.is_graph_input():  # one value cannot be two outputs
        copy = ir.node("Identity", [new], name=f"{name}/identity")
        graph.append(copy)
        new = copy.outputs[0]
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = None
    new.name = name
    new.type, new.shape = old.type, old.shape


def _drop_accumulation_buffers(graph: ir.Graph) -> None:
    for value in [v for v in graph.inputs if v.name.endswith(names.ACCUMULATION_BUFFER_SUFFIX)]:
        if value.uses():
            raise ModelError(f"the training model still reads {value.name!r} with accumulation off")
        graph.inputs.remove(value)


def _check_opsets(training: ir.Model, optimizer: ir.Model) -> None:
    for domain, version in optimizer.opset_imports.items():
        other = training.opset_imports.get(domain)
        if other is not None and other != version:
            raise ModelError(f"the training model imports opset {domain or 'ai.onnx'} {other} and the optimizer "
                             f"model {version}: they cannot share one graph")


def _rename_into_scope(node: ir.Node) -> None:
    """Give the optimizer's node, the nodes of its subgraphs and their values names that cannot
    clash; the optimizer's graph outputs keep theirs (they are the fused model's outputs)."""
    inner = [n for attr in node.attributes.values() if attr.type == ir.AttributeType.GRAPH
             for n in attr.as_graph().all_nodes()]
    for each in [node, *inner]:
        if each.name:
            each.name = _OPTIMIZER_SCOPE + each.name
        for out in each.outputs:
            if out.name and not (each is node and out.is_graph_output()):
                out.name = _OPTIMIZER_SCOPE + out.name
