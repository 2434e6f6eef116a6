"""Upstream's building blocks that custom training blocks use: ``Linear`` (a new head to train on
a frozen base model, the transfer-learning recipe), ``LabelEncoder``, ``ReduceAllL2`` and
``InputLike`` without a name; the head trained end to end with the on-device API."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import onnxblock
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.errors import InputMismatchError
from onnxtrain.ir import io

FEATURES, CLASSES = 16, 3


def _feature_extractor():
    """x [N, 8] -> relu(x @ F) [N, 16]: a base model whose weight F stays frozen."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, FEATURES)).astype(np.float32), "F")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "F"], ["h"]), helper.make_node("Relu", ["h"], ["features"])], "base",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", FEATURES])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


class _Head(onnxblock.TrainingBlock):
    def __init__(self, **linear):
        super().__init__()
        self.linear = onnxblock.blocks.Linear(FEATURES, CLASSES, **linear)
        self.loss = onnxblock.loss.CrossEntropyLoss()

    def build(self, features):
        return self.loss(self.linear(features))


def _built(block, frozen=("F",)):
    for name in frozen:
        block.requires_grad(name, False)
    with onnxblock.base(_feature_extractor()):
        block("features")
    return block


def test_linear_parameters_train_and_the_base_stays_frozen():
    block = _built(_Head(seed=0))
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == ["linear.weight", "linear.bias"]
    assert [t.name for t in frozen] == ["F"]
    weight = numpy_helper.to_array(trainable[0])
    assert weight.shape == (FEATURES, CLASSES) and np.abs(weight).max() <= 1 / np.sqrt(FEATURES)
    # the same seed draws the same start; another seed another
    again = numpy_helper.to_array(_built(_Head(seed=0)).parameters()[0][0])
    other = numpy_helper.to_array(_built(_Head(seed=1)).parameters()[0][0])
    np.testing.assert_array_equal(again, weight)
    assert not np.array_equal(other, weight)


def test_the_models_initializers_train_when_named_blocks_parameters_always_and_two_heads_get_their_own_names():
    # as upstream: a model initializer named in neither requires_grad list stays a constant
    class TwoHeads(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.first = onnxblock.blocks.Linear(FEATURES, FEATURES, bias=False, alpha=0.5)
            self.second = onnxblock.blocks.Linear(FEATURES, CLASSES, beta=2.0)
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, features):
            return self.loss(self.second(self.first(features)))

    unnamed = _built(TwoHeads(), frozen=())
    assert [t.name for t in unnamed.parameters()[0]] == ["linear.weight", "linear_1.weight", "linear_1.bias"]
    assert not unnamed.parameters()[1]
    block = TwoHeads()
    block.requires_grad("F")
    block = _built(block, frozen=())
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == ["F", "linear.weight", "linear_1.weight", "linear_1.bias"] and not frozen
    # alpha scales the product, beta the bias: the eval model computes alpha * x @ W + beta * b
    _, eval_model = block.to_model_proto()
    session = ort.InferenceSession(eval_model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = {t.name: numpy_helper.to_array(t) for t in trainable}
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    labels = np.array([0, 1, 2, 1], np.int32)
    feeds = {"x": x, "labels": labels, **values}
    (loss,) = session.run(["loss"], {i.name: feeds[i.name] for i in session.get_inputs()})
    hidden = 0.5 * np.maximum(x @ values["F"], 0) @ values["linear.weight"]
    logits = hidden @ values["linear_1.weight"] + 2.0 * values["linear_1.bias"]
    log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    np.testing.assert_allclose(loss, -log_probs[np.arange(4), labels].mean(), rtol=1e-5)


def test_a_head_on_a_frozen_base_learns_with_the_on_device_api(tmp_path):
    block = _built(_Head(seed=0))
    training, evaluation = block.to_model_proto()
    for model, name in ((training, "training_model.onnx"), (evaluation, "eval_model.onnx")):
        (tmp_path / name).write_bytes(model.SerializeToString())
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")
    adamw = onnxblock.optim.AdamW()
    with onnxblock.empty_base():
        adamw(block.parameters())
    (tmp_path / "optimizer_model.onnx").write_bytes(io.serialize(adamw.to_ir_model()))

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    frozen_before = state.parameters["F"].data.copy()
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.05)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    labels = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    losses = []
    for _ in range(60):
        losses.append(float(module(x, labels)))
        optimizer.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.6 * losses[0]
    np.testing.assert_array_equal(state.parameters["F"].data, frozen_before)


