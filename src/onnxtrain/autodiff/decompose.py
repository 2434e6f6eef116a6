"""Fallback for ops without a gradient rule: expand their ONNX function body.

Many ONNX ops are defined by a function body made of other ops (GroupNormalization,
MeanVarianceNormalization, Shrink, ...). A node of such an op with no rule of its own
is replaced by its body, whose primitive ops have rules; the gradient then flows
through the primitives. Hand rules stay preferable where a decomposition is worse in
numerics or memory, so decomposition only happens for ops the registry lacks.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import InlinePass, ShapeInferencePass

from onnxtrain.autodiff.builder import FLOAT_TYPES
from onnxtrain.autodiff.registry import DEFAULT_REGISTRY, Registry
from onnxtrain.ir.nodes import has_subgraphs, is_onnx_op
from onnxtrain.ir.schema import function_body

DECOMPOSED_DOMAIN = "pkg.onnxtrain.decomposed"


def _ranges_read_scalars(function: ir.Function) -> None:
    """Give every Range of ``function``'s body scalar inputs, as the op requires: AffineGrid's
    body feeds it the one-element vectors of a Split, which onnxruntime refuses once their
    values are known (a constant size: "Input to 'Range' op should be scalars")."""
    for node in list(ir.traversal.RecursiveGraphIterator(function)):
        if node.op_type != "Range" or node.domain not in ("", "ai.onnx"):
            continue
        scalar_shape = ir.node("Constant", [], attributes={"value_ints": ir.AttrInt64s("value_ints", [])})
        made = [scalar_shape]
        for position, value in enumerate(node.inputs):
            reshape = ir.node("Reshape", [value, scalar_shape.outputs[0]])
            node.replace_input_with(position, reshape.outputs[0])
            made.append(reshape)
        node.graph.insert_before(node, made)


class DecomposePass(ir.passes.InPlacePass):
    """Replace nodes whose op has no gradient rule but an ONNX function body by that body."""

    def __init__(self, registry: Registry = DEFAULT_REGISTRY):
        super().__init__()
        self.registry = registry

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.graph.opset_imports.get("", 1)
        count = 0
        # subgraphs too: an If branch or a loop body is differentiated like the main graph
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if not is_onnx_op(node) or self.registry.lookup("", node.op_type, opset) is not None:
                continue
            if not any(i is not None and i.dtype in FLOAT_TYPES for i in node.inputs):
                continue  # nothing differentiable flows through it
            if has_subgraphs(node):
                continue  # SequenceMap's body: the inliner cannot pass a graph to a function
            function = function_body(node, opset)
            if function is None:
                continue
            _ranges_read_scalars(function)
            count += 1
            function.domain, function.name = DECOMPOSED_DOMAIN, f"{node.op_type}_{count}"
            model.functions[function.identifier()] = function
            node.domain, node.op_type = DECOMPOSED_DOMAIN, function.name
        if not count:
            return ir.passes.PassResult(model, False)
        model.graph.opset_imports[DECOMPOSED_DOMAIN] = 1
        InlinePass()(model)
        for key in [k for k in model.functions if k[0] == DECOMPOSED_DOMAIN]:
            del model.functions[key]
        model.graph.opset_imports.pop(DECOMPOSED_DOMAIN, None)
        # the inlined values need element types: autodiff follows only float values
        ShapeInferencePass(strict_mode=False)(model)
        return ir.passes.PassResult(model, True)
