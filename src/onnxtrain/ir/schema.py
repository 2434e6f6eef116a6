"""Queries on the ONNX operator schemas (onnx.defs): function bodies of ops."""

from __future__ import annotations

import onnx
import onnx.defs
import onnx_ir as ir


def _parse(body) -> onnx.FunctionProto:
    if isinstance(body, onnx.FunctionProto):
        return body
    function = onnx.FunctionProto()
    function.ParseFromString(body)
    return function


def function_body(node: ir.Node, opset: int) -> ir.Function | None:
    """The ONNX function defining ``node``'s op at ``opset`` (specialized to the node), or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    body = None
    if schema.has_function:
        body = schema.get_function_with_opset_version(opset) or schema.function_body
    elif schema.has_context_dependent_function:
        if any(i is not None and i.type is None for i in node.inputs):
            return None  # the body depends on the input types, which are unknown
        input_types = [
            (ir.serde.serialize_type(i.type) if i is not None else onnx.TypeProto()).SerializeToString()
            for i in node.inputs
        ]
        try:
            body = schema.get_context_dependent_function_with_opset_version(
                opset, ir.serde.serialize_node(node).SerializeToString(), input_types)
        except Exception:  # noqa: BLE001  (onnx raises a bare RuntimeError for unsupported cases)
            return None
    if not body:
        return None
    # a function body reads the node's attributes by reference, and one the node leaves at its
    # default would be missing there (AffineGrid's align_corners, MVN's axes): write the defaults in
    for name, attribute in schema.attributes.items():
        if name not in node.attributes and attribute.default_value.type != onnx.AttributeProto.UNDEFINED:
            node.attributes[name] = ir.serde.deserialize_attribute(attribute.default_value)
    try:
        function = ir.serde.deserialize_function(_parse(body))
    except Exception:  # noqa: BLE001  (a body onnx_ir cannot read, e.g. Attention-23's): no decomposition
        return None
    if function.opset_imports.get("", opset) != opset:
        return None  # a body written for another opset may mean something else in this one
    return function
