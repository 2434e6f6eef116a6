"""onnxtrain's on-device training of one exported model: the `ondevice` cell's worker.

Runs with the main environment's python in a process of its own that never imports torch, as
an app on a device would (and as ``upstream_worker.py`` runs upstream's on-device API):

    python bench/ondevice_worker.py job.json result.json

The cell exports the model (``torch.onnx.export``, dynamo) and writes ``job.json``;
``worker_loop.train`` measures the resident set size, has the artifacts generated
(``onnxtrain.artifacts.generate_artifacts``, cross entropy, ``OptimType.AdamW``: upstream's
AdamW), loads them with ``onnxtrain.api`` and trains. So both on-device systems' figures cover
the same work: artifacts, sessions and steps, without the exporter.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root, for bench.cell's loss block
import worker_loop  # noqa: E402


def run(job: dict) -> dict:
    import numpy as np
    import onnx
    import onnxruntime

    import onnxtrain
    from bench.cell import flat_cross_entropy_block
    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module, Optimizer

    result = {"status": "ok", "error": None, "pid": os.getpid(), "phases_s": {}, "notes": [],
              "onnxtrain_file": onnxtrain.__file__,
              "versions": {"python": sys.version.split()[0], "onnxruntime": onnxruntime.__version__,
                           "onnx": onnx.__version__, "numpy": np.__version__, "onnxtrain": onnxtrain.__version__}}
    model = onnx.load(job["model_path"])

    def generate(out: str) -> None:
        nonlocal model
        loss = flat_cross_entropy_block() if job["kind"] == "lm" else artifacts.LossType.CrossEntropyLoss
        artifacts.generate_artifacts(model, requires_grad=job["requires_grad"], loss=loss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=out,
                                     loss_input_names=["output"])
        model = None

    def open_module(out: str):
        state = CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
        module = Module(os.path.join(out, "training_model.onnx"), state, os.path.join(out, "eval_model.onnx"))
        return module, Optimizer(os.path.join(out, "optimizer_model.onnx"), module), np.int32

    result = worker_loop.train(job, result, generate, open_module)
    if "torch" in sys.modules:  # the figures would not be on-device training's alone
        raise RuntimeError("the on-device worker imported torch")
    return result


if __name__ == "__main__":
    sys.exit(worker_loop.main(run, sys.argv[1:3]))
