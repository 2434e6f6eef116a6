"""NegativeLabelsPass: a negative class label (but ignore_index) of SoftmaxCrossEntropyLoss or
NegativeLogLikelihoodLoss fails the run, where onnxruntime read it as a class from the end."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxtrain.passes.negative_labels import NegativeLabelsPass
from tests.passes._graphs import model_of, run

SCORES = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


def _losses(label_type=TensorProto.INT64, nll: bool = True, opset: int = 17):
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["sce"], reduction="mean",
                              ignore_index=-100)]
    if nll:
        nodes += [helper.make_node("LogSoftmax", ["scores"], ["log_prob"], axis=1),
                  helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "labels"], ["nll"], reduction="sum")]
    return model_of(nodes, [("scores", ["N", 3]), ("labels", ["N"], label_type)], ["sce", "nll"][:1 + nll],
                    opset=opset)


def _rewritten(proto, times=1):
    model = ir.from_proto(proto)
    modified = [NegativeLabelsPass()(model).modified for _ in range(times)]
    return ir.to_proto(model), modified


@pytest.mark.parametrize("opset", [13, 17])  # Shape takes start and end from opset 15 on
@pytest.mark.parametrize("label_type, dtype", [(TensorProto.INT64, np.int64), (TensorProto.INT32, np.int32)])
def test_labels_in_range_give_the_same_losses_and_negative_ones_fail(label_type, dtype, opset):
    proto = _losses(label_type, opset=opset)
    negative = np.array([0, -1, 2, 1], dtype)
    before = run(proto, {"scores": SCORES, "labels": negative})  # the bug: -1 read as class 2
    np.testing.assert_array_equal(before, run(proto, {"scores": SCORES, "labels": np.array([0, 2, 2, 1], dtype)}))
    rewritten, modified = _rewritten(proto)
    assert modified == [True]
    for labels in ([0, 2, 2, 1], [1, 0, 0, 2]):
        feeds = {"scores": SCORES, "labels": np.array(labels, dtype)}
        np.testing.assert_array_equal(run(rewritten, feeds), run(proto, feeds))
    for labels in ([0, -1, 2, 1], [0, -3, 2, 1], [-4, 0, 0, 0], [0, 3, 2, 1]):
        with pytest.raises(Exception, match="(?i)out of range"):
            run(rewritten, {"scores": SCORES, "labels": np.array(labels, dtype)})


def test_ignore_index_stays_ignored_and_other_negatives_fail():
    rewritten, _ = _rewritten(_losses())
    sce_only, _ = _rewritten(_losses(nll=False))
    labels = np.array([0, -100, 2, 1], np.int64)
    (sce,) = run(sce_only, {"scores": SCORES, "labels": labels})
    log_prob = SCORES - np.log(np.exp(SCORES).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(sce, -np.mean(log_prob[[0, 2, 3], [0, 2, 1]]), rtol=1e-6)
    with pytest.raises(Exception, match="(?i)out of range"):
        run(sce_only, {"scores": SCORES, "labels": np.array([0, -100, -1, 1], np.int64)})
    with pytest.raises(Exception, match="(?i)out of range"):  # the NLL has no ignore_index: -100 fails it
        run(rewritten, {"scores": SCORES, "labels": labels})


def test_running_twice_guards_once_and_labels_of_unknown_type_are_cast():
    rewritten, modified = _rewritten(_losses(), times=2)
    assert modified == [True, False]
    assert [n.op_type for n in rewritten.graph.node].count("Where") == 2  # one per loss
    proto = _losses()
    proto.graph.input[1].type.tensor_type.elem_type = 0  # undefined: the pass casts the labels to int64
    model = ir.from_proto(proto)
    NegativeLabelsPass()(model)
    assert next(iter(model.graph)).op_type == "Cast"