def test_label_encoder_maps_class_names_to_the_labels_the_loss_takes():
    encoder = onnxblock.blocks.LabelEncoder(keys_strings=["cat", "dog", "bird"], values_int64s=[0, 1, 2])
    with onnxblock.empty_base() as ctx:
        ctx.graph.inputs.append(ir.Value(name="names", type=ir.TensorType(ir.DataType.STRING), shape=ir.Shape(["N"])))
        encoded = encoder("names")
        ctx.graph.outputs.append(ctx.find(encoded))
    session = ort.InferenceSession(io.serialize(ctx.ir_model), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"names": np.array(["dog", "bird", "fish", "cat"], dtype=object)})
    np.testing.assert_array_equal(got, [1, 2, -1, 0])  # an unknown name gets default_int64
    with pytest.raises(ValueError, match="same length"):
        onnxblock.blocks.LabelEncoder(keys_strings=["a"], values_int64s=[0, 1])


def test_reduce_all_l2_and_input_like_without_a_name():
    with onnxblock.base(_feature_extractor()) as ctx:
        other = onnxblock.blocks.InputLike("features")()
        norm = onnxblock.blocks.ReduceAllL2()("features", other)
        ctx.graph.outputs.append(ctx.find(norm))
    assert other != "features" and any(v.name == other for v in ctx.graph.inputs)
    session = ort.InferenceSession(io.serialize(ctx.ir_model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, FEATURES)).astype(np.float32)
    features = np.maximum(x @ numpy_helper.to_array(_feature_extractor().graph.initializer[0]), 0)
    got = session.run([norm], {"x": x, other: y})[0]
    np.testing.assert_allclose(got, np.sqrt((features ** 2).sum() + (y ** 2).sum()), rtol=1e-5)


class _LossAndScores(onnxblock.TrainingBlock):
    """Upstream's call forms: ReduceMean(keepdims) first, Constant(value_float=...), a build that
    returns the loss then another output."""

    def build(self, features):
        diff = onnxblock.blocks.Sub()(features, onnxblock.blocks.InputLike(like=features)("target"))
        mean = onnxblock.blocks.ReduceMean(False)(onnxblock.blocks.Pow(2.0)(diff))
        return onnxblock.blocks.Mul()(onnxblock.blocks.Constant(value_float=0.5)(), mean), features


def test_upstream_call_forms_build_models_whose_outputs_are_the_names_returned():
    block = _LossAndScores()
    block.requires_grad("F")
    block = _built(block, frozen=())
    with onnxblock.base(_feature_extractor(), "model.onnx"):  # upstream's model_path: not needed
        loss_name, scores_name = block("features")
    training, evaluation = block.to_model_proto()
    assert [o.name for o in evaluation.graph.output] == [loss_name, scores_name]
    assert [o.name for o in training.graph.output][:2] == [loss_name, scores_name]
    session = ort.InferenceSession(evaluation.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, FEATURES)).astype(np.float32)
    weight = numpy_helper.to_array(_feature_extractor().graph.initializer[0])
    loss, scores = session.run([loss_name, scores_name], {"x": x, "target": target, "F": weight})
    assert loss.shape == () and loss == pytest.approx(0.5 * float(np.mean((scores - target) ** 2)), rel=1e-5)
    with onnxblock.empty_base(), pytest.raises(TypeError, match="keepdims must be a bool"):
        onnxblock.blocks.ReduceSum([0, 1])
    kept = onnxblock.blocks.ReduceSum(True)
    with onnxblock.base(_feature_extractor()) as ctx:
        ctx.graph.outputs.clear()
        ctx.graph.outputs.append(ctx.find(kept("features")))
    assert list(ort.InferenceSession(ctx.model.SerializeToString()).run(None, {"x": x})[0].shape) == [1, 1]


def test_sgd_takes_clip_grad_first_as_upstream():
    from onnxtrain.errors import ArtifactError

    assert onnxblock.optim.SGD(onnxblock.optim.ClipGradNorm(2.5)).clip_grad.max_norm == 2.5
    with pytest.raises(ArtifactError, match="clip_grad must be an optim.ClipGradNorm"):
        onnxblock.optim.SGD(0.9)


