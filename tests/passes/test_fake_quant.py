"""Quantize-dequantize pairs train with PyTorch's straight-through gradient
(passes/fake_quant.py): a QDQ model's parameters got a zero gradient before, and did not move."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts, names
from onnxtrain.api import CheckpointState, Module, Optimizer

torch = pytest.importorskip("torch")

INPUT_SCALE, INPUT_ZERO = 0.1, 3


def _qdq_model(weight, weight_scale, weight_zero, zero_type=TensorProto.INT8, axis=1):
    """``y = DQ(Q(x)) @ DQ(Q(W))``: the input quantized per tensor (uint8), the weight per tensor
    or per output column (``weight_scale`` of rank 1, ``axis``)."""
    initializers = [
        numpy_helper.from_array(weight, "W"),
        numpy_helper.from_array(np.asarray(weight_scale, np.float32), "w_scale"),
        helper.make_tensor("w_zero", zero_type, np.shape(weight_zero), np.ravel(weight_zero).tolist()),
        numpy_helper.from_array(np.array(INPUT_SCALE, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(INPUT_ZERO, np.uint8), "x_zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
        helper.make_node("QuantizeLinear", ["W", "w_scale", "w_zero"], ["Wq"], axis=axis),
        helper.make_node("DequantizeLinear", ["Wq", "w_scale", "w_zero"], ["Wd"], axis=axis),
        helper.make_node("MatMul", ["xd", "Wd"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


OUTPUT_SCALE = 0.0437  # no common step with the inputs': products of their steps are no ties


def _written_differently(model, way: str):
    """The same QDQ model, written as quantizers do too: the weight's dequantizer naming its axis
    as -1, its per-tensor scale as ``[1]`` in the quantizer and ``[]`` in the dequantizer, the pair
    in onnxruntime's com.microsoft domain, or the output quantize-dequantized (onnxruntime's
    quantize_static for a model ending in a MatMul)."""
    graph = model.graph
    weight_q, weight_dq = graph.node[2], graph.node[3]
    if way == "dequantizer_axis_-1":
        weight_dq.attribute[0].i = -1
    elif way == "scale_of_shape_1_and_scalar":
        scale = next(t for t in graph.initializer if t.name == "w_scale")
        graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(scale).reshape(()), "w_scale_0d"))
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale).reshape(1), "w_scale"))
        weight_dq.input[1] = "w_scale_0d"
        assert weight_q.input[1] == "w_scale"
    elif way == "onnxruntime_domain":  # onnxruntime's quantizer below opset 21 (4-bit types)
        weight_q.domain = weight_dq.domain = "com.microsoft"
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    elif way == "output_pair":
        graph.node[4].output[0] = "h"
        graph.initializer.extend([numpy_helper.from_array(np.array(OUTPUT_SCALE, np.float32), "y_scale"),
                                  numpy_helper.from_array(np.array(0, np.int8), "y_zero")])
        graph.node.extend([helper.make_node("QuantizeLinear", ["h", "y_scale", "y_zero"], ["hq"]),
                           helper.make_node("DequantizeLinear", ["hq", "y_scale", "y_zero"], ["y"])])
    return model


def _torch_gradient(x, target, weight, weight_scale, weight_zero, quant_range, output_pair=False):
    w = torch.tensor(weight, requires_grad=True)
    xq = torch.fake_quantize_per_tensor_affine(torch.tensor(x), INPUT_SCALE, INPUT_ZERO, 0, 255)
    scale = torch.tensor(weight_scale, dtype=torch.float32)
    if scale.dim() == 0:
        wq = torch.fake_quantize_per_tensor_affine(w, float(scale), int(weight_zero), *quant_range)
    else:
        wq = torch.fake_quantize_per_channel_affine(w, scale, torch.tensor(weight_zero, dtype=torch.int32), 1,
                                                    *quant_range)
    y = xq @ wq
    if output_pair:
        y = torch.fake_quantize_per_tensor_affine(y, OUTPUT_SCALE, 0, -128, 127)
    loss = torch.nn.functional.mse_loss(y, torch.tensor(target))
    loss.backward()
    return loss.item(), w.grad.numpy()


@pytest.mark.parametrize(("granularity", "written"), [
    ("per_tensor", "as_is"), ("per_channel", "as_is"), ("per_channel", "dequantizer_axis_-1"),
    ("per_tensor", "scale_of_shape_1_and_scalar"), ("per_tensor", "output_pair"), ("per_channel", "output_pair"),
    ("per_channel", "onnxruntime_domain")])
def test_the_weight_gradient_is_pytorchs_straight_through_one(tmp_path, granularity, written):
    """Also for pairs written in equivalent forms (they were not recognized: the weight stayed
    frozen; com.microsoft's were refused), and with the model's output quantize-dequantized
    (generate_artifacts failed)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 4)).astype(np.float32)
    weight[0, 0], weight[1, 1] = 9.0, -9.0  # clamped by the quantization range: no gradient there
    if granularity == "per_tensor":
        scale, zero, quant_range, zero_type = np.float32(0.05), np.int8(0), (-128, 127), TensorProto.INT8
    else:
        scale = np.array([0.02, 0.05, 0.03, 0.08], np.float32)
        zero, quant_range, zero_type = np.array([0, 10, -5, 0], np.int8), (-128, 127), TensorProto.INT8
    model = _written_differently(_qdq_model(weight, scale, zero, zero_type), written)
    artifacts.generate_artifacts(model, requires_grad=["W"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    target = rng.standard_normal((16, 4)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "training_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input-0": x, "x": x, "target": target, "labels": target, "W": weight,
             names.accumulation_buffer_name("W"): np.zeros_like(weight), names.LAZY_RESET_GRAD: np.array(True)}
    loss, gradient = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    expected_loss, expected_gradient = _torch_gradient(x, target, weight, scale, zero, quant_range,
                                                       output_pair=written == "output_pair")
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-4, atol=1e-6)
    assert gradient[0, 0] == 0.0 and gradient[1, 1] == 0.0 and np.count_nonzero(gradient) > 20
    # the eval model keeps the plain pair
    ops = [n.op_type for n in onnx.load(tmp_path / "eval_model.onnx").graph.node]
    assert "Where" not in ops and ops.count("QuantizeLinear") == (3 if written == "output_pair" else 2)


def test_a_qdq_model_trains_on_device_and_its_scales_stay_fixed(tmp_path):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((8, 4)).astype(np.float32)
    scale = np.array([0.02, 0.05, 0.03, 0.08], np.float32)
    artifacts.generate_artifacts(_qdq_model(weight, scale, np.zeros(4, np.int8)), requires_grad=None,
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert list(state.parameters.keys()) == ["W"]  # the per-channel scale is no parameter to train
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.02)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    target = x @ rng.standard_normal((8, 4)).astype(np.float32)
    losses = []
    for _ in range(40):
        losses.append(float(module(x, target)))
        optimizer.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.7 * losses[0]  # with a zero gradient nothing moved: the loss stayed


def test_quantization_constants_are_no_parameters_and_errors_say_why(tmp_path):
    """Scales and zero points stay fixed: named in requires_grad they are refused as such (the
    error blamed DequantizeLinear's missing gradient rule), QLinearMatMul's float scales are not
    picked by requires_grad=None (they were, then frozen with a warning), and a model whose
    weights are stored as integers says how to quantize it so that they train."""
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(artifacts.ArtifactError, match=r"\['w_scale'\] are quantization scales or zero points"):
        artifacts.generate_artifacts(_qdq_model(weight, np.float32(0.05), np.int8(0)), requires_grad=["W", "w_scale"],
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "a")

    def scalar(name, value, dtype):
        return numpy_helper.from_array(np.array(value, dtype), name)

    initializers = [numpy_helper.from_array(np.round(weight * 20).astype(np.int8), "Wq"),
                    scalar("x_scale", 0.1, np.float32), scalar("x_zero", 0, np.int8),
                    scalar("w_scale", 0.05, np.float32), scalar("w_zero", 0, np.int8),
                    scalar("y_scale", 0.2, np.float32), scalar("y_zero", 0, np.int8),
                    numpy_helper.from_array(np.zeros(4, np.float32), "bias")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
             helper.make_node("QLinearMatMul", ["xq", "x_scale", "x_zero", "Wq", "w_scale", "w_zero", "y_scale",
                                                "y_zero"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zero"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "qlinear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], initializers)
    qlinear = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    artifacts.generate_artifacts(qlinear, requires_grad=None, loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "b")
    assert list(CheckpointState.load_checkpoint(tmp_path / "b" / "checkpoint").parameters.keys()) == ["bias"]

    stored_quantized = _qdq_model(weight, np.float32(0.05), np.int8(0))
    weight_proto = next(t for t in stored_quantized.graph.initializer if t.name == "W")
    weight_proto.CopyFrom(numpy_helper.from_array(np.round(weight * 20).astype(np.int8), "Wq"))
    quantize = stored_quantized.graph.node[2]
    stored_quantized.graph.node.remove(quantize)
    with pytest.raises(artifacts.ArtifactError, match=r"stored quantized.*\['Wq'\].*AddQDQPairToWeight"):
        artifacts.generate_artifacts(stored_quantized, requires_grad=None, loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "c")
