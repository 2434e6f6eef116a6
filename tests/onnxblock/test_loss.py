"""Loss blocks: loss values and parameter gradients against torch.nn.functional."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import names, onnxblock
from onnxtrain.errors import ArtifactError

torch = pytest.importorskip("torch")
F = torch.nn.functional

IN, OUT, N = 5, 4, 6


def _linear_model(rng):
    w = rng.standard_normal((IN, OUT)).astype(np.float32) * 0.5
    b = rng.standard_normal(OUT).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b


class _Train(onnxblock.TrainingBlock):
    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def build(self, output_name):
        return self.loss(output_name)


def _run(loss_block, target, w, b, x, model):
    block = _Train(loss_block)
    block.requires_grad("w")
    block.requires_grad("b")
    with onnxblock.base(model):
        block("y")
    training, evaluation = block.to_model_proto()
    target_name = [i.name for i in training.graph.input][1]
    feeds = {"x": x, target_name: target, "w": w, "b": b}
    eval_loss = ort.InferenceSession(evaluation.SerializeToString()).run(None, feeds)[0]
    feeds.update({names.accumulation_buffer_name("w"): np.zeros_like(w),
                  names.accumulation_buffer_name("b"): np.zeros_like(b),
                  names.LAZY_RESET_GRAD: np.array(True)})
    loss, gw, gb = ort.InferenceSession(training.SerializeToString()).run(None, feeds)
    np.testing.assert_allclose(loss, eval_loss, rtol=1e-6)
    return loss, gw, gb


def _torch(loss_fn, w, b, x):
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    loss = loss_fn(torch.tensor(x) @ tw + tb)
    loss.sum().backward() if loss.dim() else loss.backward()
    return loss.detach().numpy(), tw.grad.numpy(), tb.grad.numpy()


CASES = {
    "mse-mean": (lambda: onnxblock.loss.MSELoss(), "float", lambda y, t: F.mse_loss(y, t)),
    "mse-sum": (lambda: onnxblock.loss.MSELoss("sum"), "float", lambda y, t: F.mse_loss(y, t, reduction="sum")),
    "l1-mean": (lambda: onnxblock.loss.L1Loss(), "float", lambda y, t: F.l1_loss(y, t)),
    "bce-weights": (lambda: onnxblock.loss.BCEWithLogitsLoss(weight=np.linspace(0.5, 1.5, OUT),
                                                             pos_weight=np.array([1.0, 2.0, 0.5, 3.0])),
                    "binary", lambda y, t: F.binary_cross_entropy_with_logits(
                        y, t, weight=torch.linspace(0.5, 1.5, OUT), pos_weight=torch.tensor([1.0, 2.0, 0.5, 3.0]))),
    "bce-sum-large-logits": (lambda: onnxblock.loss.BCEWithLogitsLoss(reduction="sum"), "binary",
                             lambda y, t: F.binary_cross_entropy_with_logits(y, t, reduction="sum")),
    # a zero-initialized head: every logit exactly 0, where max(-x, 0) has its kink
    "bce-zero-logits": (lambda: onnxblock.loss.BCEWithLogitsLoss(pos_weight=np.array([1.0, 2.0, 0.5, 3.0])),
                        "binary", lambda y, t: F.binary_cross_entropy_with_logits(
                            y, t, pos_weight=torch.tensor([1.0, 2.0, 0.5, 3.0]))),
    "ce-mean": (lambda: onnxblock.loss.CrossEntropyLoss(), "class", lambda y, t: F.cross_entropy(y, t)),
    "ce-weight-ignore": (lambda: onnxblock.loss.CrossEntropyLoss(weight=np.array([1.0, 2.0, 0.5, 1.5]),
                                                                 ignore_index=2),
                         "class", lambda y, t: F.cross_entropy(y, t, weight=torch.tensor([1.0, 2.0, 0.5, 1.5]),
                                                               ignore_index=2)),
    "ce-sum": (lambda: onnxblock.loss.CrossEntropyLoss(reduction="sum"), "class",
               lambda y, t: F.cross_entropy(y, t, reduction="sum")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_block_matches_torch(case):
    make, kind, torch_fn = CASES[case]
    rng = np.random.default_rng(0)
    model, w, b = _linear_model(rng)
    x = rng.standard_normal((N, IN)).astype(np.float32)
    if case == "bce-sum-large-logits":  # scale inside the model so logits reach +-40 and more
        w = w * 40
        b = b * 40
    if case == "bce-zero-logits":
        w, b = np.zeros_like(w), np.zeros_like(b)
    if kind == "float":
        target = rng.standard_normal((N, OUT)).astype(np.float32)
        torch_target = torch.tensor(target)
    elif kind == "binary":
        target = rng.integers(0, 2, (N, OUT)).astype(np.float32)
        torch_target = torch.tensor(target)
    else:
        target = rng.integers(0, OUT, N).astype(np.int32)
        torch_target = torch.tensor(target, dtype=torch.long)
    ours = _run(make(), target, w, b, x, model)
    ref = _torch(lambda y: torch_fn(y, torch_target), w, b, x)
    assert np.isfinite(ours[0]).all()
    for got, want, what in zip(ours, ref, ["loss", "grad w", "grad b"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)


def test_unknown_reduction_is_rejected():
    with pytest.raises(ArtifactError, match="reduction"):
        onnxblock.loss.MSELoss("average")
