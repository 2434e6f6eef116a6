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

import copy
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx_ir as ir

from onnxtrain import names
from onnxtrain.autodiff.builder import active_values, build_gradients, is_float
from onnxtrain.errors import ModelError
from onnxtrain.ir.builder import GraphBuilder
from onnxtrain.ir.nodes import has_subgraphs, is_onnx_op, node_reads
from onnxtrain.passes import memory, pipeline, recompute

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


class MemoryOptLevel(enum.IntEnum):
    """How much the backward graph recomputes to save memory (upstream's
    ``ORTMODULE_MEMORY_OPT_LEVEL`` values)."""

    NONE = 0
    """Save what the backward reads, except copies and cheap ops of values at hand anyway."""
    TRANSFORMER_LAYERWISE_RECOMPUTE = 1
    """Recompute every deterministic op except compute-heavy ones (MatMul, Gemm, Conv, ...)
    wherever that saves bytes: in a transformer layer, only the inputs and outputs of its
    matrix products stay saved."""
    AGGRESSIVE = 2
    """Recompute every deterministic op wherever that saves bytes: the least saved memory,
    the forward run about twice."""


# Upstream's environment variable for the level (read when options do not set one).
MEMORY_OPT_LEVEL_ENV = "ORTMODULE_MEMORY_OPT_LEVEL"


@dataclass(frozen=True)
class MemoryOptions:
    """What the forward saves for the backward.

    Args:
        level: a :class:`MemoryOptLevel`; ``None`` reads ``$ORTMODULE_MEMORY_OPT_LEVEL``
            (default 0).
        budget: bytes the saved activations may take; the recompute that costs the least
            run time within it is chosen (a min cut weighted by bytes and recompute cost).
            Overrides ``level``.
    """

    level: int | None = None
    budget: int | None = None

    def resolved_level(self) -> MemoryOptLevel:
        level = self.level if self.level is not None else os.environ.get(MEMORY_OPT_LEVEL_ENV, "0")
        try:
            return MemoryOptLevel(int(level))
        except ValueError as exc:
            source = "memory level" if self.level is not None else f"${MEMORY_OPT_LEVEL_ENV}"
            raise ValueError(f"{source} must be one of {[int(m) for m in MemoryOptLevel]}, got {level!r}") from exc

    @property
    def active(self) -> bool:
        return self.budget is not None or self.resolved_level() != MemoryOptLevel.NONE


@dataclass(frozen=True)
class MemoryReport:
    """What crosses from the forward to the backward, for one binding of the input shapes.

    Attributes:
        saved: ``(value name, bytes, producing op)`` of each saved activation, largest first.
        recomputed: ``(node name, op type)`` of the forward nodes the backward reruns.
        saved_bytes: total bytes of ``saved``.
        unplanned_saved_bytes: what the saved activations take without memory options.
        level, budget: the options the plan was made with.
        input_shapes: the shapes the sizes were computed for.
    """

    saved: list[tuple[str, int, str]]
    recomputed: list[tuple[str, str]]
    saved_bytes: int
    unplanned_saved_bytes: int
    level: int
    budget: int | None
    input_shapes: dict[str, tuple[int, ...]]

    def explain(self, limit: int = 20) -> str:
        mb = lambda n: f"{n / 2**20:.1f} MB"  # noqa: E731
        shapes = ", ".join(f"{k}{list(v)}" for k, v in self.input_shapes.items())
        lines = [f"saved activations: {mb(self.saved_bytes)} (without recompute: {mb(self.unplanned_saved_bytes)}); "
                 f"memory level {self.level}, budget {mb(self.budget) if self.budget is not None else 'none'}; "
                 f"sizes for inputs {shapes}",
                 f"saved ({len(self.saved)}):"]
        lines += [f"  {name}  {mb(size)}  from {op}" for name, size, op in self.saved[:limit]]
        if len(self.saved) > limit:
            lines.append(f"  ... {len(self.saved) - limit} more")
        ops: dict[str, int] = {}
        for _, op in self.recomputed:
            ops[op] = ops.get(op, 0) + 1
        lines.append(f"recomputed in the backward ({len(self.recomputed)} nodes): "
                     + (", ".join(f"{op} x{k}" for op, k in sorted(ops.items(), key=lambda i: -i[1])) or "none"))
        return "\n".join(lines)


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
    memory: MemoryReport | None = None

    def output_grads_reaching(self) -> list[frozenset[int]]:
        """For each backward output (each of ``wrt``), the model outputs whose gradient it reads:
        a parameter whose outputs all got no gradient (a loss of one output of two) has none."""
        graph = self.backward.graph
        reads: dict[ir.Value, frozenset[int]] = {
            value: frozenset([index]) if source == FROM_OUTPUT_GRAD else frozenset()
            for value, (source, index) in zip(graph.inputs, self.backward_inputs)}
        for node in graph:  # in a topological order
            found = frozenset().union(*(reads.get(v, frozenset()) for v in node_reads(node)))
            reads.update((out, found) for out in node.outputs)
        return [reads.get(out, frozenset()) for out in graph.outputs]


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
        if any(i in reached_values for i in node_reads(node)):
            reached.add(node)
            reached_values.update(node.outputs)
    return reached


