"""Resize's gradient beyond the table's rows: what it refuses, and what static shapes fold to."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts
from onnxtrain.errors import UnsupportedOpError


def _upsampler(batch, resize_inputs, **attrs):
    """y = Resize(x * w) with a trained per-channel w."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Resize", ["xw", *resize_inputs], ["y"], name="up", **attrs)]
    inits = [numpy_helper.from_array(np.full((1, 2, 1, 1), 0.5, np.float32), "w"),
             numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales"),
             numpy_helper.from_array(np.array([6, 9], np.int64), "sizes")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_keep_aspect_ratio_policy_is_refused_with_the_node_named(tmp_path):
    # the policy scales every axis by one common factor and rounds the sizes: not one axis at a time
    model = _upsampler(2, ["", "", "sizes"], mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger")
    with pytest.raises(UnsupportedOpError, match="keep_aspect_ratio_policy") as info:
        artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.L1Loss,
                                     artifact_directory=tmp_path)
    assert info.value.unsupported == {"Resize": ["up"]}


@pytest.mark.parametrize("batch", [2, "N"])
def test_interpolation_matrices_of_static_axes_are_constants(tmp_path, batch):
    """The matrices depend on the resized axes' lengths only: with those static they fold away,
    even under a symbolic batch; only the two resized axes get one (the unscaled N and C none)."""
    artifacts.generate_artifacts(_upsampler(batch, ["", "scales"], mode="cubic"), requires_grad=["w"],
                                 loss=artifacts.LossType.L1Loss, artifact_directory=tmp_path)
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    ops = [n.op_type for n in training.graph.node]
    assert ops.count("Resize") == 1  # the forward's
    assert "EyeLike" not in ops
    assert ops.count("MatMul") == 2


def test_nearest_upsampling_by_a_whole_factor_sums_the_last_axis_blocks(tmp_path):
    """PyTorch's nearest upsampling (asymmetric, floor) by 2 and 3: along the last axis the gradient
    is a reshape and a sum (no interpolation matrix), along the other one a product."""
    model = _upsampler("N", ["", "scales"], mode="nearest", coordinate_transformation_mode="asymmetric",
                       nearest_mode="floor")
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.L1Loss,
                                 artifact_directory=tmp_path)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node]
    assert ops.count("MatMul") == 1 and "ReduceSum" in ops and ops.count("Resize") == 1


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_folded_matrices_of_align_corners_follow_onnxruntime_for_fractional_scales(mode):
    """With ``align_corners`` a scale of 1.7 makes floor(n * 1.7) outputs, and the sample positions
    divide by that integer less one (onnxruntime, PyTorch); onnx's reference evaluator, which folds
    the constant matrices of static shapes, divided by the fractional ``n * 1.7 - 1``: the gradient
    of ``F.interpolate(scale_factor=1.7, align_corners=True)`` through ORTModule was wrong."""
    torch = pytest.importorskip("torch")
    from onnxtrain.torch import DebugOptions, ORTModule

    class Upsample(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, scale_factor=(1.7, 2.3), mode=mode, align_corners=True)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 5, generator=g)
    weight = torch.randn(1, 2, 6, 11, generator=g)
    grads = []
    for model in (Upsample(), ORTModule(Upsample(), DebugOptions(fallback=False))):
        leaf = x.clone().requires_grad_()
        (model(leaf) * weight).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transformation", ["align_corners", "tf_crop_and_resize"])
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_antialiased_downscaling_by_a_scale_the_length_does_not_hold_exactly(tmp_path, mode, transformation):
    """With antialias, onnxruntime widens the filter by the scale given (0.6 here), not by the
    output length over the input's (4 / 7); the gradient's matrix must come from the scale too,
    and be folded by onnxruntime, not by onnx's reference implementation (which divides by the
    fractional length under these transformations)."""
    import onnxruntime as ort

    from onnxtrain.api import CheckpointState, Module

    n, scale = 7, 0.6
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)  # 4-D: onnxruntime's cubic wants it
    roi = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32)
    resize = helper.make_node("Resize", ["xw", "roi", "scales"], ["y"], mode=mode, antialias=1,
                              coordinate_transformation_mode=transformation)
    nodes = [helper.make_node("Add", ["x", "w"], ["xw"]), resize,
             helper.make_node("Mul", ["y", "weights"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(rng.standard_normal((1, 1, 1, n)).astype(np.float32), "w"),
             numpy_helper.from_array(roi, "roi"), numpy_helper.from_array(np.array([1, 1, 1, scale], np.float32), "scales"),
             numpy_helper.from_array(weights, "weights")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 1, n])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    artifacts.generate_artifacts(model, requires_grad=["w"], artifact_directory=tmp_path)
    # the forward's exact Jacobian, column by column: Resize of each unit vector
    forward = helper.make_model(helper.make_graph(
        [resize], "f", [helper.make_tensor_value_info("xw", TensorProto.FLOAT, [1, 1, 1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits[1:3]),
        opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
    jacobian = np.stack([session.run(None, {"xw": np.eye(n, dtype=np.float32)[j].reshape(1, 1, 1, n)})[0].ravel()
                         for j in range(n)], axis=1)
    assert jacobian.shape == (4, n)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    Module(tmp_path / "training_model.onnx", state)(np.zeros((1, 1, 1, n), np.float32))
    np.testing.assert_allclose(state.parameters["w"].grad.ravel(), jacobian.T @ weights.ravel(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, scale, size", [("bilinear", 1.3, (20, 20)), ("nearest", 0.6, (4, 9)),
                                               ("bicubic", 0.7, (20, 20))])
def test_static_matrices_come_from_onnxruntimes_resize_for_any_scale(mode, scale, size):
    """onnx's reference implementation, which folded the constant matrices, rounds otherwise than
    onnxruntime: 20 * 1.3 made 25 rows (the backward did not load) and nearest at 0.6 sent the
    gradient to the pixel next to the one the forward read."""
    torch = pytest.importorskip("torch")
    from onnxtrain.torch import DebugOptions, ORTModule

    class Resample(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, scale_factor=scale, mode=mode)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, *size, generator=g)
    model = ORTModule(Resample(), DebugOptions(fallback=False))
    out = model(x)
    weight = torch.randn(out.shape, generator=g)
    grads = []
    for m in (Resample(), model):
        leaf = x.clone().requires_grad_()
        (m(leaf) * weight).sum().backward()
        grads.append(leaf.grad)
    if mode == "nearest":  # the output itself may read a pixel over from PyTorch's: compare with ORT's forward
        picked = out.detach()
        torch.testing.assert_close((grads[1] * x).sum(), (weight * picked).sum(), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
