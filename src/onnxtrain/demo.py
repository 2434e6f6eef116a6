"""The main job: train a small CNN on scikit-learn's bundled digits through the artifacts flow.

No PyTorch involved: the CNN is written as an ONNX model, turned into training
artifacts, trained with ``onnxtrain.api`` on stock onnxruntime, exported for
inference and checked with a plain ``onnxruntime.InferenceSession``.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Accuracy the demo must reach on the held-out digits (the acceptance bar).
REQUIRED_ACCURACY = 0.95


@dataclass
class DemoResult:
    test_accuracy: float
    inference_accuracy: float
    final_loss: float
    seconds: float
    artifact_directory: pathlib.Path
    inference_model: pathlib.Path
    run_log: pathlib.Path
    plot: pathlib.Path | None  # None when matplotlib is not installed


def build_cnn(seed: int = 0, opset: int = 18) -> onnx.ModelProto:
    """conv(1->8) relu pool conv(8->16) relu pool flatten gemm(64->10), on [N, 1, 8, 8] images."""
    rng = np.random.default_rng(seed)

    def kaiming(shape, fan_in):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    inits = [
        numpy_helper.from_array(kaiming((8, 1, 3, 3), 9), "conv1.weight"),
        numpy_helper.from_array(np.zeros(8, np.float32), "conv1.bias"),
        numpy_helper.from_array(kaiming((16, 8, 3, 3), 72), "conv2.weight"),
        numpy_helper.from_array(np.zeros(16, np.float32), "conv2.bias"),
        numpy_helper.from_array(kaiming((10, 64), 32), "fc.weight"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc.bias"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv1.weight", "conv1.bias"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def load_digits(seed: int = 0):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return images[train], labels[train], images[test], labels[test]


def run_demo(out_dir: str | pathlib.Path = "demo_out", epochs: int = 20, batch_size: int = 32,
             learning_rate: float = 3e-3, seed: int = 0, progress: bool = True) -> DemoResult:
    """Generate artifacts, train, evaluate, export and verify; return the figures."""
    import onnxruntime as ort
    from tqdm import tqdm

    from onnxtrain import artifacts, runlog
    from onnxtrain.api import CheckpointState, Module, Optimizer

    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs is {epochs!r}; expected an integer >= 1")
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir)
    x_train, y_train, x_test, y_test = load_digits(seed)
    artifacts.generate_artifacts(
        build_cnn(seed), loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=out_dir, additional_output_names=["logits"],
    )
    state = CheckpointState.load_checkpoint(out_dir / "checkpoint")
    module = Module(out_dir / "training_model.onnx", state, out_dir / "eval_model.onnx")
    optimizer = Optimizer(out_dir / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(learning_rate)

    rng = np.random.default_rng(seed)
    steps_per_epoch = int(np.ceil(len(y_train) / batch_size))
    bar = tqdm(total=epochs * steps_per_epoch, disable=not progress, desc="training", unit="step", mininterval=0.5)
    log = runlog.RunLog(out_dir, name="digits CNN (onnxtrain demo)", fresh=True,
                        settings={"epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate,
                                  "seed": seed})
    loss = float("nan")
    for epoch in range(epochs):
        module.train()
        order = rng.permutation(len(y_train))
        for i in range(steps_per_epoch):
            idx = order[i * batch_size:(i + 1) * batch_size]
            began = time.perf_counter()
            loss, _ = module(x_train[idx], y_train[idx])
            optimizer.step()
            module.lazy_reset_grad()
            log.step(loss, samples=len(idx), seconds=time.perf_counter() - began, epoch=epoch + 1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{float(loss):.4f}", refresh=False)
            bar.update()
        module.eval()
        _, logits = module(x_test, y_test)
        test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
        log.evaluate(accuracy=test_accuracy, epoch=epoch + 1)
    bar.close()
    log.close()
    try:
        plot = runlog.plot(out_dir)
    except runlog.RunLogError:  # no matplotlib: the log is still there for `onnxtrain report`
        plot = None

    inference_path = out_dir / "inference_model.onnx"
    module.export_model_for_inferencing(inference_path, ["logits"])
    session = ort.InferenceSession(str(inference_path), providers=["CPUExecutionProvider"])
    (inference_logits,) = session.run(None, {"image": x_test})
    inference_accuracy = float(np.mean(np.argmax(inference_logits, axis=1) == y_test))
    return DemoResult(test_accuracy, inference_accuracy, float(loss), time.perf_counter() - start,
                      out_dir, inference_path, log.path, plot)
