"""Negative class labels fail the run, as in PyTorch, instead of training as classes from the end.

onnxruntime's ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss`` read a negative class
index from the end of the class axis: a label of -1 silently trains as the last class, where
PyTorch's ``cross_entropy`` and ``nll_loss`` raise (``Target -1 is out of bounds``), and where
a data bug (an unmapped label) should not go unnoticed. This pass moves every negative label but
the node's ``ignore_index`` past the class count before the loss reads it::

    labels = Where(labels < 0 and labels != ignore_index, classes - labels, labels)

so onnxruntime fails the run on it (its kernels check the upper bound), as it does on a label of
``classes`` or more; onnxtrain reports that as a ``RunError`` naming the integer inputs. Labels in
range are passed unchanged, so the loss and its gradient are bit-identical. It runs on every
forward graph before autodiff (``pipeline.before_autodiff``): the losses ``torch.onnx.export``
writes for ``F.cross_entropy`` and ``F.nll_loss``, onnxblock's, and the ones a user's ONNX model
brings. Three integer kernels over the labels per loss, standard ops only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxtrain.ir.nodes import NewNodes, is_onnx_op
from onnxtrain.passes.rewrite import NodeRewritePass, constant_maker

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
# set on a loss node whose labels this pass guarded, so that running it again adds nothing
GUARDED_METADATA = "onnxtrain.negative_labels_guarded"
_LABEL_DTYPES = {ir.DataType.INT32: np.int32, ir.DataType.INT64: np.int64}
# Shape takes start and end from this opset on
_SHAPE_SLICE_OPSET = 15


class NegativeLabelsPass(NodeRewritePass):
    """Guard the class labels of every ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss``
    of the main graph: a negative one (but ``ignore_index``) is moved out of range."""

    def match(self, node: ir.Node, opset: int) -> int | None:
        if not is_onnx_op(node, *_LOSSES) or node.metadata_props.get(GUARDED_METADATA):
            return None
        return opset if len(node.inputs) > 1 and node.inputs[1] is not None else None

    def rewrite(self, graph: ir.Graph, node: ir.Node, plan: int) -> None:
        scores, labels = node.inputs[0], node.inputs[1]
        new = NewNodes(node, "negative_labels")  # it types what it makes: autodiff sees integers
        add = new.add
        label_type = labels.dtype if labels.dtype in _LABEL_DTYPES else ir.DataType.INT64
        if labels.dtype != label_type:  # not known here: the loss takes int64 labels as well
            labels = add("Cast", [labels], {"to": int(label_type)})
        constant = constant_maker(add, _LABEL_DTYPES[label_type])
        negative = add("Less", [labels, constant(0)])
        ignore = node.attributes.get("ignore_index")
        if ignore is not None and ignore.as_int() < 0:
            negative = add("And", [negative, add("Not", [add("Equal", [labels, constant(ignore.as_int())])])])
        class_axis = 0 if scores.shape is not None and len(scores.shape) == 1 else 1
        if plan >= _SHAPE_SLICE_OPSET:  # [classes]: folds to a constant where the class count is static
            classes = add("Shape", [scores], {"start": class_axis, "end": class_axis + 1})
        else:
            classes = add("Gather", [add("Shape", [scores]), constant(class_axis, np.int64)], {"axis": 0})
        if label_type != ir.DataType.INT64:
            classes = add("Cast", [classes], {"to": int(label_type)})
        guarded = add("Where", [negative, add("Sub", [classes, labels]), labels])
        guarded.shape = labels.shape
        graph.insert_before(node, new.nodes)
        node.replace_input_with(1, guarded)
        node.metadata_props[GUARDED_METADATA] = "1"
