"""Constant folding: thin configuration over onnxscript's folder."""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnxscript.optimizer import fold_constants

from onnxtrain import names
from onnxtrain.ir.nodes import RANDOM_OPS

logger = logging.getLogger(__name__)

# Ops never folded: random ops must stay random per run; an empty sequence cannot be an
# initializer, and the folder cannot fold TopK's two outputs (for both it would only log a
# warning that it skips them: an embedding's gradient sorts its indices with a TopK, constant
# for a position embedding). onnxruntime folds such a TopK when it creates the session.
_NEVER_FOLD = RANDOM_OPS | {"SequenceEmpty", "TopK"}


# what a stop-gradient Identity is called while the folder runs: the folder forwards every
# Identity's input to its readers (and the node, then unread, is dropped), which would lose the
# mark that keeps the gradient graph from differentiating through it
_HIDDEN_STOP_GRADIENT = ("StopGradient", "onnxtrain.hidden")


def never_fold_random(node: ir.Node) -> bool | None:
    """The folder's ``should_fold`` hook: ``False`` for random ops, SequenceEmpty (and hidden stop-gradients),
    no opinion otherwise."""
    return False if node.op_type in _NEVER_FOLD or (node.op_type, node.domain) == _HIDDEN_STOP_GRADIENT else None


# ops the folder is kept away from when it fails on one of them
_SEQUENCE_OPS = frozenset({"SplitToSequence", "SequenceAt", "SequenceConstruct", "SequenceInsert", "SequenceErase",
                           "SequenceLength", "ConcatFromSequence"})
_HIDDEN_DOMAIN = "onnxtrain.hidden"


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
            try:
                result = fold_constants(model, onnx_shape_inference=False, should_fold=never_fold_random)
            except Exception:  # noqa: BLE001  (the folder fails on some nodes: SplitToSequence of a
                # scalar split computed at run time); again with the sequence ops hidden from it
                logger.debug("constant folding failed; folding again without sequence ops", exc_info=True)
                hidden = [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
                          if node.domain in ("", "ai.onnx") and node.op_type in _SEQUENCE_OPS]
                for node in hidden:
                    node.domain = _HIDDEN_DOMAIN
                try:
                    result = fold_constants(model, onnx_shape_inference=False, should_fold=never_fold_random)
                finally:
                    for node in hidden:
                        node.domain = ""
        finally:
            for node in stops:
                node.op_type, node.domain = "Identity", ""
        return ir.passes.PassResult(model, bool(getattr(result, "modified", True)))


class InferMissingShapesPass(ir.passes.InPlacePass):
    """ONNX shape inference over the graph, where a floating-point value has no shape: a shape an
    exporter computes with arithmetic on constants (the TorchScript exporter's ``nn.Unflatten``:
    Add, Mod and Slice of ``Shape``) is known once folding has evaluated that arithmetic, and the
    gradient rules need the ranks. A Reshape to a shape of known length whose values inference
    cannot tell (the TorchScript exporter's attention heads) gets that rank, with unknown dims,
    and inference runs again from it; then the folder runs again, with the shapes (it rewrites
    ``SplitToSequence`` + ``SequenceAt`` into a ``Split`` only where it knows the rank: an RMSNorm
    before a fused-qkv ``split`` in a dynamic export). Models whose values all carry shapes (the
    dynamo exporter's) are left as they are, at no cost."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx_ir.passes.common import ShapeInferencePass

        modified = False
        for _ in range(4):  # each round gives ranks to Reshapes that the one before reached
            if not _unshaped_floats(model.graph):
                break
            try:
                modified = ShapeInferencePass(strict_mode=False)(model).modified or modified
            except Exception:  # noqa: BLE001  (inference is a help: the rules name what they lack)
                break
            ranked = _rank_reshapes(model.graph)
            modified = modified or ranked
            if not ranked:
                break
        if modified:  # folding again, now with the shapes: SplitToSequence + SequenceAt -> Split
            FoldConstantsPass()(model)
        return ir.passes.PassResult(model, modified)


def _unshaped_floats(graph: ir.Graph) -> bool:
    """Whether a float value has no shape, or a value no type (torchlib's complex translations
    leave some untyped: a ``Shape`` of unknown type would count as a path for gradients)."""
    return any(out.type is None or (out.shape is None and out.dtype is not None and out.dtype.is_floating_point())
               for node in graph for out in node.outputs)


def _rank_reshapes(graph: ir.Graph) -> bool:
    """Give each unshaped Reshape output the rank its shape input's length says (dims unknown)."""
    ranked = False
    for node in graph:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or node.outputs[0].shape is not None:
            continue
        target = node.inputs[1] if len(node.inputs) > 1 else None
        if target is not None and target.shape is not None and len(target.shape) == 1 \
                and isinstance(target.shape[0], int):
            node.outputs[0].shape = ir.Shape([None] * target.shape[0])
            ranked = True
    return ranked
