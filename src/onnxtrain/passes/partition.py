"""Split a model into a forward graph and a backward graph for a framework's autograd.

One gradient graph is built over the whole model (the *joint* graph), cleaned, and then
cut in two: the forward graph computes the model's outputs plus the values the backward
graph needs (the *saved* activations); the backward graph takes the gradients of the
outputs, the saved values and the forward inputs it reads, and returns the gradients of
the requires-grad inputs. Everything crossing the cut is listed, so a caller (the torch
bridge) keeps exactly those tensors alive between the two runs and nothing else.

Nodes that do not depend on an output gradient but are only needed by the backward
graph run in the backward graph, from saved inputs: the forward graph computes what its
outputs need and nothing more (so, e.g., Tanh's ``1 - y*y`` is not stored as a second
activation next to ``y``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx_ir as ir

from onnxtrain import names
from onnxtrain.autodiff.builder import active_values, build_gradients, is_float
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.passes import pipeline

# Where a backward-graph input comes from.
FROM_OUTPUT_GRAD = "output_grad"      # the gradient of forward output i
FROM_FORWARD_OUTPUT = "forward_output"  # forward output i (a model output or a saved value)
FROM_INPUT = "input"                  # forward input i, as the caller passed it

# Ops that only move or relabel data: when such a node reads nothing but forward inputs
# and constants (a Linear layer's ``Transpose(weight)``), the backward graph recomputes
# it instead of receiving it as a saved value. That keeps no copy of the weights alive
# between the two runs, and leaves the forward's Transpose with one consumer, so ORT can
# fold it into the MatMul.
_RECOMPUTED_OPS = frozenset({"Constant", "Identity", "Transpose", "Reshape", "Unsqueeze",
                             "Squeeze", "Flatten", "Cast"})

# Cheap deterministic ops (one pass over their inputs) that the backward graph recomputes
# instead of receiving their output as a saved value, when every input they read is at hand
# in the backward anyway (saved for another node, a forward input, a constant, or itself
# recomputed): the saved activations shrink by that output and nothing else is kept alive.
# E.g. an attention's IsNaN mask and transposed heads, a GELU's output (its input is saved
# for its own gradient).
_MEMORY_RECOMPUTED_OPS = _RECOMPUTED_OPS | frozenset({
    "Gelu", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Erf",
    "IsNaN", "IsInf", "Not", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or",
    "Where", "Add", "Sub", "Mul", "Div", "Expand", "Slice", "Concat", "Split", "Shape", "Size",
})


@dataclass
class ForwardBackward:
    """The two graphs and the wiring between them.

    Attributes:
        forward: inputs are the model's inputs (same order); outputs are the model's
            outputs followed by the saved values.
        backward: outputs are the gradients of ``wrt`` (same order). Its inputs, in order,
            are described by ``backward_inputs``.
        num_model_outputs: how many of the forward outputs are the model's own.
        differentiable_outputs: indices of the model outputs that carry a gradient
            (floating point and depending on a requires-grad input).
        backward_inputs: for each backward input, ``(source, index)`` with source one of
            FROM_OUTPUT_GRAD (index into the model outputs), FROM_FORWARD_OUTPUT (index into
            the forward outputs) or FROM_INPUT (index into the forward inputs).
        wrt: names of the forward inputs whose gradients the backward graph returns.
    """

    forward: ir.Model
    backward: ir.Model
    num_model_outputs: int
    differentiable_outputs: list[int]
    backward_inputs: list[tuple[str, int]]
    wrt: list[str]
    saved: list[str] = field(default_factory=list)


def _distinct_outputs(graph: ir.Graph) -> None:
    """Give every graph output its own value that no node input aliases with a graph input.

    A model may return an input unchanged or one value twice; the cut below needs each
    output to be a distinct node output.
    """
    b = GraphBuilder(graph, scope="outputs")
    seen: set[ir.Value] = set()
    for i, out in enumerate(graph.outputs):
        if out in seen or out.is_graph_input() or out.is_initializer() or out.producer() is None:
            copy = b.op.Identity(out)
            copy.type, copy.shape = out.type, out.shape
            graph.outputs[i] = copy
            out = copy
        seen.add(out)


def _descendants(nodes: Sequence[ir.Node], roots: set[ir.Value]) -> set[ir.Node]:
    reached_values, reached = set(roots), set()
    for node in nodes:
        if any(i is not None and i in reached_values for i in node.inputs):
            reached.add(node)
            reached_values.update(node.outputs)
    return reached


def _ancestors(nodes: Sequence[ir.Node], targets: Sequence[ir.Value]) -> set[ir.Node]:
    wanted, result = set(targets), set()
    for node in reversed(nodes):
        if any(o in wanted for o in node.outputs):
            result.add(node)
            wanted.update(i for i in node.inputs if i is not None)
    return result


def build_forward_backward(model: ir.Model, wrt: Sequence[str],
                           no_grad_outputs: Sequence[int] = ()) -> ForwardBackward:
    """Build the gradient graph of ``model`` w.r.t. the graph inputs named ``wrt`` and cut it.

    Every floating-point output that depends on a ``wrt`` input receives an output gradient
    (the vector of the vector-Jacobian product), except the outputs indexed in
    ``no_grad_outputs`` (e.g. updated running statistics). ``model`` is consumed.
    """
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    unknown = [n for n in wrt if n not in inputs]
    if unknown:
        raise ValueError(f"{unknown} are not inputs of the model")
    wrt_values = [inputs[n] for n in wrt]
    forward_inputs = list(graph.inputs)
    _distinct_outputs(graph)
    model_outputs = list(graph.outputs)

    active = active_values(list(graph), wrt_values)
    differentiable = [i for i, o in enumerate(model_outputs)
                      if o in active and is_float(o) and i not in no_grad_outputs]
    b = GraphBuilder(graph, scope="")
    seeds = [b.input(names.grad_name(model_outputs[i].name), model_outputs[i].dtype,
                     model_outputs[i].shape) for i in differentiable]
    grads = build_gradients(graph, [model_outputs[i] for i in differentiable], wrt_values,
                            loss_grad=seeds, builder=b.child("grad")) if differentiable else {
        w: b.zeros_like(w) for w in wrt_values}

    grad_outputs = []
    for w in wrt_values:
        g = grads[w]
        if g.is_graph_input() or g in model_outputs or g in grad_outputs or g.producer() is None:
            g = b.op.Identity(g)
        g.name = names.grad_name(w.name) if names.grad_name(w.name) not in inputs else f"{w.name}.gradient"
        g.type, g.shape = w.type, w.shape
        grad_outputs.append(g)
    graph.outputs.extend(grad_outputs)
    pipeline.run(model, pipeline.after_autodiff())

    model_outputs = list(graph.outputs[: len(model_outputs)])
    grad_outputs = list(graph.outputs[len(model_outputs):])
    return _cut(model, forward_inputs, model_outputs, seeds, differentiable, grad_outputs, list(wrt))


def _cut(model, forward_inputs, model_outputs, seeds, differentiable, grad_outputs, wrt) -> ForwardBackward:
    graph = model.graph
    nodes = list(graph)
    after_seed = _descendants(nodes, set(seeds))
    forward_nodes = _ancestors(nodes, model_outputs)
    if forward_nodes & after_seed:
        raise AssertionError("a model output depends on an output gradient")
    recomputed = _recomputable(nodes, forward_nodes, set(forward_inputs))
    crossing = _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs)
    while True:  # recompute cheap nodes whose inputs cross anyway, until nothing changes
        more = _memory_recomputable(nodes, forward_nodes, recomputed, crossing, forward_inputs, model_outputs)
        if not more:
            break
        recomputed |= more
        crossing = _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs)
    forward_values = {o for n in forward_nodes - recomputed for o in n.outputs}

    saved = [v for v in crossing if v in forward_values and v not in model_outputs]
    forward_outputs = model_outputs + saved
    seed_index = {s: differentiable[k] for k, s in enumerate(seeds)}
    input_index = {v: k for k, v in enumerate(forward_inputs)}
    output_index = {v: k for k, v in enumerate(forward_outputs)}

    backward_inputs: list[tuple[str, int]] = []
    backward_sources: list[ir.Value] = []
    for value in [*seeds, *crossing]:
        if value in seed_index:
            backward_inputs.append((FROM_OUTPUT_GRAD, seed_index[value]))
        elif value in output_index:
            backward_inputs.append((FROM_FORWARD_OUTPUT, output_index[value]))
        else:
            backward_inputs.append((FROM_INPUT, input_index[value]))
        backward_sources.append(value)

    forward = _extract(model, [v.name for v in forward_inputs], [v.name for v in forward_outputs], cut=[])
    backward = _extract(model, [v.name for v in backward_sources], [g.name for g in grad_outputs],
                        cut=[v.name for v in backward_sources])
    # the backward graph may not read every output gradient (e.g. a linear output's
    # gradient is only needed for its shape): drop the inputs it does not use
    used = [i for i, v in enumerate(backward.graph.inputs) if v.uses() or v.is_graph_output()]
    backward_inputs = [backward_inputs[i] for i in used]
    kept = [backward.graph.inputs[i] for i in used]
    backward.graph.inputs.clear()
    backward.graph.inputs.extend(kept)
    return ForwardBackward(forward, backward, len(model_outputs), differentiable, backward_inputs, wrt,
                           saved=[v.name for v in saved])


def _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs) -> dict[ir.Value, None]:
    """Forward values (and forward inputs) that the backward graph reads, in node order."""
    backward_nodes = _ancestors(nodes, grad_outputs) - (forward_nodes - recomputed)
    forward_values = {o for n in forward_nodes - recomputed for o in n.outputs}
    inputs = set(forward_inputs)
    crossing: dict[ir.Value, None] = {}  # ordered set
    for node in nodes:
        if node in backward_nodes:
            crossing.update((i, None) for i in node.inputs if i is not None and (i in forward_values or i in inputs))
    crossing.update((g, None) for g in grad_outputs if g in forward_values or g in inputs)
    return crossing


def _memory_recomputable(nodes, forward_nodes, recomputed, crossing, forward_inputs, model_outputs) -> set[ir.Node]:
    """Saved values' producers (of ``_MEMORY_RECOMPUTED_OPS``) whose inputs all cross anyway."""
    at_hand = set(crossing) | set(forward_inputs) | {o for n in recomputed for o in n.outputs}
    outputs = set(model_outputs)
    result: set[ir.Node] = set()
    for node in nodes:
        if (node in forward_nodes and node not in recomputed and node.domain in ("", "ai.onnx")
                and node.op_type in _MEMORY_RECOMPUTED_OPS
                and any(o in crossing and o not in outputs for o in node.outputs)
                and (all(i is None or i in at_hand or i.is_initializer() for i in node.inputs)
                     or _widening_cast(node))):
            result.add(node)
            at_hand.update(node.outputs)
    return result


