"""Fixtures the JavaScript tests compare against, made with the Python runtime.

    python tests/js/fixtures.py OUT_DIR

writes into ``OUT_DIR`` the digits CNN, its artifacts and data (``examples/digits_for_js.py``),
``fixture.json`` (the run's settings), and two checkpoints of an uninterrupted Python run
(``onnxtrain.api``, constant learning rate, batch ``k`` = training samples
``[k*B, (k+1)*B)``), both with optimizer state: ``python_step20`` after 20 steps and
``python_step40`` after 40; and ``ort_format/`` holds the three graphs converted to ORT format
(``.ort``) by onnxruntime's own converter. ``small/`` holds two small MLPs that exercise the
rest of the contract, with Python runs of ``SMALL["steps"]`` steps (``small/<name>/python_steps``):
``plain`` (Gemm, Relu, Gemm: ops every onnxruntime-web backend has, WebGPU included),
``batchnorm`` (training-mode BatchNormalization: running statistics written back each step)
and ``fp16`` (``precision="fp16"``: dynamic loss scaling, with an overflowing scale forced
before step ``OVERFLOW_STEP`` so that the step is skipped and the scale backs off). The Node test trains the first 20 steps itself and must match
``python_step20``; its checkpoint ``node_step20`` is then resumed by Python (``resume``) and
must match ``python_step40``. ``two_heads/`` holds the artifacts of a model with two heads and the
loss on one (``two_heads.json``: an input and the base model's outputs for it, run by onnxruntime):
the eval model keeps every output of the base model for export. ``upstream/`` serves the reading of onnxruntime-training's
checkpoints (the files in tests/data/upstream, written by upstream 1.19.2): ``artifacts/``, made
by onnxtrain from upstream's ``model.onnx``, resume its ``checkpoint_trained`` (``artifacts_sgd/``: its
``checkpoint_sgd``); ``external/``
holds a checkpoint in upstream's layout with its tensors in ``checkpoint.data`` (tests/upstream_odtc.py) and ``values.json``, its tensors; and
``float32.json`` pairs float32 bit patterns with what Python reads for them
(``float(str(np.float32(x)))``, upstream's learning rate and float properties).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = {"batch_size": 32, "learning_rate": 3e-3, "steps": 20, "tolerance": 1e-4}
SMALL = {"steps": 8, "rows": 16, "learning_rate": 1e-2, "overflow_step": 2, "overflow_scale": 2.0 ** 20}


def digits_for_js():
    """examples/digits_for_js.py, imported by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("digits_for_js", ROOT / "examples" / "digits_for_js.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_data(out_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of digits.bin as the JavaScript side reads them (through digits.json)."""
    index = json.loads((out_dir / "digits.json").read_text())
    raw = (out_dir / "digits.bin").read_bytes()
    arrays = {}
    for split, entries in index.items():
        for name, entry in entries.items():
            count = int(np.prod(entry["dims"]))
            arrays[f"{split}_{name}"] = np.frombuffer(raw, dtype=np.dtype(entry["dtype"]).newbyteorder("<"),
                                                      count=count, offset=entry["offset"]).reshape(entry["dims"])
    return arrays


def train(out_dir: pathlib.Path, checkpoint: pathlib.Path, first_batch: int, steps: int, save_to: pathlib.Path) -> None:
    """Resume from ``checkpoint`` (with or without optimizer state), run ``steps`` steps from
    batch ``first_batch`` and save the state with its optimizer state to ``save_to``."""
    from onnxtrain.api import CheckpointState, Module, Optimizer

    data = load_data(out_dir)
    artifacts = out_dir / "artifacts"
    state = CheckpointState.load_checkpoint(checkpoint)
    module = Module(artifacts / "training_model.onnx", state, artifacts / "eval_model.onnx")
    optimizer = Optimizer(artifacts / "optimizer_model.onnx", module)
    if optimizer.step_count == 0:
        optimizer.set_learning_rate(SETTINGS["learning_rate"])
    size = SETTINGS["batch_size"]
    for k in range(first_batch, first_batch + steps):
        module(data["train_images"][k * size:(k + 1) * size], data["train_labels"][k * size:(k + 1) * size])
        optimizer.step()
        module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, save_to, include_optimizer_state=True)


def make_fixtures(out_dir: str | pathlib.Path) -> pathlib.Path:
    out_dir = pathlib.Path(out_dir)
    digits_for_js().write_all(out_dir)
    (out_dir / "fixture.json").write_text(json.dumps(SETTINGS))
    steps = SETTINGS["steps"]
    initial = out_dir / "artifacts" / "checkpoint"
    train(out_dir, initial, 0, steps, out_dir / "python_step20")
    add_properties(out_dir / "python_step20")
    train(out_dir, initial, 0, 2 * steps, out_dir / "python_step40")
    write_ort_format(out_dir / "artifacts", out_dir / "ort_format")
    write_small_models(out_dir / "small")
    write_upstream(out_dir / "upstream")
    write_shapeless(out_dir / "shapeless")
    write_two_heads(out_dir / "two_heads")
    return out_dir


