"""generate_artifacts end to end on models made with onnx.helper (no PyTorch)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import artifacts, onnxblock
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.errors import (ArtifactError, CheckpointError, InputMismatchError, ModelError, NoGradientWarning,
                              RunError, UnsupportedOpError)


def regression_model(seed=0, hidden=8):
    """x[N, 3] -> Gemm -> Sigmoid -> MatMul + bias -> y[N, 1]; the target is a fixed smooth function."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((3, hidden)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((hidden, 1)) * 0.3).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(1, np.float32), "b2"),
        numpy_helper.from_array(np.array(2.0, np.float32), "scale"),  # a scalar constant, not a parameter
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Mul", ["h", "scale"], ["hs"]),
        helper.make_node("Sigmoid", ["hs"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "regression", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(seed, count, size=16):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        x = rng.uniform(-1, 1, (size, 3)).astype(np.float32)
        y = (np.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]).astype(np.float32)
        yield x, y


def single_thread() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return options


def make(tmp_path, session_options=None, **kwargs):
    options = dict(loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    options.update(kwargs)
    artifacts.generate_artifacts(regression_model(), **options)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx",
                    session_options=session_options)
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    return state, module, optimizer


def test_helper_model_trains_and_uses_standard_ops(tmp_path):
    state, module, optimizer = make(tmp_path)
    assert set(state.parameters.keys()) == {"w1", "b1", "w2", "b2"}  # the scalar "scale" stays a constant
    optimizer.set_learning_rate(0.03)
    losses = []
    for x, y in batches(0, 150):
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:10])
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        model = onnx.load(tmp_path / name)
        onnx.checker.check_model(model)
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}, name
        ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])


def test_frozen_parameters_get_no_gradient_and_do_not_change(tmp_path):
    state, module, optimizer = make(tmp_path, requires_grad=["w2", "b2"], frozen_params=["w1", "b1"])
    before = {n: p.data.copy() for n, p in state.parameters}
    training = onnx.load(tmp_path / "training_model.onnx")
    grad_outputs = sorted(o.name for o in training.graph.output[1:])
    assert grad_outputs == ["b2_grad.accumulation.out", "w2_grad.accumulation.out"]
    x, y = next(batches(1, 1))
    module(x, y)
    optimizer.step()
    for n in ("w1", "b1"):
        np.testing.assert_array_equal(state.parameters[n].data, before[n])
    assert not np.array_equal(state.parameters["w2"].data, before["w2"])


def test_gradients_accumulate_until_reset(tmp_path):
    state, module, _ = make(tmp_path)
    (x1, y1), (x2, y2) = batches(2, 2)
    module(x1, y1)
    g1 = state.parameters["w1"].grad.copy()
    module(x2, y2)
    g12 = state.parameters["w1"].grad.copy()
    module.lazy_reset_grad()
    module(x2, y2)
    g2 = state.parameters["w1"].grad.copy()
    np.testing.assert_allclose(g12, g1 + g2, rtol=1e-6, atol=1e-7)