def test_constant_in_upstreams_slot_is_float32_whatever_the_number():
    # upstream writes Constant(value_float) as float32: Constant(2) * a float loss was an int64 model
    for value in (2, np.float64(2.0), 2.5, np.int64(3)):
        assert onnxblock.blocks.Constant(value)._value_array.dtype == np.float32  # noqa: SLF001
    assert onnxblock.blocks.Constant(value=np.arange(3))._value_array.dtype == np.arange(3).dtype  # noqa: SLF001
    assert onnxblock.blocks.PassThrough().build("a", "b") == ("a", "b")


def test_upstreams_argument_names_and_accessors_work_after_the_import_change():
    from onnxtrain import artifacts
    from onnxtrain.errors import ArtifactError

    class Scratch(onnxblock.Block):
        def __init__(self):
            super().__init__(temp_file_name="scratch.onnx")  # upstream's; nothing is written

        def build(self, name):
            blocks = onnxblock.blocks
            summed = blocks.Add()(input_name1=name, input_name2=name)
            squared = blocks.Pow(2.0)(pow_input_name=summed)
            clipped = blocks.Clip(0.0, 4.0)(clip_input_name=squared)
            cast = blocks.Cast(TensorProto.DOUBLE)(cast_input_name=clipped)
            head = blocks.Linear(FEATURES, 2, seed=0)(linear_input_name=clipped)
            return blocks.SequenceConstruct()(cast, cast), head

    block = Scratch()
    with onnxblock.base(_feature_extractor(), "model.onnx") as accessor:
        sequence, head = block("features")
        inferred = block.infer_shapes_on_base()
    assert accessor.has_path and accessor.path == "model.onnx"
    assert accessor.find(sequence).producer().op_type == "SequenceConstruct"
    assert any(v.name == head for v in inferred.graph.value_info)  # shape inference ran
    with pytest.raises(ArtifactError, match="custom op libraries are not supported"), \
            onnxblock.custom_op_library("libcustom.so"):
        pass
    assert artifacts.USE_PATH_THRESHOLD == 2**31


def test_class_names_through_label_encoder_train_as_their_labels(tmp_path):
    """A loss reading class names through LabelEncoder trains as the same loss on the labels:
    onnxruntime's Python API makes no OrtValue of strings, so such steps run without IOBinding."""
    from onnxtrain import artifacts

    classes = ["cat", "dog", "bird"]

    class ByName(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.encoder = onnxblock.blocks.LabelEncoder(keys_strings=classes, values_int64s=[0, 1, 2])
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, scores):
            self.context.graph.inputs.append(
                ir.Value(name="names", type=ir.TensorType(ir.DataType.STRING), shape=ir.Shape(["N"])))
            return self.loss(scores, self.encoder("names"))

    runs = {}
    for how, loss in (("names", ByName()), ("labels", artifacts.LossType.CrossEntropyLoss)):
        folder = tmp_path / how
        artifacts.generate_artifacts(_classifier(), loss=loss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=folder)
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        rng = np.random.default_rng(0)
        losses = []
        for step in range(3):
            x, labels = rng.standard_normal((4, 8)).astype(np.float32), rng.integers(0, 3, 4)
            target = np.array([classes[k] for k in labels]) if how == "names" else labels
            losses.append(float(module(x, target)))
            losses.append(float(module(x, target.tolist() if how == "names" else target)))  # accumulates
            optimizer.step()
            module.lazy_reset_grad()
        module.eval()
        losses.append(float(module(x, target)))
        runs[how] = losses, {name: p.data for name, p in state.parameters}
    np.testing.assert_allclose(runs["names"][0], runs["labels"][0], rtol=1e-6)
    for name, value in runs["labels"][1].items():
        np.testing.assert_allclose(runs["names"][1][name], value, rtol=1e-6, atol=1e-7)
    with pytest.raises(InputMismatchError, match="input 'names' holds float64 values, not strings"):
        module_names = Module(tmp_path / "names" / "training_model.onnx",
                              CheckpointState.load_checkpoint(tmp_path / "names" / "checkpoint"))
        module_names(x, np.zeros(4))


def _classifier():
    """x [N, 8] -> x @ W + b [N, 3]: scores to train with labels or class names."""
    rng = np.random.default_rng(1)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "W")
    bias = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["scores"])], "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])], [weight, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