def _ancestors(nodes: Sequence[ir.Node], targets: Sequence[ir.Value]) -> set[ir.Node]:
    wanted, result = set(targets), set()
    for node in reversed(nodes):
        if any(o in wanted for o in node.outputs):
            result.add(node)
            wanted.update(node_reads(node))
    return result


def build_forward_backward(model: ir.Model, wrt: Sequence[str], no_grad_outputs: Sequence[int] = (),
                           memory_options: MemoryOptions | None = None,
                           input_shapes: Mapping[str, Sequence[int]] | None = None) -> ForwardBackward:
    """Build the gradient graph of ``model`` w.r.t. the graph inputs named ``wrt`` and cut it.

    Every floating-point output that depends on a ``wrt`` input receives an output gradient
    (the vector of the vector-Jacobian product), except the outputs indexed in
    ``no_grad_outputs`` (e.g. updated running statistics). ``model`` is consumed.

    With ``input_shapes`` (input name -> concrete shape of a typical call) the result
    carries a :class:`MemoryReport`; with active ``memory_options`` (which need the shapes)
    the saved activations are chosen by a min cut under the options' level or budget.
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
        g.type, g.shape = copy.deepcopy(w.type), w.shape  # a copy: retyping a gradient leaves its parameter
        grad_outputs.append(g)
    graph.outputs.extend(grad_outputs)
    pipeline.run(model, pipeline.after_autodiff())

    model_outputs = list(graph.outputs[: len(model_outputs)])
    grad_outputs = list(graph.outputs[len(model_outputs):])
    options = memory_options or MemoryOptions()
    if options.active and input_shapes is None:
        raise ValueError("memory options need the input shapes of a call (input_shapes) to size the activations")
    sizes = memory.value_sizes(model, input_shapes) if input_shapes is not None else None
    return _cut(model, forward_inputs, model_outputs, seeds, differentiable, grad_outputs, list(wrt),
                options, sizes, input_shapes)


def _may_recompute(level: MemoryOptLevel, boundaries: set[ir.Node]):
    def allowed(node: ir.Node) -> bool:
        if node in boundaries:
            return False
        if node.op_type in recompute.NEVER_RECOMPUTED or node.domain not in ("", "ai.onnx", names.MS_DOMAIN):
            return False
        if has_subgraphs(node):
            return False
        return level == MemoryOptLevel.AGGRESSIVE or node.op_type not in recompute.COMPUTE_HEAVY
    return allowed


def _planned_recompute(nodes, forward_nodes, forward_inputs, model_outputs, grad_outputs, options, sizes):
    """Forward nodes the backward reruns, chosen by a min cut under the options."""
    needed = _crossing(nodes, forward_nodes, set(), forward_inputs, grad_outputs)
    free = set(forward_inputs) | set(model_outputs) | {i for n in nodes for i in n.inputs
                                                       if i is not None and i.is_initializer()}
    ordered = [n for n in nodes if n in forward_nodes]
    boundaries = recompute.layer_boundaries(ordered)
    if options.budget is not None:
        plan = recompute.cut_within_budget(ordered, needed, free, sizes,
                                           _may_recompute(MemoryOptLevel.AGGRESSIVE, boundaries), options.budget)
    else:
        plan = recompute.cut(ordered, needed, free, sizes, _may_recompute(options.resolved_level(), boundaries),
                             recompute.MINIMAL_MEMORY_WEIGHT)
    return set(plan.recomputed)


def _cut(model, forward_inputs, model_outputs, seeds, differentiable, grad_outputs, wrt,
         options: MemoryOptions, sizes: memory.ValueSizes | None, input_shapes) -> ForwardBackward:
    graph = model.graph
    nodes = list(graph)
    after_seed = _descendants(nodes, set(seeds))
    forward_nodes = _ancestors(nodes, model_outputs)
    if forward_nodes & after_seed:  # a pass made the forward read a gradient: a bug, run in PyTorch (fallback)
        tangled = [o.name for o in model_outputs if o.producer() in after_seed]
        raise ModelError(f"the gradient graph cannot be split into a forward and a backward: model outputs "
                         f"{tangled} depend on an output gradient (an onnxtrain bug; please report it)")
    recomputed, crossing = _with_cheap_recompute(
        nodes, forward_nodes, _recomputable(nodes, forward_nodes, set(forward_inputs)), forward_inputs,
        model_outputs, grad_outputs)
    unplanned_saved_bytes = None if sizes is None else sum(
        sizes.of(v) for v in _saved(forward_nodes, recomputed, crossing, model_outputs))
    if options.active:
        planned = _planned_recompute(nodes, forward_nodes, forward_inputs, model_outputs, grad_outputs, options, sizes)
        recomputed, crossing = _with_cheap_recompute(nodes, forward_nodes, recomputed | planned, forward_inputs,
                                                     model_outputs, grad_outputs)
    saved = _saved(forward_nodes, recomputed, crossing, model_outputs)
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
    if options.active:
        _schedule_just_in_time(backward, backward_inputs)
    report = None
    if sizes is not None:
        in_backward = _ancestors(nodes, grad_outputs)
        data_inputs = {i.name for i in forward_inputs} - set(wrt)
        report = MemoryReport(
            saved=sorted(((v.name, sizes.of(v), v.producer().op_type) for v in saved), key=lambda s: -s[1]),
            recomputed=[(n.name, n.op_type) for n in nodes if n in recomputed and n in in_backward],
            saved_bytes=sum(sizes.of(v) for v in saved), unplanned_saved_bytes=unplanned_saved_bytes,
            level=int(options.resolved_level()), budget=options.budget,
            input_shapes={k: tuple(int(d) for d in v) for k, v in input_shapes.items() if k in data_inputs})
    return ForwardBackward(forward, backward, len(model_outputs), differentiable, backward_inputs, wrt,
                           saved=[v.name for v in saved], memory=report)


def _schedule_just_in_time(backward: ir.Model, backward_inputs: list[tuple[str, int]]) -> None:
    """List the backward graph's nodes so that recomputed forward values come right before the
    gradient nodes that read them (see :func:`memory.just_in_time_order`): computed all at
    the start, they would all be alive at once and the recompute would save nothing."""
    graph = backward.graph
    seeds = {v for v, (source, _) in zip(graph.inputs, backward_inputs) if source == FROM_OUTPUT_GRAD}
    _relist(graph, memory.just_in_time_order(graph, _descendants(list(graph), seeds)))


def _relist(graph: ir.Graph, order: list[ir.Node]) -> None:
    """Make ``order`` (every node of ``graph``) the graph's node list."""
    for node in order:
        graph.remove(node)
    for node in order:
        graph.append(node)


