"""Common-subexpression elimination that leaves random draws apart.

onnx_ir's ``CommonSubexpressionEliminationPass`` merges nodes with the same op, inputs and
attributes, and spares the random generators it knows (RandomNormal, RandomUniform, their
``Like`` forms, Multinomial) but not ``Dropout`` or ``Bernoulli``: two dropouts of one tensor
(two heads' dropout on a shared hidden state, PEFT's LoRA dropout on q and v) would share one
mask where PyTorch draws two. This pass tags each such node with a distinct attribute while
onnx_ir's pass runs, so no two match, and removes the tags afterwards.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from onnxtrain.ir.nodes import is_onnx_op

# draws onnx_ir's pass does not already keep apart
RANDOM_OPS = ("Dropout", "Bernoulli")
_TAG = "onnxtrain_distinct_draw"


class DistinctDrawsCSEPass(ir.passes.InPlacePass):
    """onnx_ir's common-subexpression elimination, with every Dropout and Bernoulli kept."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        tagged = [node for node in ir.traversal.RecursiveGraphIterator(model.graph) if is_onnx_op(node, *RANDOM_OPS)]
        for index, node in enumerate(tagged):
            node.attributes[_TAG] = ir.AttrInt64(_TAG, index)
        try:
            result = CommonSubexpressionEliminationPass()(model)
        finally:
            for node in tagged:
                node.attributes.pop(_TAG, None)
        return ir.passes.PassResult(model, result.modified)
