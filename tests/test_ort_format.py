"""ORT format artifacts (mobile, minimal builds): convert_to_ort_format and training from .ort files.

The .ort files are the stock converter's output (an onnxruntime session saves its optimized
graph in ORT format); training from them must give the same numbers, bit for bit, as training
from the .onnx files with the runtime's own session options (with Convs in the standard layout:
the blocked one that CPU sessions of .onnx files get rounds differently), and the required-operators config
must list exactly the operators of the three converted models in the format onnxruntime's
reduced-build scripts read.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.tools.reduced_build_config_parser import parse_config

from onnxtrain import artifacts
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.demo import build_cnn, load_digits
from onnxtrain.errors import ArtifactError, ModelError
from onnxtrain.runtime import fusions
from tests.test_artifacts import batches as regression_batches, regression_model

MODELS = ("training_model", "eval_model", "optimizer_model")
STEPS = 10


def layernorm_gelu_mlp(seed: int = 0) -> onnx.ModelProto:
    """x[N, 12] -> MatMul + bias -> LayerNormalization -> GELU (erf form) -> Dropout (inference
    mode: off) -> Gemm -> logits[N, 5]: ops the CNN lacks, and patterns onnxruntime fuses into its
    own ops at the "extended" level (MatMul + Add, Gelu)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((12, 16)) * 0.3).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "fc1.bias"),
        numpy_helper.from_array(np.ones(16, np.float32), "norm.weight"),
        numpy_helper.from_array(np.zeros(16, np.float32), "norm.bias"),
        numpy_helper.from_array((rng.standard_normal((5, 16)) * 0.3).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(5, np.float32), "fc2.bias"),
        numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["mm"]),
        helper.make_node("Add", ["mm", "fc1.bias"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "norm.weight", "norm.bias"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Div", ["n", "sqrt2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["erf1"]),
        helper.make_node("Mul", ["n", "erf1"], ["g0"]),
        helper.make_node("Mul", ["g0", "half"], ["g"]),
        helper.make_node("Dropout", ["g"], ["d"], seed=0),
        helper.make_node("Gemm", ["d", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "layernorm_gelu_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def batchnorm_cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv -> training-mode BatchNormalization -> Relu -> Flatten -> Gemm on [N, 1, 8, 8]: the
    training model also outputs the running statistics' new values (metadata buffer_updates)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 1, 3, 3)) * 0.3).astype(np.float32), "conv.weight"),
        numpy_helper.from_array(np.ones(4, np.float32), "bn.weight"),
        numpy_helper.from_array(np.zeros(4, np.float32), "bn.bias"),
        numpy_helper.from_array(np.zeros(4, np.float32), "bn.running_mean"),
        numpy_helper.from_array(np.ones(4, np.float32), "bn.running_var"),
        numpy_helper.from_array((rng.standard_normal((10, 256)) * 0.1).astype(np.float32), "fc.weight"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv.weight"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["b", "mean", "var"], training_mode=1, momentum=0.9),
        helper.make_node("Relu", ["b"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "batchnorm_cnn",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def mlp_batches(count: int, size: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, 12)).astype(np.float32), rng.integers(0, 5, size).astype(np.int32))
            for _ in range(count)]


def digits_batches(count: int, size: int = 32):
    images, labels, _, _ = load_digits(0)
    return [(images[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]) for i in range(count)]


def single_thread() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return options


def train(directory: pathlib.Path, extension: str, batches, export_output: str, tmp_path: pathlib.Path):
    """STEPS AdamW steps from the artifacts' .onnx or .ort files: losses, parameters, eval loss and
    the exported inference model's output on the first batch."""
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / f"training_model.{extension}", state, directory / f"eval_model.{extension}",
                    session_options=single_thread())
    optimizer = Optimizer(directory / f"optimizer_model.{extension}", module)
    optimizer.set_learning_rate(0.01)
    losses = []
    for x, y in batches:
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    eval_loss = float(module.eval()(*batches[0]))
    exported = tmp_path / f"inference_from_{extension}.onnx"
    module.export_model_for_inferencing(exported, [export_output])
    session = ort.InferenceSession(exported, single_thread(), providers=["CPUExecutionProvider"])
    inference = session.run(None, {session.get_inputs()[0].name: batches[0][0]})[0]
    params = {name: p.data.copy() for name, p in state.parameters.items()}
    return losses, params, eval_loss, inference


def _case(name: str):
    """(model, generate_artifacts options, batches, output to export) of a bit-identity case."""
    crossentropy = {"loss": artifacts.LossType.CrossEntropyLoss}
    if name == "digits_cnn":
        return build_cnn(), crossentropy, digits_batches(STEPS), "logits"
    if name == "layernorm_gelu_mlp":
        return layernorm_gelu_mlp(), crossentropy, mlp_batches(STEPS), "logits"
    if name == "batchnorm_cnn":  # running statistics written back after each step
        return batchnorm_cnn(), {**crossentropy, "frozen_params": ["bn.running_mean", "bn.running_var"],
                                 "requires_grad": ["conv.weight", "bn.weight", "bn.bias", "fc.weight"]}, \
            digits_batches(STEPS), "logits"
    # fp16 with dynamic loss scaling: loss_scale inputs, the optimizer's If on all_finite
    return regression_model(), {"loss": artifacts.LossType.MSELoss, "precision": "fp16"}, \
        list(regression_batches(0, STEPS)), "y"


@pytest.mark.parametrize("case", ["digits_cnn", "layernorm_gelu_mlp", "batchnorm_cnn", "fp16_regression"])
def test_training_from_ort_files_is_bit_identical_to_onnx(tmp_path, case, monkeypatch):
    model, options, batches, output = _case(case)
    directory = tmp_path / "artifacts"
    artifacts.generate_artifacts(model, optimizer=artifacts.OptimType.AdamW, artifact_directory=directory,
                                 ort_format=True, **options)
    for name in MODELS:
        assert (directory / f"{name}.ort").read_bytes()[4:8] == b"ORTM"  # ORT format flatbuffers
    # sessions for .onnx files on the CPU move Convs to onnxruntime's blocked layout (this CPU's,
    # so never into .ort files): other summation orders, rounding-level differences
    with_blocked_convs = train(directory, "onnx", batches, output, tmp_path)
    monkeypatch.setattr(fusions, "nchwc_block_size", lambda: None)
    from_onnx = train(directory, "onnx", batches, output, tmp_path)
    from_ort = train(directory, "ort", batches, output, tmp_path)
    losses, params, eval_loss, inference = from_onnx
    np.testing.assert_allclose(with_blocked_convs[0], losses, rtol=1e-4)
    assert from_ort[0] == losses  # every loss, bit for bit
    assert losses[-1] < losses[0]  # it trained
    assert params.keys() == from_ort[1].keys()
    for name, value in params.items():
        assert np.array_equal(value, from_ort[1][name]), name
    assert from_ort[2] == eval_loss
    assert np.array_equal(from_ort[3], inference)
    if case == "batchnorm_cnn":  # the training-mode statistics were written back, from both files
        assert not np.array_equal(params["bn.running_mean"], np.zeros(4, np.float32))


def test_metadata_and_io_survive_the_conversion(tmp_path):
    artifacts.generate_artifacts(layernorm_gelu_mlp(), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path, ort_format=True)
    for name in MODELS:
        sessions = [ort.InferenceSession(tmp_path / f"{name}.{ext}", providers=["CPUExecutionProvider"])
                    for ext in ("onnx", "ort")]
        onnx_meta, ort_meta = (s.get_modelmeta().custom_metadata_map for s in sessions)
        assert ort_meta == onnx_meta and any(key.startswith("onnxtrain.") for key in ort_meta)
        for key in ort_meta:
            json.loads(ort_meta[key])
        for listing in ("get_inputs", "get_outputs"):
            onnx_io, ort_io = ([(a.name, a.type, a.shape) for a in getattr(s, listing)()] for s in sessions)
            assert ort_io == onnx_io


def _optimized_onnx_nodes(model_path: pathlib.Path, saved: pathlib.Path):
    """(domain, since_version, op_type) of every node, subgraphs included, of the graph onnxruntime
    makes from ``model_path`` with the conversion's settings, saved as ONNX to read it independently."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(saved)
    ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=["NchwcTransformer"])
    model = onnx.load(saved)
    opsets = {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}

    def walk(graph):
        for node in graph.node:
            domain = node.domain or "ai.onnx"
            if domain == "ai.onnx":  # the operator's version in effect at the model's opset
                version = onnx.defs.get_schema(node.op_type, opsets[domain], "").since_version
            else:  # onnxruntime's com.microsoft ops: all at version 1 of their domain
                version = opsets[domain]
            yield domain, version, node.op_type
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attribute.g)

    return set(walk(model.graph))


def test_required_operators_config_lists_exactly_the_models_ops(tmp_path):
    directory = tmp_path / "artifacts"
    artifacts.generate_artifacts(build_cnn(), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
    result = artifacts.convert_to_ort_format(directory)
    assert result.models == tuple(directory / f"{name}.ort" for name in MODELS)
    assert result.config == directory / "required_operators.config"
    required, type_filter = parse_config(str(result.config))  # onnxruntime's own reader
    assert type_filter is None
    listed = {(domain, opset, op) for domain, by_opset in required.items()
              for opset, ops in by_opset.items() for op in ops}
    expected = set()
    for name in MODELS:
        expected |= _optimized_onnx_nodes(directory / f"{name}.onnx", tmp_path / f"{name}.optimized.onnx")
    assert listed == expected
    # the optimized graphs use onnxruntime's fused ops; the If of the optimizer's subgraph is in
    assert ("com.microsoft", 1, "FusedMatMul") in listed and ("ai.onnx", 16, "If") in listed


def test_type_reduction_config_and_basic_level(tmp_path):
    directory = tmp_path / "artifacts"
    artifacts.generate_artifacts(build_cnn(), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
    typed = artifacts.convert_to_ort_format(directory, enable_type_reduction=True)
    assert typed.config.name == "required_operators_and_types.config"
    required, type_filter = parse_config(str(typed.config), enable_type_reduction=True)
    assert type_filter is not None
    assert 'MaxPool{"inputs": {"0": ["float"]}}' in typed.config.read_text()
    untyped, _ = parse_config(str(artifacts.convert_to_ort_format(directory).config))
    assert required == untyped

    # "basic" keeps standard ONNX ops only: a build with --disable_contrib_ops can run the models
    basic = artifacts.convert_to_ort_format(directory, optimization_level="basic")
    required, _ = parse_config(str(basic.config))
    assert set(required) == {"ai.onnx"} and "Conv" in required["ai.onnx"][11]


def test_prefix_and_missing_optimizer_model(tmp_path):
    artifacts.generate_artifacts(layernorm_gelu_mlp(), loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path, prefix="mlp_", ort_format=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".ort", ".config")) == [
        "mlp_eval_model.ort", "mlp_required_operators.config", "mlp_training_model.ort"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ort_format.")]  # scratch folder removed


def test_conversion_errors(tmp_path):
    with pytest.raises(ArtifactError, match="artifact directory .*missing.* does not exist"):
        artifacts.convert_to_ort_format(tmp_path / "missing")
    with pytest.raises(ArtifactError, match="holds no training model 'training_model.onnx'"):
        artifacts.convert_to_ort_format(tmp_path)
    (tmp_path / "training_model.onnx").write_bytes(b"not a model")
    with pytest.raises(ArtifactError, match="could not convert .*training_model.onnx"):
        artifacts.convert_to_ort_format(tmp_path)
    assert not list(tmp_path.glob("*.ort"))
    with pytest.raises(ArtifactError, match="optimization_level must be one of"):
        artifacts.convert_to_ort_format(tmp_path, optimization_level="max")
    with pytest.raises(ArtifactError, match="target_platform must be None or one of"):
        artifacts.convert_to_ort_format(tmp_path, target_platform="x86")


def test_export_from_ort_eval_model_needs_the_onnx_eval_graph(tmp_path):
    artifacts.generate_artifacts(layernorm_gelu_mlp(), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path, ort_format=True)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.ort", state, tmp_path / "eval_model.ort")
    # an .onnx of another model next to the .ort file is refused
    (tmp_path / "eval_model.onnx").rename(tmp_path / "kept.onnx")
    (tmp_path / "training_model.onnx").rename(tmp_path / "eval_model.onnx")
    with pytest.raises(ModelError, match="does not have the inputs and outputs of the ORT format eval model"):
        module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    (tmp_path / "eval_model.onnx").unlink()
    with pytest.raises(ModelError, match="needs the eval graph in ONNX format.*eval_model.onnx' does not exist"):
        module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    (tmp_path / "kept.onnx").rename(tmp_path / "eval_model.onnx")
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["logits"])
    assert [o.name for o in onnx.load(tmp_path / "inference.onnx").graph.output] == ["logits"]