def _with_cheap_recompute(nodes, forward_nodes, recomputed, forward_inputs, model_outputs, grad_outputs):
    """Add the cheap nodes whose inputs cross anyway (until nothing changes); the crossing values."""
    recomputed = set(recomputed)
    crossing = _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs)
    while more := _memory_recomputable(nodes, forward_nodes, recomputed, crossing, forward_inputs, model_outputs):
        recomputed |= more
        crossing = _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs)
    return recomputed, crossing


def _saved(forward_nodes, recomputed, crossing, model_outputs) -> list[ir.Value]:
    """Crossing values the forward computes and returns beside the model outputs."""
    forward_values = {o for n in forward_nodes - recomputed for o in n.outputs}
    outputs = set(model_outputs)
    return [v for v in crossing if v in forward_values and v not in outputs]


def _crossing(nodes, forward_nodes, recomputed, forward_inputs, grad_outputs) -> dict[ir.Value, None]:
    """Forward values (and forward inputs) that the backward graph reads, in node order."""
    backward_nodes = _ancestors(nodes, grad_outputs) - (forward_nodes - recomputed)
    forward_values = {o for n in forward_nodes - recomputed for o in n.outputs}
    inputs = set(forward_inputs)
    crossing: dict[ir.Value, None] = {}  # ordered set
    for node in nodes:
        if node in backward_nodes:
            crossing.update((i, None) for i in node_reads(node) if i in forward_values or i in inputs)
    crossing.update((g, None) for g in grad_outputs if g in forward_values or g in inputs)
    return crossing


def _memory_recomputable(nodes, forward_nodes, recomputed, crossing, forward_inputs, model_outputs) -> set[ir.Node]:
    """Saved values' producers (of ``_MEMORY_RECOMPUTED_OPS``) whose inputs all cross anyway."""
    at_hand = set(crossing) | set(forward_inputs) | {o for n in recomputed for o in n.outputs}
    outputs = set(model_outputs)
    result: set[ir.Node] = set()
    for node in nodes:
        if (node in forward_nodes and node not in recomputed and is_onnx_op(node)
                and node.op_type in _MEMORY_RECOMPUTED_OPS
                and any(o in crossing and o not in outputs for o in node.outputs)
                and (all(i is None or i in at_hand or i.is_initializer() or _shape_sized(i) for i in node.inputs)
                     or _widening_cast(node))):
            result.add(node)
            at_hand.update(node.outputs)
    return result


def _shape_sized(value: ir.Value) -> bool:
    """A scalar or short vector of integers (a shape, a start or a count): with symbolic dims a
    Reshape's or Expand's target shape is computed in the graph rather than a constant; saving
    those few bytes too lets the backward recompute the view instead of saving it."""
    shape = value.shape
    return (value.dtype in (ir.DataType.INT64, ir.DataType.INT32) and shape is not None
            and (len(shape) == 0 or (len(shape) == 1 and isinstance(shape[0], int) and shape[0] <= 8)))


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
        if (node in forward_nodes and is_onnx_op(node, *_RECOMPUTED_OPS)
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
    values.update(graph.initializers)  # an output may be a constant (a buffer the forward zeroes)
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