def test_inference_export_matches_eval(tmp_path):
    _, module, optimizer = make(tmp_path, additional_output_names=["y"])
    for x, y in batches(3, 5):
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    x, y = next(batches(4, 1))
    _, prediction = module(x, y)
    module.export_model_for_inferencing(tmp_path / "infer.onnx", ["y"])
    session = ort.InferenceSession(str(tmp_path / "infer.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x"]
    np.testing.assert_allclose(session.run(None, {"x": x})[0], prediction, rtol=1e-6)


def test_bad_inputs_raise_input_mismatch(tmp_path):
    _, module, _ = make(tmp_path)
    x, y = next(batches(5, 1))
    with pytest.raises(InputMismatchError, match="x"):
        module(np.zeros((4, 5), np.float32), y[:4])
    with pytest.raises(InputMismatchError, match="float"):
        module(x.astype(np.float64), y)
    with pytest.raises(InputMismatchError):
        module(x)


def test_unsupported_ops_are_reported_together(tmp_path):
    w = numpy_helper.from_array(np.ones((3, 3), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Unique", ["a"], ["u"], name="unique1"),
             helper.make_node("ReduceSum", ["u"], ["d"], keepdims=0),
             helper.make_node("Unsqueeze", ["d", "axes"], ["du"]),
             helper.make_node("Mul", ["a", "du"], ["b"]),
             helper.make_node("MyOp", ["b"], ["c"], domain="com.example", name="custom1"),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                              [w, numpy_helper.from_array(np.array([0], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOpError) as info:
        artifacts.generate_artifacts(model, requires_grad=["w"], artifact_directory=tmp_path)
    assert info.value.unsupported == {"Unique": ["unique1"], "com.example::MyOp": ["custom1"]}


def test_parameter_lists_are_validated(tmp_path):
    with pytest.raises(ArtifactError, match="no initializer named"):
        artifacts.generate_artifacts(regression_model(), requires_grad=["w1", "nope"], artifact_directory=tmp_path)
    with pytest.raises(ArtifactError, match="both"):
        artifacts.generate_artifacts(regression_model(), requires_grad=["w1"], frozen_params=["w1"],
                                     artifact_directory=tmp_path)
    # as upstream's: frozen names the model does not hold (a list from PyTorch's named_buffers(),
    # with BatchNorm's num_batches_tracked) leave nothing to freeze: left out, with a warning
    with pytest.warns(UserWarning, match=r"frozen_params names \['bn.num_batches_tracked'\].*nothing to freeze"):
        artifacts.generate_artifacts(regression_model(), requires_grad=["w1", "b1"], loss=artifacts.LossType.MSELoss,
                                     frozen_params=["w2", "bn.num_batches_tracked"], artifact_directory=tmp_path)
    assert CheckpointState.load_checkpoint(tmp_path / "checkpoint").parameters.keys() == ["w1", "b1", "w2"]


def test_a_missing_trainable_name_says_the_exporter_folded_it():
    """torch.onnx.export's default optimize=True writes a transposed weight as a new val_<n>
    initializer: naming the PyTorch parameter then finds nothing, and the error says why."""
    folded = numpy_helper.from_array(np.ones((3, 2), np.float32), "val_0")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "val_0"], ["y"])], "folded",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [folded])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ArtifactError, match=r"no initializer named \['fc.weight'\] in the model; the exporter folded "
                                            r"weights into constants \['val_0'\].*optimize=False"):
        artifacts.generate_artifacts(model, requires_grad=["fc.weight"], loss=artifacts.LossType.MSELoss)


def test_nominal_checkpoint_is_written_besides_the_complete_one(tmp_path):
    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path,
                                 nominal_checkpoint=True, prefix="nom_")
    # As upstream: the complete checkpoint, plus a nominal one with the same names and shapes.
    complete = CheckpointState.load_checkpoint(tmp_path / "nom_checkpoint")
    nominal = CheckpointState.load_checkpoint(tmp_path / "nom_nominal_checkpoint")
    assert not complete.nominal and nominal.nominal
    assert nominal.parameters.keys() == complete.parameters.keys()
    assert nominal.parameters["w1"].shape == complete.parameters["w1"].data.shape == (3, 8)
    assert (tmp_path / "nom_nominal_checkpoint").stat().st_size < 2000
    with pytest.raises(CheckpointError, match="'w1' has no value"):
        _ = nominal.parameters["w1"].data
    # The app fills the nominal state from the complete one's values and trains the same.
    module = Module(tmp_path / "nom_training_model.onnx", nominal)
    module.copy_buffer_to_parameters(
        Module(tmp_path / "nom_training_model.onnx", complete).get_contiguous_parameters(), trainable_only=False)
    for name, param in complete.parameters.items():
        np.testing.assert_array_equal(nominal.parameters[name].data, param.data)
    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path,
                                 prefix="plain_")
    assert not (tmp_path / "plain_nominal_checkpoint").exists()


def test_custom_loss_block_and_loss_input_names(tmp_path):
    class WeightedMSE(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()
            self.mul = onnxblock.blocks.Mul()
            self.half = onnxblock.blocks.Constant(0.5)  # a Python float, as upstream's docs write it: float32

        def build(self, output_name):
            return self.mul(self.mse(output_name, "target"), self.half())

    state, module, optimizer = make(tmp_path, loss=WeightedMSE(), loss_input_names=["y"])
    x, y = next(batches(6, 1))
    loss = float(module(x, y))
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["y"])
    prediction = ort.InferenceSession(tmp_path / "inference.onnx").run(None, {"x": x})[0]
    assert loss == pytest.approx(0.5 * float(np.mean((prediction - y) ** 2)), rel=1e-5)
    module.eval()
    eval_loss = float(module(x, y))
    assert loss == pytest.approx(eval_loss, rel=1e-6)
    meta = json.loads(dict((p.key, p.value) for p in onnx.load(tmp_path / "eval_model.onnx").metadata_props)
                      ["onnxtrain.training"])
    assert meta["loss_inputs"] == ["target"] and meta["user_inputs"] == ["x"]


