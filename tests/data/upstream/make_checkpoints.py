"""Write the onnxruntime-training 1.19.2 checkpoints that tests/test_upstream_checkpoint.py reads.

Run with upstream's on-device training package (``bash bench/setup_upstream.sh`` makes the venv):

    bench/.venv-upstream/bin/python tests/data/upstream/make_checkpoints.py tests/data/upstream

It builds a small MLP (``model.onnx``), generates upstream's artifacts (AdamW, cross entropy,
``fc2.bias`` frozen), trains 3 steps, saves ``checkpoint_trained`` with the optimizer state and
three properties, then loads that file into a fresh upstream state and trains 2 more steps:
``expected.json`` holds the data, the parameters saved, and the losses and parameters of the
resumed steps, which onnxtrain must reproduce from the same file. ``nominal_checkpoint``,
``training_model.onnx`` and ``optimizer_model.onnx`` are upstream's artifacts (their graphs
need upstream's training build: onnxtrain names them as such). ``checkpoint_sgd`` is an SGD
run's (with a LinearLRScheduler), ``expected.json["sgd"]`` what upstream resumed from it with.
"""

import json
import os
import shutil
import sys
import tempfile
import types

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper


def import_training():
    """onnxruntime.training's on-device parts without its package __init__ (which imports torch)."""
    for name in [m for m in sys.modules if m.startswith("onnxruntime.training")]:
        del sys.modules[name]
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import api, artifacts

    return api, artifacts


def build_model(rng):
    params = {"fc1.weight": rng.standard_normal((4, 3)).astype(np.float32),
              "fc1.bias": rng.standard_normal((3,)).astype(np.float32),
              "fc2.weight": rng.standard_normal((3, 2)).astype(np.float32),
              "fc2.bias": rng.standard_normal((2,)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["input", "fc1.weight"], ["h0"]),
             helper.make_node("Add", ["h0", "fc1.bias"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "fc2.weight"], ["h3"]),
             helper.make_node("Add", ["h3", "fc2.bias"], ["output"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 2])],
                              [numpy_helper.from_array(v, k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def sgd_checkpoint(api, artifacts, model, x, y, out: str) -> dict:
    """SGD with a LinearLRScheduler(initial_lr=0.1): ``checkpoint_sgd`` after 2 steps, with the
    optimizer state (upstream's SGD saves an all-zero momentum0), and what upstream resumes with."""
    with tempfile.TemporaryDirectory() as art:
        artifacts.generate_artifacts(model, requires_grad=["fc1.weight", "fc1.bias", "fc2.weight"],
                                     frozen_params=["fc2.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=art)

        def open_training(checkpoint):
            state = api.CheckpointState.load_checkpoint(checkpoint)
            module = api.Module(os.path.join(art, "training_model.onnx"), state)
            module.train()
            return state, module, api.Optimizer(os.path.join(art, "optimizer_model.onnx"), module)

        state, module, optimizer = open_training(os.path.join(art, "checkpoint"))
        scheduler = api.LinearLRScheduler(optimizer, warmup_step_count=0, total_step_count=10, initial_lr=0.1)
        for _ in range(2):
            module(x, y)
            optimizer.step()
            scheduler.step()
            module.lazy_reset_grad()
        saved = os.path.join(out, "checkpoint_sgd")
        api.CheckpointState.save_checkpoint(state, saved, include_optimizer_state=True)
        state, module, optimizer = open_training(saved)
        resumed_lr = optimizer.get_learning_rate()
        loss = float(module(x, y))
        optimizer.step()
        return {"resumed_learning_rate": resumed_lr, "resumed_loss": loss,
                "resumed_parameters": {n: p.data.tolist() for n, p in state.parameters}}


def main(out: str) -> None:
    api, artifacts = import_training()
    rng = np.random.default_rng(0)
    model = build_model(rng)
    os.makedirs(out, exist_ok=True)
    onnx.save(model, os.path.join(out, "model.onnx"))
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.integers(0, 2, 8).astype(np.int64)
    lr = 0.05
    with tempfile.TemporaryDirectory() as art:
        artifacts.generate_artifacts(model, requires_grad=["fc1.weight", "fc1.bias", "fc2.weight"],
                                     frozen_params=["fc2.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=art,
                                     nominal_checkpoint=True)
        for name in ("nominal_checkpoint", "training_model.onnx", "optimizer_model.onnx"):
            shutil.copy(os.path.join(art, name), os.path.join(out, name))

        def open_training(checkpoint):
            state = api.CheckpointState.load_checkpoint(checkpoint)
            module = api.Module(os.path.join(art, "training_model.onnx"), state, os.path.join(art, "eval_model.onnx"))
            optimizer = api.Optimizer(os.path.join(art, "optimizer_model.onnx"), module)
            optimizer.set_learning_rate(lr)
            module.train()
            return state, module, optimizer

        def train(module, optimizer, steps):
            losses = []
            for _ in range(steps):
                losses.append(float(module(x, y)))
                optimizer.step()
                module.lazy_reset_grad()
            return losses

        state, module, optimizer = open_training(os.path.join(art, "checkpoint"))
        first_losses = train(module, optimizer, 3)
        state.properties["epoch"] = 7
        state.properties["best_loss"] = 0.1
        state.properties["device"] = "device-a"
        saved = os.path.join(out, "checkpoint_trained")
        api.CheckpointState.save_checkpoint(state, saved, include_optimizer_state=True)
        saved_params = {n: p.data.tolist() for n, p in state.parameters}

        state, module, optimizer = open_training(saved)
        resumed_losses = train(module, optimizer, 2)
        resumed_params = {n: p.data.tolist() for n, p in state.parameters}

        sgd = sgd_checkpoint(api, artifacts, model, x, y, out)

    expected = {"onnxruntime_training": onnxruntime.__version__, "learning_rate": lr, "sgd": sgd,
                "input": x.tolist(), "labels": y.tolist(), "first_losses": first_losses,
                "saved_parameters": saved_params, "resumed_losses": resumed_losses,
                "resumed_parameters": resumed_params}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