def _widening_cast(node: ir.Node) -> bool:
    """A Cast from a narrower float (bf16/fp16 -> fp32, mixed precision's fp32 islands): saving
    its input instead of its output saves fewer bytes, and the backward recasts it."""
    if node.op_type != "Cast" or node.inputs[0] is None:
        return False
    src, dst = node.inputs[0].dtype, node.outputs[0].dtype
    return (src is not None and dst is not None and src.is_floating_point() and dst.is_floating_point()
            and src.itemsize < dst.itemsize)


def _recomputable(nodes, forward_nodes: set[ir.Node], forward_inputs: set[ir.Value]) -> set[ir.Node]:
    """Forward nodes of ``_RECOMPUTED_OPS`` that read only forward inputs, initializers and
    other such nodes' outputs: cheaper to recompute in the backward graph than to save."""
    result: set[ir.Node] = set()
    free: set[ir.Value] = set(forward_inputs)
    for node in nodes:
        if (node in forward_nodes and node.domain in ("", "ai.onnx") and node.op_type in _RECOMPUTED_OPS
                and all(i is None or i in free or i.is_initializer() for i in node.inputs)):
            result.add(node)
            free.update(node.outputs)
    return result


def _extract(model: ir.Model, input_names: list[str], output_names: list[str], cut: list[str]) -> ir.Model:
    """A copy of ``model`` computing ``output_names`` from ``input_names``.

    Values named in ``cut`` become graph inputs even where a node produced them (the
    nodes upstream of them drop out).
    """
    copy = ir.from_proto(ir.to_proto(model))
    graph = copy.graph
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        values.update((o.name, o) for o in node.outputs)
    graph.outputs.clear()  # before cutting: a cut value may have been an output
    cut_inputs = {}
    for name in cut:
        value = values[name]
        if value.is_graph_input():
            continue
        fresh = ir.Value(name=name, type=value.type, shape=value.shape)
        value.replace_all_uses_with(fresh)
        value.name = f"{name}.replaced"
        cut_inputs[name] = fresh
    original_inputs = {v.name: v for v in graph.inputs}
    graph.inputs.clear()
    graph.inputs.extend(cut_inputs.get(n) or original_inputs[n] for n in input_names)
    graph.outputs.extend(cut_inputs.get(n) or values[n] for n in output_names)
    return pipeline.run(copy, pipeline.cleanup())
