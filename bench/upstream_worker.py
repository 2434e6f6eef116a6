"""Upstream onnxruntime-training (1.19.2) on-device training of one exported model: the `upstream` cell.

Runs with the upstream virtualenv's python (bench/setup_upstream.sh), which has
onnxruntime-training, onnx and numpy but neither torch nor onnxtrain:

    bench/.venv-upstream/bin/python bench/upstream_worker.py job.json result.json
    bench/.venv-upstream/bin/python bench/upstream_worker.py --check   # the venv works

``job.json`` (written by ``bench.cell``) names the ONNX model exported by the TorchScript
exporter; ``worker_loop.train`` measures the resident set size, has the artifacts generated
(``onnxruntime.training.artifacts.generate_artifacts``, cross entropy, AdamW), loads them with
``onnxruntime.training.api`` and trains (``bench/ondevice_worker.py`` does the same with
onnxtrain). It writes the same figures as a cell.

``onnxruntime.training``'s package ``__init__`` imports torch (for ORTModule and its fp16
optimizers), which the on-device part does not use; when torch is missing the worker imports
``onnxruntime.training.artifacts``/``api``/``onnxblock`` without running that ``__init__``.
"""

from __future__ import annotations

import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker_loop  # noqa: E402  (standard library, numpy and onnx only, so the upstream venv can import it)


def import_training():
    """``(artifacts, api, onnxblock)`` of onnxruntime.training, with or without torch installed."""
    try:
        from onnxruntime.training import api, artifacts, onnxblock

        return artifacts, api, onnxblock, []
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
    import onnxruntime

    for name in [m for m in sys.modules if m.startswith("onnxruntime.training")]:
        del sys.modules[name]
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import api, artifacts, onnxblock

    return artifacts, api, onnxblock, ["onnxruntime.training imported without its package __init__ (no torch)"]


def flat_cross_entropy(onnxblock, vocab: int):
    """Upstream block: cross entropy of logits [N, T, V] reshaped to [N*T, V], labels [N, T] to [N*T]."""
    import onnx
    from onnxruntime.training.onnxblock import _graph_utils

    class FlatCrossEntropy(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.ce = onnxblock.loss.CrossEntropyLoss()

        def build(self, logits_name):
            graph = self.base.graph
            labels = onnx.helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["batch", "seq"])
            graph.input.append(labels)
            names = {}
            for key, shape in (("logits", [-1, vocab]), ("labels", [-1])):
                const = _graph_utils.generate_graph_name(f"flat_{key}_shape")
                graph.node.append(onnx.helper.make_node(
                    "Constant", [], [const], value=onnx.helper.make_tensor(const, onnx.TensorProto.INT64,
                                                                          [len(shape)], shape)))
                names[key] = _graph_utils.generate_graph_name(f"flat_{key}")
                source = logits_name if key == "logits" else "labels"
                graph.node.append(onnx.helper.make_node("Reshape", [source, const], [names[key]]))
            return self.ce(names["logits"], names["labels"])

    return FlatCrossEntropy()


def run(job: dict) -> dict:
    import numpy as np
    import onnx
    import onnxruntime

    result = {"status": "ok", "error": None, "pid": os.getpid(), "phases_s": {},
              "versions": {"python": sys.version.split()[0], "onnxruntime": onnxruntime.__version__,
                           "onnx": onnx.__version__, "numpy": np.__version__}}
    artifacts, api, onnxblock, notes = import_training()
    result["notes"] = notes
    model = onnx.load(job["model_path"])

    def generate(out: str) -> None:
        nonlocal model
        loss = flat_cross_entropy(onnxblock, job["vocab"]) if job["kind"] == "lm" else \
            artifacts.LossType.CrossEntropyLoss
        artifacts.generate_artifacts(model, requires_grad=job["requires_grad"], frozen_params=job["frozen_params"],
                                     loss=loss, optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
        model = None

    def open_module(out: str):
        state = api.CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
        try:
            module = api.Module(os.path.join(out, "training_model.onnx"), state, os.path.join(out, "eval_model.onnx"))
        except Exception as exc:  # noqa: BLE001 - e.g. its eval model of a training-mode BatchNormalization
            # does not load; training does not need the eval model: go on without it, and say so
            reason = re.sub(r"Load model from \S+ failed: ?", "", str(exc).split("FAIL : ")[-1]).strip()[:300]
            notes.append(f"upstream's eval_model.onnx does not load ({reason}); "
                         f"the Module was created without it")
            module = api.Module(os.path.join(out, "training_model.onnx"), state)
        labels = {i.name: i.type for i in onnx.load(os.path.join(out, "training_model.onnx"),
                                                      load_external_data=False).graph.input}.get("labels")
        int32 = labels is not None and labels.tensor_type.elem_type == onnx.TensorProto.INT32
        return module, api.Optimizer(os.path.join(out, "optimizer_model.onnx"), module), \
            np.int32 if int32 else np.int64

    return worker_loop.train(job, result, generate, open_module)


def check() -> int:
    """``--check``: the on-device training API imports; print the versions."""
    import onnx
    import onnxruntime

    _, api, _, notes = import_training()
    print(f"upstream venv ready: onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
          f"{api.Module.__module__}" + (f" ({notes[0]})" if notes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(check() if sys.argv[1:] == ["--check"] else worker_loop.main(run, sys.argv[1:3]))
