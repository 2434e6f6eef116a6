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


def _without_unmade_outputs(function: onnx.FunctionProto, used: int) -> onnx.FunctionProto:
    """``function`` without the trailing outputs past the node's ``used`` ones that no node of the
    body makes (a context-dependent body builds only the outputs its node asks for: Attention-23's
    lists ``present_key`` and others it then leaves undefined, which onnx_ir cannot read)."""
    made = {name for node in function.node for name in node.output} | set(function.input)
    outputs = list(function.output)
    while len(outputs) > used and outputs[-1] not in made:
        outputs.pop()
    if len(outputs) < len(function.output):
        trimmed = onnx.FunctionProto()
        trimmed.CopyFrom(function)
        del trimmed.output[:]
        trimmed.output.extend(outputs)
        return trimmed
    return function


def function_body(node: ir.Node, opset: int) -> ir.Function | None:
    """The ONNX function defining ``node``'s op at ``opset`` (specialized to the node), or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    body = None
    if schema.has_function:
        body_opset = _latest_at_most(schema.function_opset_versions, opset)
        body = schema.get_function_with_opset_version(body_opset) if body_opset else schema.function_body
    elif schema.has_context_dependent_function:
        if any(i is not None and i.type is None for i in node.inputs):
            return None  # the body depends on the input types, which are unknown
        # with their shapes: some bodies depend on the inputs' ranks (RotaryEmbedding's)
        input_types = [
            (ir.serde.serialize_value(i).type if i is not None else onnx.TypeProto()).SerializeToString()
            for i in node.inputs
        ]
        try:
            # the body of the latest version written for an opset up to the model's
            body_opset = _latest_at_most(schema.context_dependent_function_opset_versions, opset) or opset
            body = schema.get_context_dependent_function_with_opset_version(
                body_opset, ir.serde.serialize_node(node).SerializeToString(), input_types)
        except Exception:  # noqa: BLE001  (onnx raises a bare RuntimeError for unsupported cases)
            return None
    if not body:
        return None
    # a function body reads the node's attributes by reference, and one the node leaves at its
    # default would be missing there (AffineGrid's align_corners, MVN's axes): write the defaults in
    for name, attribute in schema.attributes.items():
        if name not in node.attributes and attribute.default_value.type != onnx.AttributeProto.UNDEFINED:
            node.attributes[name] = ir.serde.deserialize_attribute(attribute.default_value)
    proto = _without_unmade_outputs(_parse(body), len(node.outputs))
    if not _types_check(proto, node):
        return None
    try:
        function = ir.serde.deserialize_function(proto)
    except Exception:  # noqa: BLE001  (a body onnx_ir cannot read, e.g. Attention-23's): no decomposition
        return None
    body_opset = function.opset_imports.get("", opset)
    if body_opset != opset:
        # a body written for another opset means the same in this one when none of its ops
        # changed between the two; it is then stamped with the model's opset, to be inlined
        if not _same_schemas(function, body_opset, opset):
            return None
        function.opset_imports[""] = opset
    return function


def _types_check(function: onnx.FunctionProto, node: ir.Node) -> bool:
    """Whether ``function``'s body is well typed for ``node``'s input types: a static body may be
    written for float only (MeanVarianceNormalization's float constants meet a double input)."""
    if any(i is not None and i.type is None for i in node.inputs):
        return True  # nothing to check against
    input_types = [ir.serde.serialize_type(i.type) if i is not None else onnx.TypeProto() for i in node.inputs]
    attributes = [ir.serde.serialize_attribute(a) for a in node.attributes.values() if not a.is_ref()]
    try:
        onnx.shape_inference.infer_function_output_types(function, input_types, attributes)
    except Exception:  # noqa: BLE001  (onnx raises InferenceError and others)
        return False
    return True


def body_serves(schema: onnx.defs.OpSchema, opset: int) -> bool:
    """Whether ``schema``'s function body can stand for its op at ``opset`` (what
    :func:`function_body` would give a node): the op has one, takes no graph attribute (the
    inliner cannot pass one to a body: SequenceMap) and, for a static body written for an older
    opset, its ops mean the same at ``opset``. A context-dependent body counts (whether it builds
    depends on a node's input types)."""
    graph_attributes = (onnx.defs.OpSchema.AttrType.GRAPH, onnx.defs.OpSchema.AttrType.GRAPHS)
    if any(attribute.type in graph_attributes for attribute in schema.attributes.values()):
        return False
    if schema.has_context_dependent_function:
        return True
    if not schema.has_function:
        return False
    body_opset = _latest_at_most(schema.function_opset_versions, opset)
    if not body_opset or body_opset == opset:
        return True
    function = ir.serde.deserialize_function(_parse(schema.get_function_with_opset_version(body_opset)))
    return _same_schemas(function, function.opset_imports.get("", body_opset), opset)


def _latest_at_most(versions, opset: int) -> int | None:
    """The greatest of ``versions`` not above ``opset`` (None when there is none)."""
    return max((v for v in versions if v <= opset), default=None)


def _same_schemas(function: ir.Function, opset_a: int, opset_b: int) -> bool:
    """Whether every standard op ``function`` uses (its subgraphs' included) means the same at
    ``opset_a`` and at ``opset_b``: the same schema version, or versions that differ only in the
    types they accept (ONNX bumps Cast, Reshape, Shape ... for each new element type)."""
    for node in ir.traversal.RecursiveGraphIterator(function):
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schemas = [onnx.defs.get_schema(node.op_type, opset, "") for opset in (opset_a, opset_b)]
        except onnx.defs.SchemaError:
            return False
        if len({_signature(schema) for schema in schemas}) != 1:
            return False
    return True


def _signature(schema: onnx.defs.OpSchema) -> tuple:
    """An op schema's inputs, outputs and attributes (with their defaults), not its types."""
    return (
        tuple((p.name, p.option) for p in schema.inputs),
        tuple((p.name, p.option) for p in schema.outputs),
        tuple(sorted((name, a.type, a.required, a.default_value.SerializeToString())
                     for name, a in schema.attributes.items())),
    )