def test_a_training_block_as_the_loss_is_refused_with_the_reason(tmp_path):
    # it is a Block too: accepted, it built a training model of its own and failed on a renamed loss
    class Combined(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()

        def build(self, output_name):
            return self.mse(output_name, "target")

    with pytest.raises(ArtifactError, match=r"loss is an onnxblock.TrainingBlock \(Combined\).*onnxblock.Block"):
        make(tmp_path, loss=Combined())
    assert not list(tmp_path.iterdir())


RESUME_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_artifacts import batches, single_thread
    from onnxtrain.api import CheckpointState, Module, Optimizer
    d = {d!r}
    state = CheckpointState.load_checkpoint(d + "/resume_checkpoint")
    module = Module(d + "/training_model.onnx", state, d + "/eval_model.onnx", session_options=single_thread())
    optimizer = Optimizer(d + "/optimizer_model.onnx", module)
    for i, (x, y) in enumerate(batches(7, {n})):
        if i < {k}:
            continue
        module(x, y); optimizer.step(); module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, d + "/resumed_checkpoint", include_optimizer_state=True)
""")


def test_save_load_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    """N steps straight == k steps, save, load in a new process, N - k steps.

    Bit-identical: the same kernels on the same inputs in the same order with one intra-op
    thread (onnxruntime's CPU kernels are deterministic then); the subprocess sets the same.
    """
    n, k = 12, 5
    state, module, optimizer = make(tmp_path, session_options=single_thread())
    optimizer.set_learning_rate(0.02)
    for i, (x, y) in enumerate(batches(7, n)):
        if i == k:
            CheckpointState.save_checkpoint(state, tmp_path / "resume_checkpoint", include_optimizer_state=True)
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    script = RESUME_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parent), d=str(tmp_path), n=n, k=k)
    subprocess.run([sys.executable, "-c", script], check=True)
    resumed = CheckpointState.load_checkpoint(tmp_path / "resumed_checkpoint")
    for name, _ in state.parameters:
        np.testing.assert_array_equal(resumed.parameters[name].data, state.parameters[name].data, err_msg=name)


def test_parameters_the_loss_does_not_reach_are_named_in_a_warning(tmp_path):
    """A trainable parameter without a differentiable path to the loss (here: behind a rounding
    integer cast, and one nothing reads) would keep its value forever: the user is told."""
    model = regression_model()
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(np.ones(4, np.float32), "unused"),
                              numpy_helper.from_array(np.full(1, 0.5, np.float32), "shift")])
    graph.node[-1].output[0] = "y_float"
    graph.node.extend([
        helper.make_node("Add", ["shift", "b2"], ["shifted"]),
        helper.make_node("Cast", ["shifted"], ["shift_int"], to=TensorProto.INT64),
        helper.make_node("Cast", ["shift_int"], ["shift_back"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["y_float", "shift_back"], ["y"]),
    ])
    with pytest.warns(NoGradientWarning, match=r"\['unused', 'shift'\].*become frozen"):
        artifacts.generate_artifacts(model, requires_grad=["w1", "b2", "unused", "shift"],
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path,
                                     optimizer=onnxblock.optim.AdamW(weight_decay=0.1))
    # frozen, as PyTorch's optimizers skip a parameter without gradient: weight decay leaves them alone
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert [n for n, p in state.parameters if p.requires_grad] == ["w1", "b2"]
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(0.1)
    before = {n: p.data.copy() for n, p in state.parameters}
    for x, y in batches(1, 3):
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    for name in ("unused", "shift"):
        np.testing.assert_array_equal(state.parameters[name].data, before[name])
    assert not np.array_equal(state.parameters["w1"].data, before["w1"])
    module.eval()
    module(*next(batches(2, 1)))  # the eval model takes the parameters in the same order
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGradientWarning)  # every parameter reached: no warning
        artifacts.generate_artifacts(regression_model(), requires_grad=["w1", "b2"],
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "ok")


def test_a_model_with_external_data_by_path_and_a_clear_error_without_its_data(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.mkdir()
    expected = {i.name: numpy_helper.to_array(i) for i in regression_model().graph.initializer}
    onnx.save_model(regression_model(), source / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path)  # the data is found beside the model, not in the working directory
    artifacts.generate_artifacts(str(source / "model.onnx"), requires_grad=["w1", "b1"], frozen_params=["w2"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "out")
    state = CheckpointState.load_checkpoint(tmp_path / "out" / "checkpoint")
    for name in ("w1", "b1", "w2"):
        np.testing.assert_array_equal(state.parameters[name].data, expected[name])
    without_data = onnx.load(source / "model.onnx", load_external_data=False)
    with pytest.raises(ArtifactError, match=r"'w1' keeps its data in the external file 'weights.bin'"):
        artifacts.generate_artifacts(without_data, requires_grad=["w1"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path / "out2")


def test_class_labels_of_another_integer_type_are_converted_where_they_fit(tmp_path):
    """The labels input is int32; int64 labels (what onnxruntime-training 1.19.2's artifacts took,
    and PyTorch's default) give the same loss, and labels that do not fit are refused by name."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["scores"])], "classifier",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
    x, labels = next(batches(3, 1))[0], np.array([0, 3, 1, 2] * 4)
    as_int32 = float(module(x, labels.astype(np.int32)))
    assert float(module(x, labels.astype(np.int64))) == as_int32
    assert float(module(x, labels.astype(np.uint8))) == as_int32
    with pytest.raises(InputMismatchError, match=r"'labels' has dtype int64 with values in \[0, 4294967296\]"):
        module(x, np.where(labels == 3, 2**32, labels))
    with pytest.raises(InputMismatchError, match="'labels' has dtype float32"):
        module(x, labels.astype(np.float32))
    # as OrtValues too (upstream scripts feed them), and as Python lists, checked alike: float
    # labels in a list were truncated, out-of-range ones raised numpy's OverflowError
    assert float(module(x, ort.OrtValue.ortvalue_from_numpy(labels.astype(np.int64)))) == as_int32
    assert float(module(x, labels.tolist())) == as_int32
    with pytest.raises(InputMismatchError, match="'labels' holds float64 values, not integers"):
        module(x, (labels + 0.5).tolist())
    with pytest.raises(InputMismatchError, match=r"'labels' has dtype int64 with values in \[0, 4294967296\]"):
        module(x, np.where(labels == 3, 2**32, labels).tolist())
    with pytest.raises(InputMismatchError, match=r"'x' is an OrtValue of tensor\(double\)"):
        module(ort.OrtValue.ortvalue_from_numpy(x.astype(np.float64)), labels)


def test_labels_of_another_batch_size_fail_where_the_scores_batch_has_no_name(tmp_path):
    """Scores reshaped to [-1, C] (as a flatten before the classifier exports) have an unnamed
    batch: labels of 5 rows for 6 images trained on the first 5, silently."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 6], np.int64), "rows")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "rows"], ["flat"]),
                               helper.make_node("MatMul", ["flat", "w"], ["scores"])], "classifier",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)], [weight, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, labels = np.random.default_rng(1).standard_normal((6, 2, 3)).astype(np.float32), np.array([0, 1, 2, 3, 0, 1])
    loss = float(module(x, labels))
    for step in (module, lambda *a: (module.eval(), module(*a))[1]):
        with pytest.raises(RunError, match="labels_must_have_the_batch_of_scores"):
            step(x, labels[:5])
    module.train()
    assert float(module(x, labels)) == loss


def test_parameters_keep_the_models_order_whatever_order_the_lists_name_them_in(tmp_path):
    """As upstream: a buffer of the trainable parameters has the model's initializer order, so it
    fits the other library's artifacts of the same model (a federated exchange)."""
    artifacts.generate_artifacts(regression_model(), requires_grad=["b2", "w2", "b1"], frozen_params=["w1"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert state.parameters.keys() == ["b1", "w2", "b2", "w1"]
    inputs = [i.name for i in onnx.load(tmp_path / "training_model.onnx").graph.input]
    assert inputs[inputs.index("b1"):inputs.index("w1") + 1] == ["b1", "w2", "b2", "w1"]
    module = Module(tmp_path / "training_model.onnx", state)
    values = {p.name: numpy_helper.to_array(p) for p in regression_model().graph.initializer}
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=True).numpy(),
                                  np.concatenate([values[n].ravel() for n in ("b1", "w2", "b2")]))


@pytest.mark.parametrize("requires_grad", [None, ["w", "scale", "shift"]], ids=["default", "listed"])
def test_running_statistics_of_a_training_batch_norm_update_whatever_the_lists(tmp_path, requires_grad):
    # listed parameters (upstream's usual call) left the statistics out of both lists: they became
    # constants, and the eval model normalized with the initial 0 / 1 forever
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.ones(3, np.float32), "scale"),
             numpy_helper.from_array(np.zeros(3, np.float32), "shift"),
             numpy_helper.from_array(np.zeros(3, np.float32), "mean"),
             numpy_helper.from_array(np.ones(3, np.float32), "var")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "scale", "shift", "mean", "var"],
                              ["y", "new_mean", "new_var"], training_mode=1, momentum=0.9)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    artifacts.generate_artifacts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]),
                                 requires_grad=requires_grad, loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert {"mean", "var"} <= {name for name, _ in state.parameters} and not state.parameters["mean"].requires_grad
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x = (rng.standard_normal((8, 4)) * 3 + 2).astype(np.float32)
    module(x, np.zeros((8, 3), np.float32))
    h = x @ state.parameters["w"].data
    np.testing.assert_allclose(state.parameters["mean"].data, 0.1 * h.mean(axis=0), rtol=1e-5, atol=1e-6)


