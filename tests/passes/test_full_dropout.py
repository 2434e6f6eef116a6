"""A Dropout of ratio 1 in a user's ONNX model trains as PyTorch's ``dropout(p=1)`` (passes/full_dropout.py):
onnxruntime's kernel refused the ratio and failed every training step."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts, names

torch = pytest.importorskip("torch")


def _model(weight, other, ratio, mask_used=False):
    """``y = Dropout(x @ W, ratio, training) + x @ V`` (plus ``mask * (x @ V)`` where the mask is used)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(ratio, np.float32))),
        helper.make_node("Constant", [], ["training"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Dropout", ["h", "ratio", "training"], ["dropped", "mask"]),
        helper.make_node("MatMul", ["x", "V"], ["g"]),
        helper.make_node("Add", ["dropped", "g"], ["y" if not mask_used else "s"]),
    ]
    if mask_used:
        nodes += [helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["m", "g"], ["kept"]), helper.make_node("Add", ["s", "kept"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])]
    graph = helper.make_graph(nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              outputs, [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(other, "V")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run_training(directory, x, target, weight, other):
    session = ort.InferenceSession(str(directory / "training_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "target": target, "W": weight, "V": other, names.LAZY_RESET_GRAD: np.array(True),
             names.accumulation_buffer_name("W"): np.zeros_like(weight),
             names.accumulation_buffer_name("V"): np.zeros_like(other)}
    outputs = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    return dict(zip([o.name for o in session.get_outputs()], outputs))


def _torch_step(x, target, weight, other):
    w, v = torch.tensor(weight, requires_grad=True), torch.tensor(other, requires_grad=True)
    xt = torch.tensor(x)
    loss = torch.nn.functional.mse_loss(torch.nn.functional.dropout(xt @ w, p=1.0) + xt @ v, torch.tensor(target))
    loss.backward()
    return loss.item(), w.grad.numpy(), v.grad.numpy()


@pytest.mark.parametrize("mask_used", [False, True])
def test_a_ratio_of_one_trains_as_pytorchs_dropout_of_one(tmp_path, mask_used):
    rng = np.random.default_rng(0)
    weight, other = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    x, target = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    artifacts.generate_artifacts(_model(weight, other, 1.0, mask_used), requires_grad=["W", "V"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    got = _run_training(tmp_path, x, target, weight, other)
    expected_loss, expected_w, expected_v = _torch_step(x, target, weight, other)
    np.testing.assert_allclose(got["loss"], expected_loss, rtol=1e-5)
    np.testing.assert_array_equal(got[names.accumulation_out_name("W")], expected_w)  # zero
    np.testing.assert_allclose(got[names.accumulation_out_name("V")], expected_v, rtol=1e-5)
    # the eval model evaluates: its Dropout is the identity (and its mask all True)
    evaluation = ort.InferenceSession(str(tmp_path / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "target": target, "W": weight, "V": other}
    eval_outputs = evaluation.run(None, {i.name: feeds[i.name] for i in evaluation.get_inputs()})
    np.testing.assert_allclose(eval_outputs[0], np.mean((x @ weight + (1 + mask_used) * (x @ other) - target) ** 2), rtol=1e-5)


def test_a_non_finite_input_gives_nan_as_in_pytorch_and_other_ratios_keep_their_dropout(tmp_path):
    weight = np.full((4, 3), np.inf, np.float32)
    other = np.ones((4, 3), np.float32)
    artifacts.generate_artifacts(_model(weight, other, 1.0), requires_grad=["V"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "one")
    session = ort.InferenceSession(str(tmp_path / "one" / "training_model.onnx"), providers=["CPUExecutionProvider"])
    x, target = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    feeds = {"x": x, "target": target, "W": weight, "V": other, names.LAZY_RESET_GRAD: np.array(True),
             names.accumulation_buffer_name("V"): np.zeros_like(other)}
    loss = session.run(["loss"], {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    assert np.isnan(loss)  # inf * 0, as torch's dropout(p=1) of an infinite input
    artifacts.generate_artifacts(_model(weight, other, 0.5), requires_grad=["V"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "half")
    ops = [n.op_type for n in onnx.load(tmp_path / "half" / "training_model.onnx").graph.node]
    assert "Dropout" in ops
