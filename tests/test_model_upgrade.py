"""Models written for older ONNX standards, or by converters other than torch.onnx: what
``io.load_model`` upgrades (opset, IR version, domain spelling) must compute what onnxruntime
computes on the original model, and train."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module
from onnxtrain.autodiff.check import check_gradients
from onnxtrain.errors import ArtifactError, InputMismatchError, ModelError


def _model(nodes, inputs, output, initializers, opset, ir_version=7, extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, [output], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    model.ir_version = ir_version
    return model


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _module(model, tmp_path, **kwargs):
    options = {"requires_grad": ["w"], "loss": artifacts.LossType.MSELoss, "optimizer": artifacts.OptimType.SGD,
               "artifact_directory": tmp_path}
    options.update(kwargs)
    artifacts.generate_artifacts(model, **options)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    return Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")


def _scaled_resize(opset, op, mode, scales, scales_as_input=False, shape=(1, 2, 7, 9), chained=False):
    """x * w (per channel) resized by an Upsample or Resize of ``opset`` (``chained``: twice,
    then negated, so that the resized values are not graph outputs)."""
    resized = "r" if chained else "y"
    if opset < 9:
        nodes = [helper.make_node(op, ["h"], [resized], mode=mode, scales=scales)]
    else:
        nodes = [helper.make_node(op, ["h", "scales"], [resized], mode=mode)]
    if chained:
        nodes += [helper.make_node(op, ["r", "scales"], ["r2"], mode=mode) if opset >= 9 else
                  helper.make_node(op, ["r"], ["r2"], mode=mode, scales=scales),
                  helper.make_node("Neg", ["r2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))]
    initializers = [numpy_helper.from_array(np.array([[[1.5]], [[-0.5]]], np.float32), "w")]
    if scales_as_input:
        inputs.append(helper.make_tensor_value_info("scales", TensorProto.FLOAT, [4]))
    elif opset >= 9:
        initializers.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
    return _model([helper.make_node("Mul", ["x", "w"], ["h"]), *nodes], inputs,
                  helper.make_tensor_value_info("y", TensorProto.FLOAT, None), initializers, opset)


@pytest.mark.parametrize("opset, op, mode, scales, chained", [
    (9, "Upsample", "linear", [1, 1, 2, 2], False),
    (7, "Upsample", "nearest", [1, 1, 3, 1.75], False),
    (9, "Upsample", "nearest", [1, 1, 2, 2.5], False),
    (10, "Resize", "linear", [1, 1, 0.6, 1.75], False),
    (10, "Resize", "nearest", [1, 1, 0.6, 0.75], False),  # shrinking: onnxruntime rounds up
    (10, "Resize", "nearest", [1, 1, 1.75, 0.6], False),  # both ways: two Resize-13 nodes
    # inside the graph: the version converter renames the outputs of the nodes it replaces, and
    # the old resamplings were found by their output names (only graph outputs kept the sampling)
    (9, "Upsample", "linear", [1, 1, 2, 1.5], True),
    (9, "Upsample", "nearest", [1, 1, 1.7, 2.5], True),
    (7, "Upsample", "nearest", [1, 1, 3, 1.75], True),
    (10, "Resize", "nearest", [1, 1, 1.75, 0.6], True),
])
def test_old_resampling_keeps_onnxruntimes_semantics(tmp_path, opset, op, mode, scales, chained):
    # the ONNX version converter leaves Resize-13's default half_pixel coordinates on these;
    # onnxruntime ran them with asymmetric ones (and per-axis rounding for nearest)
    model = _scaled_resize(opset, op, mode, scales, chained=chained)
    x = np.random.default_rng(0).standard_normal((1, 2, 7, 9)).astype(np.float32)
    expected = _run(model, {"x": x})
    module = _module(model, tmp_path, additional_output_names=["y"])
    module.eval()
    _, got = module(x, np.zeros_like(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    check_gradients(model, {"x": x}, wrt=["w"], seed=1)


def test_old_nearest_resize_with_scales_given_at_run_time(tmp_path):
    model = _scaled_resize(10, "Resize", "nearest", None, scales_as_input=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 7, 9)).astype(np.float32)
    module = _module(model, tmp_path, additional_output_names=["y"])
    module.eval()
    for scales in ([1, 1, 1.75, 0.6], [1, 1, 0.6, 2.5], [1, 1, 2, 2]):
        scales = np.array(scales, np.float32)
        expected = _run(model, {"x": x, "scales": scales})
        _, got = module(x, scales, np.zeros_like(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_resize_with_an_empty_roi_trains(tmp_path, opset):
    # what the TorchScript exporter writes for F.interpolate: roi is read only by tf_crop_and_resize
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]),
             helper.make_node("Resize", ["h", "roi", "scales"], ["y"], mode="linear")]
    initializers = [numpy_helper.from_array(np.array([[[1.5]], [[-0.5]]], np.float32), "w"),
                    numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
                    numpy_helper.from_array(np.array([1, 1, 2, 1.5], np.float32), "scales")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, None), initializers, opset)
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    check_gradients(model, {"x": x}, wrt=["w"], seed=1)
    module = _module(model, tmp_path)
    target = np.ones((1, 2, 6, 6), np.float32)
    expected = np.mean((_run(model, {"x": x}) - target) ** 2)
    np.testing.assert_allclose(float(module(x, target)), expected, rtol=1e-6)


def _linear(opset=8, ir_version=3, initializers_as_inputs=True, domain=""):
    """x[N, 4] @ w + b; IR version 3 wants every initializer listed as a graph input too."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    if initializers_as_inputs:
        inputs += [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3]),
                   helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])]
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
                    numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], domain=domain),
                               helper.make_node("Add", ["h", "b"], ["y"], domain=domain)], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, opset)])
    model.ir_version = ir_version
    return model


