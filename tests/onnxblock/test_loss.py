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


@pytest.mark.parametrize(("loss", "message"), [
    (lambda: onnxblock.loss.CrossEntropyLoss(weight=np.ones(OUT + 1)), r"weight has shape \[5\]: one weight per class, 4"),
    (lambda: onnxblock.loss.CrossEntropyLoss(weight=np.ones(OUT - 1)), r"weight has shape \[3\]: one weight per class, 4"),
    (lambda: onnxblock.loss.CrossEntropyLoss(weight=np.ones((2, OUT))), r"weight has shape \[2, 4\]"),
    (lambda: onnxblock.loss.BCEWithLogitsLoss(pos_weight=np.ones(OUT + 1)), r"pos_weight has shape \[5\], which does not"),
    (lambda: onnxblock.loss.BCEWithLogitsLoss(weight=np.ones((3, OUT))), r"weight has shape \[3, 4\], which does not"),
    (lambda: onnxblock.loss.BCEWithLogitsLoss(weight=np.ones((1, 1, OUT))), r"weight has shape \[1, 1, 4\]"),
])
def test_weights_of_the_wrong_shape_are_refused_naming_them(loss, message):
    """A class weight one entry too long trained (the extra ignored), one too short failed the
    first step naming the labels; a BCE weight that does not broadcast failed when the model
    was loaded, on a Mul. PyTorch refuses them."""
    model, _, _ = _linear_model(np.random.default_rng(0))
    block = _Train(loss())
    block.requires_grad("w")
    with pytest.raises(ArtifactError, match=message), onnxblock.base(model):
        block("y")


def test_weights_that_broadcast_are_taken():
    rng = np.random.default_rng(0)
    model, w, b = _linear_model(rng)
    x, target = rng.standard_normal((N, IN)).astype(np.float32), rng.uniform(size=(N, OUT)).astype(np.float32)
    ours = _run(onnxblock.loss.BCEWithLogitsLoss(weight=np.full((1, OUT), 0.5), pos_weight=np.array([2.0])),
                target, w, b, x, model)
    ref = _torch(lambda y: F.binary_cross_entropy_with_logits(y, torch.tensor(target), weight=torch.full((1, OUT), 0.5),
                                                             pos_weight=torch.tensor([2.0])), w, b, x)
    for got, want in zip(ours, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _tanh_model(declared_output_shape):
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["y"])],
                              "tanh", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L", IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared_output_shape)],
                              [numpy_helper.from_array(np.full((IN, OUT), 0.1, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("declared", [["S", "S", OUT], [2, 7, OUT]],
                         ids=["one-symbol-for-two-dims", "example-sizes-for-dynamic-dims"])
def test_target_accepts_the_true_shape_where_the_declared_output_shape_is_wrong(tmp_path, declared):
    """Exporters declare wrong output shapes (TorchScript: one symbol for a reflect-padded Conv1d's
    batch and length; dynamo: a GRU's example length for a dynamic sequence). The target's shape
    comes from what shape inference derives from the inputs, so the true shape is accepted and
    another one still fails, naming the target."""
    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.errors import InputMismatchError, RunError

    artifacts.generate_artifacts(_tanh_model(declared), loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    module = Module(str(tmp_path / "training_model.onnx"), CheckpointState.load_checkpoint(str(tmp_path / "checkpoint")))
    x = np.random.default_rng(0).standard_normal((3, 5, IN)).astype(np.float32)
    target = np.zeros((3, 5, OUT), np.float32)
    loss = module(x, target)
    np.testing.assert_allclose(loss, np.mean(np.tanh(x @ np.full((IN, OUT), 0.1, np.float32)) ** 2), rtol=1e-5)
    for wrong in (np.zeros((3, 1, OUT), np.float32), np.zeros((3, 4, OUT), np.float32), np.zeros((3, 5, 1), np.float32)):
        with pytest.raises((InputMismatchError, RunError), match="target"):
            module(x, wrong)


def test_target_keeps_the_declared_shape_where_it_is_right():
    model, _, _ = _linear_model(np.random.default_rng(0))
    block = _Train(onnxblock.loss.MSELoss())
    block.requires_grad("w")
    with onnxblock.base(model):
        block("y")
    training, _ = block.to_model_proto()
    target = next(i for i in training.graph.input if i.name == "target")
    assert [d.dim_param or d.dim_value for d in target.type.tensor_type.shape.dim] == ["N", OUT]
    assert not any(n.op_type == "Reshape" for n in training.graph.node)  # no run-time check needed


def test_a_target_of_another_shape_fails_where_the_outputs_dims_are_unknown(tmp_path):
    """Where shape inference cannot tell the output's dims (a Tile by repeats given at run time) and
    the declared ones are wrong, the target is checked at run time: one of another shape fails,
    also one with as many elements (the check is not a reshape to the output's shape)."""
    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module
    from onnxtrain.errors import RunError

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Tile", ["xw", "repeats"], ["y"])],
        "tiled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN]),
                  helper.make_tensor_value_info("repeats", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", "S"])],
        [numpy_helper.from_array(np.full((IN, OUT), 0.1, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    module = Module(str(tmp_path / "training_model.onnx"), CheckpointState.load_checkpoint(str(tmp_path / "checkpoint")))
    x, repeats = np.ones((2, IN), np.float32), np.array([1, 2], np.int64)
    y = np.tile(x @ np.full((IN, OUT), 0.1, np.float32), (1, 2))
    np.testing.assert_allclose(module(x, repeats, np.zeros_like(y)), np.mean(y ** 2), rtol=1e-5)
    with pytest.raises(RunError, match="target_must_have_the_shape_of"):
        module(x, repeats, np.zeros((y.shape[1], y.shape[0]), np.float32))  # as many elements, transposed