# integers JavaScript numbers cannot hold (exact as BigInt), and a name objects inherit
BIG_PROPERTIES = {"time_ns": 1764300000123456789, "seed": 2**63 - 25, "low": -(2**63), "__proto__": "kept"}


def add_properties(checkpoint: pathlib.Path) -> None:
    """Add :data:`BIG_PROPERTIES` to a checkpoint (Node must carry them through exactly)."""
    from onnxtrain.api import CheckpointState

    state = CheckpointState.load_checkpoint(checkpoint)
    for name, value in BIG_PROPERTIES.items():
        state.properties[name] = value
    CheckpointState.save_checkpoint(state, checkpoint, include_optimizer_state=True)


def write_shapeless(out: pathlib.Path) -> None:
    """Artifacts of ``x * w`` whose input ``x`` is declared without a shape (any rank)."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain import artifacts

    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "shapeless",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=out)


def two_heads_model():
    """x [N, 4] -> Gemm, Relu ``hidden`` -> Gemm ``score`` (the loss reads it) and Sigmoid(Gemm)
    ``probs`` (it does not); ``features`` is an Identity of ``hidden`` (as exporters write an aliased
    output)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name, shape in
             (("w1", (6, 4)), ("b1", (6,)), ("w2", (2, 6)), ("b2", (2,)), ("w3", (3, 6)), ("b3", (3,)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["pre"], transB=1),
             helper.make_node("Relu", ["pre"], ["hidden"]),
             helper.make_node("Gemm", ["hidden", "w2", "b2"], ["score"], transB=1),
             helper.make_node("Gemm", ["hidden", "w3", "b3"], ["logits3"], transB=1),
             helper.make_node("Sigmoid", ["logits3"], ["probs"]),
             helper.make_node("Identity", ["hidden"], ["features"])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", size])
               for name, size in (("score", 2), ("probs", 3), ("features", 6))]
    graph = helper.make_graph(nodes, "two_heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def write_two_heads(out: pathlib.Path) -> None:
    """Artifacts of :func:`two_heads_model` with an MSE loss on ``score``, and ``two_heads.json``:
    an input and the base model's outputs for it."""
    import onnxruntime as ort

    from onnxtrain import artifacts

    model = two_heads_model()
    artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, loss_input_names=["score"],
                                 requires_grad=["w1", "b1", "w2", "b2"], frozen_params=["w3", "b3"], optimizer=artifacts.OptimType.SGD, artifact_directory=out)
    x = np.random.default_rng(4).standard_normal((5, 4)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    (out / "two_heads.json").write_text(json.dumps(
        {"x": x.reshape(-1).tolist(), "x_dims": list(x.shape),
         "outputs": {name: {"values": v.reshape(-1).tolist(), "dims": list(v.shape)} for name, v in expected.items()}}))


def _small_mlp(rng: np.random.Generator, batchnorm: bool):
    """x [N, 12] -> Gemm 16 -> (BatchNormalization, training mode) -> Relu -> Gemm 5."""
    from onnx import TensorProto, helper, numpy_helper

    def init(name, array):
        return numpy_helper.from_array(np.asarray(array, np.float32), name)

    inits = [init("fc1.weight", rng.standard_normal((16, 12)) * 0.3), init("fc1.bias", np.zeros(16)),
             init("fc2.weight", rng.standard_normal((5, 16)) * 0.3), init("fc2.bias", np.zeros(5))]
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["hidden"], transB=1)]
    last = "hidden"
    if batchnorm:
        inits += [init("bn.weight", np.ones(16)), init("bn.bias", np.zeros(16)),
                  init("bn.running_mean", np.zeros(16)), init("bn.running_var", np.ones(16))]
        nodes.append(helper.make_node("BatchNormalization", ["hidden", "bn.weight", "bn.bias", "bn.running_mean",
                                                             "bn.running_var"], ["normed", "batch_mean", "batch_var"],
                                      training_mode=1, momentum=0.9))
        last = "normed"
    nodes += [helper.make_node("Relu", [last], ["relu"]),
              helper.make_node("Gemm", ["relu", "fc2.weight", "fc2.bias"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "small_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def write_small_models(out: pathlib.Path) -> None:
    """Artifacts, data (data.json) and a Python run for the plain, batchnorm and fp16 MLPs."""
    from onnxtrain import artifacts
    from onnxtrain.api import CheckpointState, Module, Optimizer

    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 5, 64).astype(np.int32)
    # float32 -> Python float -> JSON is exact, and Float32Array.from() rounds it back to the same value
    (out / "data.json").write_text(json.dumps({"x": x.reshape(-1).tolist(), "x_dims": list(x.shape),
                                               "y": y.tolist(), **SMALL}))
    for name, batchnorm, precision in (("plain", False, "fp32"), ("batchnorm", True, "fp32"), ("fp16", False, "fp16")):
        folder = out / name
        artifacts.generate_artifacts(_small_mlp(rng, batchnorm), loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                     precision=precision)
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(SMALL["learning_rate"])
        rows = SMALL["rows"]
        for k in range(SMALL["steps"]):
            if precision == "fp16" and k == SMALL["overflow_step"]:
                state.properties["loss_scale"] = SMALL["overflow_scale"]
            start = (k * rows) % len(x)
            module(x[start:start + rows], y[start:start + rows])
            optimizer.step()
            module.lazy_reset_grad()
        CheckpointState.save_checkpoint(state, folder / "python_steps", include_optimizer_state=True)
        if name != "plain":  # their training metadata (statistics, loss scale) must be read from .ort too
            write_ort_format(folder, folder / "ort_format")


UPSTREAM_DATA = ROOT / "tests" / "data" / "upstream"
UPSTREAM_TRAINABLE = ["fc1.weight", "fc1.bias", "fc2.weight"]


def write_upstream(out: pathlib.Path) -> None:
    """Artifacts of upstream's model.onnx, an external-data checkpoint and float32 roundings."""
    from onnxtrain import artifacts
    from tests.upstream_odtc import external_fixture, odtc_bytes, repeated_momentum_bytes

    out.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(str(UPSTREAM_DATA / "model.onnx"), requires_grad=UPSTREAM_TRAINABLE,
                                 frozen_params=["fc2.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out / "artifacts")
    artifacts.generate_artifacts(str(UPSTREAM_DATA / "model.onnx"), requires_grad=UPSTREAM_TRAINABLE,
                                 frozen_params=["fc2.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=out / "artifacts_sgd")

    # one momentum tensor referenced many times: refused before it is read again
    (out / "repeated_momentum").write_bytes(repeated_momentum_bytes(np.ones(2**20, np.float32), references=20_000))

    trainable, frozen = external_fixture()
    checkpoint, data = odtc_bytes(trainable, frozen, inline={"b"})
    folder = out / "external"
    folder.mkdir(exist_ok=True)
    (folder / "checkpoint").write_bytes(checkpoint)
    (folder / "checkpoint.data").write_bytes(data)

    def values(array: np.ndarray) -> list:
        flat = array.reshape(-1)
        if array.dtype == np.float16:
            return flat.view(np.uint16).tolist()  # onnxruntime's JavaScript float16: the bit patterns
        if array.dtype == np.int64:
            return [str(v) for v in flat.tolist()]  # BigInt64Array
        return flat.astype(np.uint8).tolist() if array.dtype == np.bool_ else flat.tolist()

    (folder / "values.json").write_text(json.dumps(
        [{"name": name, "requires_grad": name in trainable, "dtype": str(array.dtype), "shape": list(array.shape),
          "values": values(array)} for name, array in [*trainable.items(), *frozen.items()]]))

    # float32 values read the way Python reads upstream's learning rate and float properties
    rng = np.random.default_rng(5)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 1500, dtype=np.uint64).astype(np.uint32),
                           np.array([(e << 23) | m for e in range(0, 255, 7) for m in (0, 1, 0x7FFFFF)], np.uint32),
                           np.array([0.1, 1e-3, 0.05, 3e-3, 343126.125, -64311768.0, 1e-45], np.float32).view(np.uint32)])
    floats = bits.view(np.float32)
    (out / "float32.json").write_text(json.dumps(
        [[int(b), float(str(f))] for b, f in zip(bits, floats) if np.isfinite(f)]))


def write_ort_format(artifacts: pathlib.Path, out: pathlib.Path) -> None:
    """The training, eval and optimizer models as ORT-format files (``<name>.ort``)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("training_model", "eval_model", "optimizer_model"):
        shutil.copy2(artifacts / f"{name}.onnx", out / f"{name}.onnx")
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(out),
                    "--optimization_style", "Fixed"], check=True, capture_output=True, text=True)


def resume(out_dir: str | pathlib.Path, checkpoint: str | pathlib.Path, save_to: str | pathlib.Path) -> None:
    """Continue the run saved in ``checkpoint`` (after ``steps`` steps) for ``steps`` more."""
    train(pathlib.Path(out_dir), pathlib.Path(checkpoint), SETTINGS["steps"], SETTINGS["steps"], pathlib.Path(save_to))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/js/fixtures.py OUT_DIR")
    make_fixtures(sys.argv[1])
    print(f"fixtures written to {sys.argv[1]}")