def _trains_like_the_model(model, tmp_path):
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    target = np.zeros((5, 3), np.float32)
    module = _module(model, tmp_path, requires_grad=["w", "b"])
    expected = np.mean((_run(model, {"x": x}) - target) ** 2)
    np.testing.assert_allclose(float(module(x, target)), expected, rtol=1e-6)
    return module


def test_initializers_listed_as_inputs_are_parameters(tmp_path):
    # IR version 3 models (the model zoo's older ones) and keep_initializers_as_inputs=True
    model = _linear()
    onnx.checker.check_model(model)
    module = _trains_like_the_model(model, tmp_path)
    assert module.input_names() == ["x", "target"]
    training = onnx.load(tmp_path / "training_model.onnx")
    names = [v.name for v in training.graph.input]
    assert len(names) == len(set(names)) and names.count("w") == 1


def test_default_domain_spelled_ai_onnx(tmp_path):
    model = _linear(opset=17, ir_version=8, initializers_as_inputs=False, domain="ai.onnx")
    _trains_like_the_model(model, tmp_path)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        written = onnx.load(tmp_path / name)
        assert {o.domain for o in written.opset_import} >= {""}
        assert all(n.domain != "ai.onnx" for n in written.graph.node)


@pytest.mark.parametrize("mode", ["reflect", "edge"])
def test_pad2_value_attribute_dropped_for_modes_that_ignore_it(tmp_path, mode):
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]),
             helper.make_node("Pad", ["h"], ["y"], mode=mode, pads=[0, 0, 1, 2, 0, 0, 2, 1], value=3.0)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 7, 7]),
                   [numpy_helper.from_array(np.array([[[1.5]], [[-0.5]]], np.float32), "w")], opset=9)
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    module = _module(model, tmp_path)
    target = np.zeros((1, 2, 7, 7), np.float32)
    np.testing.assert_allclose(float(module(x, target)), np.mean(_run(model, {"x": x}) ** 2), rtol=1e-6)


def test_input_declared_without_a_shape_takes_any_rank(tmp_path):
    # onnxruntime reports such an input's shape as [], a scalar's: the model file tells them apart
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                   [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "w")], opset=17)
    module = _module(model, tmp_path)
    for shape in [(3,), (2, 3), (2, 2, 3)]:
        x = np.ones(shape, np.float32)
        np.testing.assert_allclose(float(module(x, np.zeros(shape, np.float32))), 14 / 3, rtol=1e-6)


def test_declared_scalar_input_still_checked(tmp_path):
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
                   [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "w")], opset=17)
    module = _module(model, tmp_path)
    np.testing.assert_allclose(float(module(np.float32(2.0), np.zeros(3, np.float32))), 56 / 3, rtol=1e-6)
    with pytest.raises(InputMismatchError, match="'x'.*rank 1"):
        module(np.ones(3, np.float32), np.zeros(3, np.float32))


@pytest.mark.parametrize("declared", [None, ["N", 4], [2, 3, 4]])
def test_matmul_with_a_matrix_needs_no_rank_of_its_left_operand(declared):
    # scikit-learn pipelines: an ai.onnx.ml op (Scaler, no shape inference) feeds the weights' MatMul
    nodes = [helper.make_node("Scaler", ["x"], ["xs"], domain="ai.onnx.ml", offset=[0.5], scale=[2.0]),
             helper.make_node("MatMul", ["xs", "w"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, declared)],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                   [numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "w")],
                   opset=17, extra_opsets=[helper.make_opsetid("ai.onnx.ml", 1)])
    for shape in [(4,), (5, 4), (2, 3, 4)]:
        if declared is not None and len(declared) != len(shape):
            continue
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        check_gradients(model, {"x": x}, wrt=["w"], prefer_double=False, seed=2)


def test_map_output_is_named_with_the_way_out():
    # scikit-learn classifiers' default ZipMap output: a sequence of maps
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"]),
             helper.make_node("ZipMap", ["scores"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])]
    output = helper.make_value_info("probabilities", helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))))
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])], output,
                   [numpy_helper.from_array(np.ones((3, 2), np.float32), "w")], opset=17,
                   extra_opsets=[helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(ModelError, match="'probabilities' is a sequence of maps.*zipmap"):
        artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss)


def test_weights_in_attributes_named_when_nothing_can_train(tmp_path):
    nodes = [helper.make_node("LinearRegressor", ["x"], ["y"], domain="ai.onnx.ml",
                              coefficients=[1.0, 2.0, 3.0], intercepts=[0.5])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1]), [], opset=17,
                   extra_opsets=[helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(ArtifactError, match="no floating-point weights.*ai.onnx.ml.LinearRegressor"):
        artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=tmp_path)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_a_batched_scan8_is_refused_not_changed(tmp_path):
    """The converter turned Scan-8 into a Scan-9 whose inputs lost their batch axis (the
    artifacts then failed to load): refused by name instead."""
    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    body = helper.make_graph([helper.make_node("Add", ["s", "xs"], ["s2"]), helper.make_node("Identity", ["s2"], ["ys"])],
                             "body", [info("s", [3]), info("xs", [3])], [info("s2", [3]), info("ys", [3])])
    scan = helper.make_node("Scan", ["", "init", "xs"], ["final", "ys"], body=body, num_scan_inputs=1)
    graph = helper.make_graph([scan], "g", [info("init", [2, 3]), info("xs", [2, 4, 3])],
                              [info("final", [2, 3]), info("ys", [2, 4, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    with pytest.raises(ModelError, match=r"opset 8 and a Scan-8.*opset 9 or later"):
        artifacts.generate_artifacts(model, requires_grad=[], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path)
