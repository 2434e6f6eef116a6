"""Constant folding: thin configuration over onnxscript's folder."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import fold_constants

from onnxtrain import names

# Ops never folded: random ops must stay random per run.
_NEVER_FOLD = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                         "Multinomial", "Bernoulli"})


# what a stop-gradient Identity is called while the folder runs: the folder forwards every
# Identity's input to its readers (and the node, then unread, is dropped), which would lose the
# mark that keeps the gradient graph from differentiating through it
_HIDDEN_STOP_GRADIENT = ("StopGradient", "onnxtrain.hidden")


def never_fold_random(node: ir.Node) -> bool | None:
    """The folder's ``should_fold`` hook: ``False`` for random ops (and hidden stop-gradients),
    no opinion otherwise."""
    return False if node.op_type in _NEVER_FOLD or (node.op_type, node.domain) == _HIDDEN_STOP_GRADIENT else None


class FoldConstantsPass(ir.passes.InPlacePass):
    """Evaluate nodes whose inputs are all constants (e.g. Shape of a static dim, gradient
    scalars). Stop-gradient Identities (``names.STOP_GRADIENT_METADATA``) stay as they are."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        stops = [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
                 if node.op_type == "Identity" and node.domain in ("", "ai.onnx")
                 and names.STOP_GRADIENT_METADATA in node.metadata_props]
        for node in stops:
            node.op_type, node.domain = _HIDDEN_STOP_GRADIENT
        try:
            result = fold_constants(model, onnx_shape_inference=False, should_fold=never_fold_random)
        finally:
            for node in stops:
                node.op_type, node.domain = "Identity", ""
        return ir.passes.PassResult(model, bool(getattr(result, "modified", True)))
