"""Named pipelines, as visible lists: the order passes run in is stated here and nowhere else."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import (
    InlinePass,
    RemoveUnusedOpsetsPass,
    TopologicalSortPass,
)

from onnxtrain.autodiff.decompose import DecomposePass
from onnxtrain.passes.batch_norm import TrainingBatchNormPass
from onnxtrain.passes.ceil_pool import CeilModePoolPass
from onnxtrain.passes.column_product import ColumnVectorProductPass
from onnxtrain.passes.cse import DistinctDrawsCSEPass
from onnxtrain.passes.dce import RemoveUnusedNodesPass
from onnxtrain.passes.double_gelu import DoubleTanhGeluPass
from onnxtrain.passes.double_layer_norm import DoubleLayerNormPass
from onnxtrain.passes.empty_tensors import EmptyTensorsPass
from onnxtrain.passes.flat_gather import FlatGatherPass
from onnxtrain.passes.float_accumulation import FloatAccumulationPass
from onnxtrain.passes.fold import FoldConstantsPass, InferMissingShapesPass
from onnxtrain.passes.inference_mode import InferenceModePass
from onnxtrain.passes.kept_dropout import KeptDropoutPass
from onnxtrain.passes.leading_sum import LeadingAxesSumPass
from onnxtrain.passes.log_sigmoid import LogSigmoidPass
from onnxtrain.passes.negative_labels import NegativeLabelsPass
from onnxtrain.passes.pad_into_conv import PadIntoConvPass
from onnxtrain.passes.pool_first import PoolBeforeReluPass
from onnxtrain.passes.precision import PrecisionConfig, PrecisionPass
from onnxtrain.passes.scatter_nd import ReducingScatterNDPass
from onnxtrain.passes.sequence_map import SequenceMapAtPass
from onnxtrain.passes.softmax_guard import SoftmaxNaNGuardPass
from onnxtrain.passes.split_cross_entropy import SplitCrossEntropyPass
from onnxtrain.passes.sum_of_squares import SumOfSquaresPass
from onnxtrain.passes.transposed_product import TransposedProductPass


def before_autodiff() -> list[ir.passes.PassBase]:
    """Simplify a forward graph whose parameters are already graph inputs (so they are not folded).

    Model-local functions are inlined and ops without a gradient rule are replaced by their
    ONNX function bodies where they have one. Folding also rewrites sequence idioms
    exporters emit (SplitToSequence + SequenceAt with constant indices) into plain Split
    outputs, which autodiff handles. The exporter's NaN guard after a masked attention Softmax
    becomes a per-row factor (passes/softmax_guard.py). A ReLU before a MaxPool runs after it,
    on the smaller tensor (passes/pool_first.py). A transposed matrix times a vector becomes a
    product with a column, which onnxruntime's fused kernel gets right (passes/column_product.py).
    The logarithm of a sigmoid becomes a softplus, which onnxruntime computes without underflow
    (passes/log_sigmoid.py). A float64 LayerNormalization becomes float64 primitives (onnxruntime
    keeps its statistics in float32: passes/double_layer_norm.py), a float64 tanh-approximate
    Gelu too (onnxruntime's kernel has float32 constants: passes/double_gelu.py). A negative
    class label of a cross entropy or negative log-likelihood loss fails the run, as in PyTorch,
    instead of training as a class from the end (passes/negative_labels.py). Values still without
    a shape once folding has evaluated the arithmetic on constants get ONNX shape inference (the
    TorchScript exporter computes shapes that way: passes/fold.py). A ceil-mode pool is written in
    floor mode where the windows stay the same (ONNX's shape inference counts a last window the
    kernels drop: passes/ceil_pool.py). A reducing ScatterND (index_put with accumulate, an
    EmbeddingBag's bags) becomes a ScatterElements, which onnxruntime computes exactly with several
    threads (passes/scatter_nd.py). A constant-index SequenceAt of a SequenceMap over a
    SequenceConstruct (``torch.hstack``'s atleast_1d) becomes the map's body on that element
    (passes/sequence_map.py). A zero Pad of a Conv's input becomes the Conv's own pads
    (passes/pad_into_conv.py: TensorFlow-style "same" padding, no padded copy).
    """
    return [InlinePass(), DoubleLayerNormPass(), DoubleTanhGeluPass(), DecomposePass(), NegativeLabelsPass(),
            CeilModePoolPass(), SequenceMapAtPass(), FoldConstantsPass(), InferMissingShapesPass(),
            ReducingScatterNDPass(),
            LogSigmoidPass(), SoftmaxNaNGuardPass(),
            PoolBeforeReluPass(), PadIntoConvPass(), ColumnVectorProductPass(), RemoveUnusedNodesPass(),
            TopologicalSortPass()]


def after_autodiff() -> list[ir.passes.PassBase]:
    """Clean a training/eval graph: fold what turned out static, merge duplicates, drop dead nodes;
    then write ops as stock onnxruntime runs them fastest (after autodiff: their gradient rules
    are the better ones; a sum of squares as a sum of products; a sum over leading axes as a
    product with ones; a transposed matrix times a vector as a product with a column, which
    onnxruntime's fused kernel gets right); float16/bfloat16 gradients accumulated by scatters add
    in float32 (onnxruntime's CPU kernels have no low-precision reduction); a reducing ScatterND
    some rule or pass made becomes an exact ScatterElements (passes/scatter_nd.py); a Gather of
    a 1-D tensor's elements becomes a GatherElements (passes/flat_gather.py). First, a value
    of a static shape with a zero-sized dim (an empty batch) becomes an empty constant, which
    onnxruntime's optimizer cannot get wrong (passes/empty_tensors.py)."""
    return [
        EmptyTensorsPass(),
        SplitCrossEntropyPass(),
        ReducingScatterNDPass(),
        FloatAccumulationPass(),
        ColumnVectorProductPass(),
        SumOfSquaresPass(),
        LeadingAxesSumPass(),
        FlatGatherPass(),
        RemoveUnusedNodesPass(),
        FoldConstantsPass(),
        DistinctDrawsCSEPass(),
        RemoveUnusedNodesPass(),
        RemoveUnusedOpsetsPass(),
        TopologicalSortPass(),
    ]


def training_model() -> list[ir.passes.PassBase]:
    """The artifacts' training model after autodiff: ``after_autodiff`` plus a training-mode
    BatchNormalization written as primitive ops (passes/batch_norm.py) and layout rewrites, and
    training-mode Dropouts whose mask nothing reads kept from onnxruntime's inference rewrite
    (passes/kept_dropout.py).

    ORTModule's graphs (passes/partition.py) do not take TransposedProductPass: with it the
    half-budget recompute run of tests/ortmodule/test_memory.py (GPT, batch 64) peaked at
    ~620 MB against ~400, and still at ~650 MB with the pass on the backward graph alone
    (after the cut, the saved values unchanged): the order ONNX Runtime runs the rewritten
    backward in, not yet pinned down further."""
    return [TrainingBatchNormPass(), TransposedProductPass(), *after_autodiff(), KeptDropoutPass()]


def cleanup() -> list[ir.passes.PassBase]:
    """After a graph was cut out of a larger one: drop what it no longer uses, reorder."""
    return [RemoveUnusedNodesPass(), RemoveUnusedOpsetsPass(), TopologicalSortPass()]


def eval_model() -> list[ir.passes.PassBase]:
    """An eval model from a forward+loss graph: training-mode ops evaluate, then clean up."""
    return [InferenceModePass(), *after_autodiff()]


def mixed_precision(config: PrecisionConfig) -> list[ir.passes.PassBase]:
    """bf16/fp16 compute with fp32 islands (passes/precision.py). Runs after before_autodiff
    (with ``config.convert`` for an fp32 graph; an autocast export is already converted) and
    again, legalize only, on the gradient graph, whose rules add low-precision ops of their own."""
    return [PrecisionPass(config)]


def run(model: ir.Model, passes: list[ir.passes.PassBase]) -> ir.Model:
    """Run ``passes`` in order on ``model`` (in place) and return it."""
    for p in passes:
        p(model)
    return model
