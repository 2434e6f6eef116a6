"""Export a PyTorch MLP, generate training artifacts, train it on stock onnxruntime, export it.

Run: python examples/pytorch_export_to_artifacts.py  (needs torch and scikit-learn)
"""

from __future__ import annotations

import pathlib
import tempfile
import time

import numpy as np
import onnxruntime as ort
import torch
from sklearn.datasets import load_digits
from tqdm import tqdm

from onnxtrain import artifacts, onnxblock
from onnxtrain.api import CheckpointState, LinearLRScheduler, Module, Optimizer
from onnxtrain.runlog import RunLog
from onnxtrain.torch import export_for_training


def main(out: pathlib.Path) -> float:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1400], order[1400:]
    x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    exported = export_for_training(model, (torch.zeros(8, 64),), input_names=["pixels"], output_names=["logits"],
                                   dynamic_shapes=({0: torch.export.Dim("batch")},))
    artifacts.generate_artifacts(
        exported,
        requires_grad=[name for name, _ in model.named_parameters()],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=onnxblock.optim.AdamW(mode="torch", weight_decay=0.01),  # exactly torch.optim.AdamW
        artifact_directory=out,
        additional_output_names=["logits"],
    )

    state = CheckpointState.load_checkpoint(out / "checkpoint")
    module = Module(out / "training_model.onnx", state, out / "eval_model.onnx")
    optimizer = Optimizer(out / "optimizer_model.onnx", module)
    epochs, batch = 15, 50
    steps = epochs * (len(y_train) // batch)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=steps // 10, total_step_count=steps, initial_lr=1e-2)
    rng = np.random.default_rng(0)
    # the run's record (out/run.jsonl): `onnxtrain report OUT --plot` summarizes and draws it
    with RunLog(out, name="digits MLP exported from PyTorch", settings={"epochs": epochs, "batch": batch}) as log, \
            tqdm(total=steps, desc="training", unit="step") as bar:
        for _ in range(epochs):
            order = rng.permutation(len(y_train))
            for i in range(len(y_train) // batch):
                idx = order[i * batch:(i + 1) * batch]
                began = time.perf_counter()
                loss, _ = module(x_train[idx], y_train[idx])
                optimizer.step()
                scheduler.step()
                module.lazy_reset_grad()
                log.step(loss, samples=len(idx), seconds=time.perf_counter() - began)
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
                bar.update()

    module.export_model_for_inferencing(out / "inference.onnx", ["logits"])
    session = ort.InferenceSession(str(out / "inference.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"pixels": x_test})
    accuracy = float(np.mean(logits.argmax(axis=1) == y_test))
    state.properties["test_accuracy"] = accuracy
    CheckpointState.save_checkpoint(state, out / "trained_checkpoint")
    print(f"held-out accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main(pathlib.Path(tempfile.mkdtemp(prefix="onnxtrain-example-")))