def _scored_model():
    """x @ w -> y, and y's mean as a second output m (for the output-order tests)."""
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ReduceMean", ["y"], ["m"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_follow_upstreams_order_and_loss_none_takes_the_first_output(tmp_path):
    # upstream: (loss, what the loss block returned after it, additional_output_names); loss=None with
    # several outputs: the first is the loss, the others outputs (it was refused)
    artifacts.generate_artifacts(_scored_model(), requires_grad=["w"], loss=None, artifact_directory=tmp_path / "a")
    outputs = [o.name for o in onnx.load(tmp_path / "a" / "eval_model.onnx").graph.output]
    assert outputs == ["m", "y"]

    class LossAndScores(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()

        def build(self, mean_name, output_name):
            return self.mse(output_name, "target"), output_name

    artifacts.generate_artifacts(_scored_model(), requires_grad=["w"], loss=LossAndScores(),
                                 additional_output_names=["m"], artifact_directory=tmp_path / "b")
    outputs = [o.name for o in onnx.load(tmp_path / "b" / "eval_model.onnx").graph.output]
    assert outputs == ["loss", "y", "m"]


def test_a_loss_of_more_than_one_value_is_refused(tmp_path):
    """loss=None on a model whose first output is [N, 2] (or a loss block returning per-sample
    losses) trained the sum of its values silently; PyTorch's backward refuses such a loss too.
    A loss of shape [1] (older exporters) still trains."""
    scores_first = _scored_model()
    scores_first.graph.output.reverse()
    with pytest.raises(ArtifactError, match=r"the loss 'y' has shape \[N,2\]: a loss is one number.*loss=None takes"):
        artifacts.generate_artifacts(scores_first, requires_grad=["w"], loss=None, artifact_directory=tmp_path / "a")
    assert not (tmp_path / "a").exists()

    class Squares(onnxblock.Block):
        def __init__(self, reduced):
            super().__init__()
            self.reduced = reduced

        def build(self, mean_name, output_name):
            squares = onnxblock.blocks.Mul()(output_name, output_name)
            return onnxblock.blocks.ReduceSum(keepdims=True)(squares) if self.reduced else squares

    with pytest.raises(ArtifactError, match=r"has shape \[N,2\]: a loss is one number"):
        artifacts.generate_artifacts(_scored_model(), requires_grad=["w"], loss=Squares(False),
                                     artifact_directory=tmp_path / "b")
    artifacts.generate_artifacts(_scored_model(), requires_grad=["w"], loss=Squares(True),  # [1, 1]
                                 artifact_directory=tmp_path / "c")
    assert [d.dim_value for d in onnx.load(tmp_path / "c" / "training_model.onnx").graph.output[0]
            .type.tensor_type.shape.dim] == [1, 1]


def test_an_empty_requires_grad_trains_nothing(tmp_path):
    # as upstream: only what is named trains ([] was taken as "not given": everything trained)
    artifacts.generate_artifacts(_scored_model(), requires_grad=[], loss=None, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert [name for name, _ in state.parameters] == []
    with pytest.raises(ArtifactError, match="at least one parameter that requires gradients"):
        artifacts.generate_artifacts(_scored_model(), requires_grad=[], loss=None, optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=tmp_path / "b")


@pytest.mark.parametrize("argument", ["requires_grad", "frozen_params", "additional_output_names", "loss_input_names"])
def test_a_name_list_given_as_one_string_is_refused_and_errors_are_runtime_errors_as_upstreams(tmp_path, argument):
    # "logits" was split into ['l', 'o', ...] and reported as unknown values; upstream raised RuntimeError
    with pytest.raises(ArtifactError, match=rf"{argument} must be a list of names, got the string 'w'") as info:
        artifacts.generate_artifacts(_scored_model(), **{argument: "w"}, artifact_directory=tmp_path)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_weights_folded_by_the_exporters_optimizer_are_refused_by_name(tmp_path):
    """torch.onnx.export's default optimize=True writes Transpose(weight) as an initializer named
    ``val_<n>``: requires_grad=None left every Linear weight untrained (biases only), silently."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    example = (torch.randn(2, 7, 4),)  # 3-D: the product is a MatMul with the transposed weight
    for optimize in (True, False):
        torch.onnx.export(model, example, tmp_path / f"model_{optimize}.onnx", dynamo=True, optimize=optimize,
                          verbose=False)
    with pytest.raises(ArtifactError, match=r"val_0.*0\.weight.*optimize=False"):
        artifacts.generate_artifacts(str(tmp_path / "model_True.onnx"), requires_grad=None,
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "folded")
    # naming what trains is the user's call, and unfolded exports train every parameter
    artifacts.generate_artifacts(str(tmp_path / "model_True.onnx"), requires_grad=["val_0", "0.bias"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "named")
    artifacts.generate_artifacts(str(tmp_path / "model_False.onnx"), requires_grad=None,
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "plain")
    state = CheckpointState.load_checkpoint(tmp_path / "plain" / "checkpoint")
    assert sorted(state.parameters.keys()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_every_output_of_the_base_model_exports_and_eval_steps_return_the_loss(tmp_path):
    # two heads, the loss on "score": "probs" is a head the loss does not read, "features" an
    # Identity of a value it reads (as the dynamo exporter writes nn.RNN's h_n)
    from tests.js.fixtures import two_heads_model

    model = two_heads_model()
    with pytest.warns(NoGradientWarning, match="w3"):  # the other head's parameters have no gradient
        artifacts.generate_artifacts(model, loss=artifacts.LossType.MSELoss, loss_input_names=["score"],
                                     artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    target = np.zeros((5, 2), np.float32)
    assert module.output_names() == ["loss"]
    assert np.shape(module.eval()(x, target)) == ()  # the loss alone
    assert module.output_names() == ["loss"]

    names = ["score", "probs", "features"]
    module.export_model_for_inferencing(tmp_path / "inference.onnx", names)
    session = ort.InferenceSession(tmp_path / "inference.onnx", providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == names
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, {"x": x})
    for name, got, want in zip(names, session.run(None, {"x": x}), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)

    # the training model computes the loss's head only; the eval model lists the others for export
    training = onnx.load(tmp_path / "training_model.onnx")
    assert not {"w3", "b3"} & {i for n in training.graph.node for i in n.input}
    assert not {"probs", "features"} & {o.name for o in training.graph.output}
    eval_meta = json.loads({p.key: p.value for p in onnx.load(tmp_path / "eval_model.onnx").metadata_props}
                           ["onnxtrain.training"])
    assert eval_meta["inference_outputs"] == names and eval_meta["additional_outputs"] == []
    with pytest.raises(ModelError, match=r"\['nowhere'\] are not values of the eval model.*additional_output_names"):
        module.export_model_for_inferencing(tmp_path / "inference.onnx", ["nowhere"])


def test_the_eval_models_outputs_leave_the_training_model_as_it_was():
    """Keeping the base model's outputs for the eval model changes no node of the training model."""
    from onnxtrain.ir import io
    from onnxtrain.onnxblock._training import build_training_and_eval, select_parameters

    base = regression_model()
    base.graph.input.append(helper.make_tensor_value_info("target", TensorProto.FLOAT, ["N", 1]))
    base.graph.node.extend([helper.make_node("Sub", ["y", "target"], ["diff"]),
                            helper.make_node("Mul", ["diff", "diff"], ["squared"]),
                            helper.make_node("ReduceMean", ["squared"], ["loss"], keepdims=0)])

    def build(inference_outputs):
        model = io.load_model(base)
        params = select_parameters(model, ["w1", "b1", "w2", "b2"], None)
        return [io.to_proto(m).graph for m in build_training_and_eval(
            model, "loss", params, ["x"], inference_outputs=inference_outputs)]

    def nodes(graph):
        return [(n.op_type, list(n.input), list(n.output)) for n in graph.node]

    (training, evaluation), (plain_training, plain_evaluation) = build(["y"]), build(())
    assert nodes(training) == nodes(plain_training)
    assert [o.name for o in training.output] == [o.name for o in plain_training.output]
    assert [o.name for o in evaluation.output] == ["loss", "y"]
    assert [o.name for o in plain_evaluation.output] == ["loss"]


def test_a_cnn_trains_on_an_empty_batch_with_zero_gradients(tmp_path):
    """The last shard of a dataset may hold no rows: the training step takes it (as PyTorch's
    backward does: zero weight gradients) and the next step trains as before. The Conv weight
    gradient's reshapes could not infer a -1 beside the empty batch."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "conv_w"),
             numpy_helper.from_array(rng.standard_normal((64, 3)).astype(np.float32) * 0.1, "fc_w"),
             numpy_helper.from_array(np.array([0, 64], np.int64), "flat")]
    nodes = [helper.make_node("Conv", ["x", "conv_w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "flat"], ["f"]),
             helper.make_node("MatMul", ["f", "fc_w"], ["scores"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    module(np.zeros((0, 2, 8, 8), np.float32), np.zeros((0,), np.int64))
    assert all(not p.grad.any() for _, p in state.parameters if p.requires_grad)
    module.lazy_reset_grad()
    module(rng.standard_normal((5, 2, 8, 8)).astype(np.float32), np.array([0, 1, 2, 0, 1]))
    assert all(p.grad.any() for _, p in state.parameters if p.requires_grad)


def test_a_dropout_no_gradient_passes_through_still_drops_in_training(tmp_path):
    """A frozen feature extractor, a training-mode Dropout, a new head (the personalization
    recipe): no gradient reads the Dropout's mask, and onnxruntime's EliminateDropout removed it
    as if the session were inference, so the training step dropped nothing (in every runtime)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "frozen_w"),
             numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "head_w"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "training")]
    nodes = [helper.make_node("MatMul", ["x", "frozen_w"], ["h"]), helper.make_node("Relu", ["h"], ["features"]),
             helper.make_node("Dropout", ["features", "ratio", "training"], ["dropped"]),
             helper.make_node("MatMul", ["dropped", "head_w"], ["scores"])]
    graph = helper.make_graph(nodes, "personalized", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifacts.generate_artifacts(model, requires_grad=["head_w"], loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, labels = rng.standard_normal((8, 16)).astype(np.float32), np.arange(8) % 4
    training = {round(float(module(x, labels)), 6) for _ in range(4)}
    assert len(training) > 1  # a fresh mask per step
    module.eval()
    assert len({round(float(module(x, labels)), 6) for _ in range(2)}) == 1  # the eval model drops nothing
    # the file itself keeps it: a plain session with every default optimization (another runtime's)
    session = ort.InferenceSession(str(tmp_path / "training_model.onnx"))
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 8 for d in i.shape], np.float32) for i in session.get_inputs()
             if i.type == "tensor(float)"}
    feeds.update(x=x, labels=labels.astype(np.int32), head_w=state.parameters["head_w"].data,
                 lazy_reset_grad=np.array(True))
    first = session.run(None, feeds)[0]
    assert any(not np.array_equal(session.run(None, feeds)[0], first) for _ in range(3))


def test_a_float_output_taken_as_class_labels_is_refused_by_name(tmp_path):
    """generate_artifacts hands the model's outputs to the loss in order: a second float output
    became CrossEntropyLoss's labels and the artifacts did not load (onnxruntime's shape error)."""
    weight = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"]), helper.make_node("Relu", ["scores"], ["features"])]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 4]),
                               helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ArtifactError, match="CrossEntropyLoss labels 'features' are FLOAT: class labels are integers.*"
                                            "loss_input_names"):
        artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, loss_input_names=["scores"],
                                 artifact_directory=tmp_path)
    Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
