"""Constant folding: thin configuration over onnxscript's folder."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import fold_constants

# Ops never folded: random ops must stay random per run.
_NEVER_FOLD = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                         "Multinomial", "Bernoulli"})


def never_fold_random(node: ir.Node) -> bool | None:
    """The folder's ``should_fold`` hook: ``False`` for random ops, no opinion otherwise."""
    return False if node.op_type in _NEVER_FOLD else None


class FoldConstantsPass(ir.passes.InPlacePass):
    """Evaluate nodes whose inputs are all constants (e.g. Shape of a static dim, gradient scalars)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = fold_constants(model, onnx_shape_inference=False, should_fold=never_fold_random)
        return ir.passes.PassResult(model, bool(getattr(result, "modified", True)))
