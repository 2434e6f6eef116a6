"""Bring a model written for an older ONNX standard to the one onnxtrain builds on.

Called by ``io.load_model`` only. Like ``io`` it works on ``onnx.ModelProto``, since the ONNX
version converter does. What it does, in order:

- the default domain spelled ``"ai.onnx"`` (valid ONNX) becomes ``""``, the spelling every
  other step of onnxtrain and the graphs it writes use;
- initializers that are also graph inputs (IR version 3 models, where that was required, and
  ``torch.onnx.export(keep_initializers_as_inputs=True)``) stop being inputs: they are the
  model's parameters, with the initializer as their value;
- a model below ``min_opset`` goes through ``onnx.version_converter``, and then gets what the
  converter misses:

  * ``Upsample`` and ``Resize``-10 become ``Resize``-13 without a coordinate transformation,
    which means ``half_pixel``; onnxruntime ran them with ``asymmetric`` coordinates, rounding
    a nearest position down along the axes they enlarge and up along those they shrink. The
    upgraded node says so (two nodes where the axes go both ways: one ``nearest_mode`` holds
    for all axes of a Resize-11+);
  * ``Pad``-2 in ``reflect`` or ``edge`` mode keeps its ``value`` attribute, which ``Pad``-11+
    does not have (onnxruntime refuses the node): it goes (those modes never read it).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx

from onnxtrain.errors import ModelError

_DEFAULT_DOMAINS = ("", "ai.onnx")
# the first opset whose Resize has coordinate_transformation_mode (Upsample was removed at 10)
_RESIZE_WITH_COORDINATES = 11
# the first opset whose Scan has no batch axis (Scan-8 scans every input's second axis)
_UNBATCHED_SCAN = 9


def upgrade(proto: onnx.ModelProto, default_opset: int, min_opset: int) -> onnx.ModelProto:
    """``proto`` at ``min_opset`` or above: ``proto`` itself when there is nothing to change,
    else a changed copy."""
    if _spells_default_domain(proto) or _initializer_inputs(proto.graph):
        copied = onnx.ModelProto()
        copied.CopyFrom(proto)
        proto = copied
        _spell_default_domain(proto)
        _initializers_not_inputs(proto)
    if default_opset >= min_opset:
        return proto
    if default_opset < _UNBATCHED_SCAN and any(node.op_type == "Scan" and node.domain in _DEFAULT_DOMAINS
                                               for graph in _graphs(proto.graph) for node in graph.node):
        # the converter rewrites Scan-8 as Scan-9 without taking its batch axis out of the inputs:
        # a model of other shapes, that then fails to run
        raise ModelError(f"model uses opset {default_opset} and a Scan-8 (batched: sequence_lens and a batch "
                         f"axis first); onnxtrain needs >= {min_opset} and the ONNX version converter cannot "
                         f"upgrade that Scan. Export the model at opset {_UNBATCHED_SCAN} or later")
    try:
        converted = onnx.version_converter.convert_version(proto, min_opset)
    except Exception as exc:
        raise ModelError(f"model uses opset {default_opset}; onnxtrain needs >= {min_opset} and the ONNX "
                         f"version converter could not upgrade it: {exc}") from exc
    for graph in _graphs(converted.graph):
        if default_opset < _RESIZE_WITH_COORDINATES:
            _keep_old_resize_semantics(graph)
        for node in graph.node:
            if node.op_type == "Pad" and node.domain in _DEFAULT_DOMAINS:
                _remove_attribute(node, "value")
    return converted


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it (If branches, Loop and Scan bodies), outermost first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _graphs(subgraph)


def _spells_default_domain(proto: onnx.ModelProto) -> bool:
    return any(entry.domain == "ai.onnx" for entry in proto.opset_import) or any(
        entry.domain == "ai.onnx" for function in proto.functions for entry in function.opset_import)


def _spell_default_domain(proto: onnx.ModelProto) -> None:
    for entry in proto.opset_import:
        if entry.domain == "ai.onnx":
            entry.domain = ""
    for function in proto.functions:
        for entry in function.opset_import:
            if entry.domain == "ai.onnx":
                entry.domain = ""
    for graph in [*(_graphs(proto.graph)), *(f for f in proto.functions)]:
        for node in graph.node:
            if node.domain == "ai.onnx":
                node.domain = ""


def _initializer_inputs(graph: onnx.GraphProto) -> set[str]:
    initializers = {init.name for init in graph.initializer} | {
        sparse.values.name for sparse in graph.sparse_initializer}
    return {value.name for value in graph.input} & initializers


def _initializers_not_inputs(proto: onnx.ModelProto) -> None:
    graph = proto.graph
    initializers = _initializer_inputs(graph)
    if not initializers:
        return
    inputs = [value for value in graph.input if value.name not in initializers]
    del graph.input[:]
    graph.input.extend(inputs)
    # an initializer that is not an input needs IR version 4
    proto.ir_version = max(proto.ir_version, 4)


def _keep_old_resize_semantics(graph: onnx.GraphProto) -> None:
    """Give every Resize of a converted graph the sampling of the Upsample or Resize-10 it was
    (below opset 11 there is no other Resize): the converter writes Resize-13's defaults, and
    renames the outputs of the nodes it replaced, so the nodes are found by their kind."""
    nodes = []
    for node in graph.node:
        if node.op_type != "Resize" or node.domain not in _DEFAULT_DOMAINS:
            nodes.append(node)
            continue
        _set_string(node, "coordinate_transformation_mode", "asymmetric")
        mode = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "mode"), b"nearest")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "nearest":
            nodes.append(node)
            continue
        scales = _constant(graph, node.input[2]) if len(node.input) > 2 else None
        if scales is not None and np.all(scales >= 1):
            _set_string(node, "nearest_mode", "floor")
            nodes.append(node)
        elif scales is not None and np.all(scales <= 1):
            _set_string(node, "nearest_mode", "ceil")
            nodes.append(node)
        else:
            nodes.extend(_enlarge_then_shrink(node, scales))
    del graph.node[:]
    graph.node.extend(nodes)


def _enlarge_then_shrink(node: onnx.NodeProto, scales: np.ndarray | None) -> list[onnx.NodeProto]:
    """A nearest Resize whose axes may go both ways as two: the enlarged axes first (rounding
    down), then the shrunk ones (rounding up). Nearest sampling is separable, so that is exact."""
    make = onnx.helper.make_node
    x, roi, scale_input = node.input[0], node.input[1], node.input[2]
    output = node.output[0]
    one = f"{output}__legacy_one"
    up, down, middle = f"{output}__scales_up", f"{output}__scales_down", f"{output}__enlarged"
    if scales is not None:
        made = [make("Constant", [], [up], value=onnx.numpy_helper.from_array(np.maximum(scales, 1).astype(np.float32))),
                make("Constant", [], [down], value=onnx.numpy_helper.from_array(np.minimum(scales, 1).astype(np.float32)))]
    else:
        made = [make("Constant", [], [one], value=onnx.numpy_helper.from_array(np.array(1, np.float32))),
                make("Max", [scale_input, one], [up]), make("Min", [scale_input, one], [down])]
    name = node.name or output
    return [*made,
            make("Resize", [x, roi, up], [middle], name=f"{name}__enlarge", mode="nearest",
                 coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
            make("Resize", [middle, roi, down], [output], name=f"{name}__shrink", mode="nearest",
                 coordinate_transformation_mode="asymmetric", nearest_mode="ceil")]


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    for init in graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attribute in node.attribute:
                if attribute.name == "value":
                    return onnx.numpy_helper.to_array(attribute.t)
    return None


def _set_string(node: onnx.NodeProto, name: str, value: str) -> None:
    _remove_attribute(node, name)
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _remove_attribute(node: onnx.NodeProto, name: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    if len(kept) != len(node.attribute):
        del node.attribute[:]
        node.attribute.extend(kept)
