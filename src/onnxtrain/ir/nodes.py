"""Small questions about ``onnx_ir`` nodes that passes ask everywhere."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import get_const_tensor

# the default ONNX domain's two spellings
ONNX_DOMAINS = ("", "ai.onnx")
# ops that draw random numbers: another value on every run
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})
# Ops whose outputs' element type is not that of their first input.
_INT64_OUTPUT_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OUTPUT_OPS = frozenset(
    {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"}
)


def infer_output_dtypes(node: ir.Node) -> None:
    """Give ``node``'s untyped outputs their element type where it follows from the op, its
    attributes and its inputs' types (a graph input cut from such a value needs it: onnxruntime
    refuses an input without a type)."""
    op, attrs = node.op_type, node.attributes
    first = next((v.dtype for v in node.inputs if v is not None and v.dtype is not None), None)
    if op in _INT64_OUTPUT_OPS:
        dtype = ir.DataType.INT64
    elif op in _BOOL_OUTPUT_OPS:
        dtype = ir.DataType.BOOL
    elif op == "Cast":
        dtype = ir.DataType(attrs["to"].as_int())
    elif op in ("CastLike", "Where"):  # the type of input 1 (target_type; the X of Where)
        dtype = node.inputs[1].dtype
    elif op == "OneHot":  # the type of its values
        dtype = node.inputs[2].dtype
    elif op == "ConstantOfShape":
        value = attrs.get("value")
        dtype = value.as_tensor().dtype if value is not None else ir.DataType.FLOAT
    elif op == "Constant":
        value = attrs.get("value")
        dtype = value.as_tensor().dtype if value is not None else None
    else:
        dtype = first
    if dtype is not None:
        for out in node.outputs:
            if out.type is None:
                out.type = ir.TensorType(dtype)
    if op == "Dropout" and len(node.outputs) > 1:
        node.outputs[1].type = ir.TensorType(ir.DataType.BOOL)


def is_onnx_op(node: ir.Node | None, *op_types: str) -> bool:
    """Whether ``node`` is an op of the default ONNX domain, and one of ``op_types`` if any are given."""
    return node is not None and node.domain in ONNX_DOMAINS and (not op_types or node.op_type in op_types)


def constant_axes(node: ir.Node, opset: int, axes_input_opset: int) -> list[int] | None:
    """A Reduce* node's axes when they are constant and not empty, else None (none given: every
    axis; or computed at run time). They are an attribute below ``axes_input_opset``, an input
    from it on (13 for ReduceSum, 18 for the other reductions)."""
    if opset < axes_input_opset:
        attr = node.attributes.get("axes")
        axes = [int(a) for a in attr.value] if attr is not None else []
    else:
        tensor = get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        axes = [int(a) for a in np.asarray(tensor.numpy()).reshape(-1)] if tensor is not None else []
    return axes or None


def base_name(node: ir.Node) -> str:
    """A name for nodes that replace ``node``: its first output's (value names are unique; node
    names may be empty)."""
    return node.outputs[0].name or node.name


class NewNodes:
    """The nodes a pass creates to replace ``at``, in creation order (for
    ``onnx_ir.convenience.replace_nodes_and_values``), named ``<at's base name>/<label>_<i>``."""

    def __init__(self, at: ir.Node, label: str):
        self.nodes: list[ir.Node] = []
        self._prefix = f"{base_name(at)}/{label}"

    def add(self, op_type: str, inputs, attributes=None, domain: str = "") -> ir.Value:
        """A new node (of the default domain unless ``domain`` is given); its (first) output."""
        node = ir.node(op_type, inputs, attributes=attributes, domain=domain, name=f"{self._prefix}_{len(self.nodes)}")
        infer_output_dtypes(node)
        self.nodes.append(node)
        return node.outputs[0]


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs ``node`` holds as attributes (an If's branches, a Loop's or Scan's body)."""
    graphs = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.value)
    return graphs


def captured_values(node: ir.Node) -> list[ir.Value]:
    """Values of enclosing graphs that ``node``'s subgraphs (an ``If``'s branches, a ``Loop``'s or
    ``Scan``'s body, at any depth) read without taking them as inputs: ONNX lets a subgraph use any
    value in scope, so they are inputs of the node as much as its listed ones."""
    defined: set[ir.Value] = set()
    used: list[ir.Value] = []
    pending = subgraphs(node)
    while pending:
        graph = pending.pop()
        defined.update(graph.inputs)
        defined.update(graph.initializers.values())
        for inner in graph:
            defined.update(inner.outputs)
            used.extend(v for v in inner.inputs if v is not None)
            pending.extend(subgraphs(inner))
        used.extend(graph.outputs)
    return list(dict.fromkeys(v for v in used if v not in defined))


def has_subgraphs(node: ir.Node) -> bool:
    """Whether ``node`` holds a graph as an attribute (If, Loop, Scan, SequenceMap)."""
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def node_reads(node: ir.Node) -> list[ir.Value]:
    """Every value ``node`` depends on: its inputs, then the values its subgraphs capture."""
    inputs = [v for v in node.inputs if v is not None]
    if not has_subgraphs(node):
        return inputs
    return list(dict.fromkeys([*inputs, *captured_values(node)]))


def upstream_nodes(value: ir.Value) -> Iterator[ir.Node]:
    """The nodes ``value`` is computed from (its producer, theirs, ..., through what their
    subgraphs capture too), each once, nearest first along each path."""
    seen_values, seen_nodes, pending = {value}, set(), [value]
    while pending:
        producer = pending.pop().producer()
        if producer is None or producer in seen_nodes:
            continue
        seen_nodes.add(producer)
        yield producer
        for read in node_reads(producer):
            if read not in seen_values:
                seen_values.add(read)
                pending.append(read)
