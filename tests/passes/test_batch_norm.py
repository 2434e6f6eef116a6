"""TrainingBatchNormPass: BatchNormalization(training_mode=1) as primitive ops, same outputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.ir import io
from onnxtrain.passes.batch_norm import TrainingBatchNormPass
from tests.passes._graphs import model_of, run

OUTPUTS = ["y", "running_mean", "running_var"]


def _batch_norm(outputs, training=1, **attrs):
    return [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outputs,
                             training_mode=training, **attrs)]


def _inputs(shape, elem=TensorProto.FLOAT):
    channels = [shape[1]]
    return [("x", shape, elem), ("scale", channels, elem), ("bias", channels, elem), ("mean", channels, elem),
            ("var", channels, elem)]


def _feeds(shape, dtype=np.float32):
    rng = np.random.default_rng(0)
    sizes = [5 if d == "N" else d for d in shape]
    channels = sizes[1]
    return {"x": rng.standard_normal(sizes).astype(dtype) * 2 + 1, "scale": rng.uniform(0.5, 2, channels).astype(dtype),
            "bias": rng.standard_normal(channels).astype(dtype), "mean": rng.standard_normal(channels).astype(dtype),
            "var": rng.uniform(0.5, 2, channels).astype(dtype)}


# (x shape, opset (ReduceMean's axes: an attribute before 18), attributes, outputs)
CASES = {
    "conv-map": ([4, 3, 5, 6], 18, {"momentum": 0.8, "epsilon": 1e-3}, OUTPUTS),
    "symbolic-batch-1d": (["N", 3, 7], 18, {}, OUTPUTS),
    "dense": ([6, 4], 15, {"momentum": 0.95}, OUTPUTS),
    "y-only": ([4, 3, 5], 15, {}, ["y"]),  # the updated statistics unread: not computed
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_onnxruntimes_kernel(case):
    shape, opset, attrs, outputs = CASES[case]
    original = model_of(_batch_norm(OUTPUTS, **attrs), _inputs(shape), outputs, opset=opset)
    model = io.load_model(original)
    assert TrainingBatchNormPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert "BatchNormalization" not in ops and ops.count("Add") == (2 if outputs == ["y"] else 4)
    assert [v.name for v in model.graph.outputs] == outputs
    feeds = _feeds(shape)
    for got, expected in zip(run(io.to_proto(model), feeds), run(original, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_double_and_inference_mode():
    double = model_of(_batch_norm(OUTPUTS), _inputs([4, 3, 5], TensorProto.DOUBLE), OUTPUTS,
                      elem=TensorProto.DOUBLE)
    model = io.load_model(double)
    assert TrainingBatchNormPass()(model).modified
    feeds = _feeds([4, 3, 5], np.float64)
    for got, expected in zip(run(io.to_proto(model), feeds), run(double, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    inference = model_of(_batch_norm(["y"], training=0), _inputs([4, 3, 5]), ["y"])
    assert not TrainingBatchNormPass()(io.load_model(inference)).modified


def test_training_artifacts_share_the_statistics_with_the_gradient(tmp_path):
    """In a training model the forward's batch statistics and the gradient rule's are one set."""
    torch = pytest.importorskip("torch")
    import onnx

    from onnxtrain import artifacts
    from onnxtrain.torch import export_for_training

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 2))
    proto = export_for_training(model, (torch.randn(8, 1, 6, 6),))
    artifacts.generate_artifacts(proto, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node]
    assert "BatchNormalization" not in ops and ops.count("Sqrt") == 1
    eval_ops = [n.op_type for n in onnx.load(str(tmp_path / "eval_model.onnx")).graph.node]
    assert "BatchNormalization" in eval_ops  # inference mode, on the running statistics
