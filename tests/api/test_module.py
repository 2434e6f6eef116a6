"""Module: training/eval steps, gradient accumulation, input checks, parameter buffers, export."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxtrain import artifacts as artifact_generation
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.checkpoint import write_checkpoint
from onnxtrain.errors import CheckpointError, InputMismatchError, ModelError

from .conftest import batch, ref_forward, ref_grads


@pytest.fixture
def module(artifacts):
    return Module(artifacts.training, CheckpointState.load_checkpoint(artifacts.checkpoint), artifacts.eval)


def _grads(module):
    return {n: module._state.parameters[n].grad for n in ("W", "b")}


def test_names(module):
    assert module.training
    assert module.input_names() == ["x", "target"]
    assert module.output_names() == ["loss", "pred"]
    module.eval()
    assert not module.training
    assert module.input_names() == ["x", "target"]
    assert module.output_names() == ["loss", "pred"]
    assert module.train() is module and module.training


def test_loss_outputs_and_gradients_match_numpy(module, artifacts):
    x, t = batch()
    loss, pred = module(x, t)
    ref_loss, ref_pred = ref_forward(artifacts.params, x, t)
    assert isinstance(loss, np.ndarray) and loss.shape == ()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(pred, ref_pred, rtol=1e-5)
    ref = ref_grads(artifacts.params, x, t)
    for name, grad in _grads(module).items():
        np.testing.assert_allclose(grad, ref[name], rtol=1e-5, atol=1e-6)
    assert module._state.parameters["scale"].grad is None  # frozen
    for name, value in artifacts.params.items():  # the training step does not move parameters
        np.testing.assert_array_equal(module._state.parameters[name].data, value)


def test_gradients_accumulate_until_lazy_reset(module, artifacts):
    (x1, t1), (x2, t2), (x3, t3) = batch(4, 1), batch(3, 2), batch(5, 3)
    g1, g2, g3 = (ref_grads(artifacts.params, x, t) for x, t in ((x1, t1), (x2, t2), (x3, t3)))
    module(x1, t1)
    module(x2, t2)
    for name, grad in _grads(module).items():
        np.testing.assert_allclose(grad, g1[name] + g2[name], rtol=1e-5, atol=1e-6)
    module.lazy_reset_grad()
    module(x3, t3)
    for name, grad in _grads(module).items():
        np.testing.assert_allclose(grad, g3[name], rtol=1e-5, atol=1e-6)
    module(x1, t1)
    for name, grad in _grads(module).items():
        np.testing.assert_allclose(grad, g3[name] + g1[name], rtol=1e-5, atol=1e-6)


def test_eval_mode_runs_eval_model_and_keeps_gradients(module, artifacts):
    x, t = batch()
    module(x, t)
    before = _grads(module)
    module.eval()
    loss, pred = module(x, t)
    np.testing.assert_allclose(loss, ref_forward(artifacts.params, x, t)[0], rtol=1e-5)
    for name, grad in _grads(module).items():
        np.testing.assert_array_equal(grad, before[name])


def test_eval_without_eval_model(artifacts):
    module = Module(artifacts.training, CheckpointState.load_checkpoint(artifacts.checkpoint))
    module.eval()
    with pytest.raises(ModelError, match="eval model"):
        module(*batch())


def test_any_batch_size_reuses_the_sessions(module, artifacts):
    session = module._train_session
    for n in (1, 7, 2, 7):
        x, t = batch(n, n)
        module.lazy_reset_grad()
        loss, pred = module(x, t)
        assert pred.shape == (n, 2)
        np.testing.assert_allclose(loss, ref_forward(artifacts.params, x, t)[0], rtol=1e-5)
        np.testing.assert_allclose(_grads(module)["W"], ref_grads(artifacts.params, x, t)["W"], rtol=1e-5, atol=1e-6)
    assert module._train_session is session


def test_outputs_are_fresh_arrays(module):
    x, t = batch()
    loss1, pred1 = module(x, t)
    kept = pred1.copy()
    module(*batch(4, 9))
    np.testing.assert_array_equal(pred1, kept)


def test_named_and_ortvalue_inputs(module, artifacts):
    x, t = batch()
    loss, _ = module(x, target=t)
    np.testing.assert_allclose(loss, ref_forward(artifacts.params, x, t)[0], rtol=1e-5)
    outs = module(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(t))
    assert all(isinstance(o, ort.OrtValue) for o in outs)
    np.testing.assert_allclose(outs[0].numpy(), loss, rtol=1e-6)
    module.eval()
    loss_list, _ = module(x.tolist(), t.tolist())  # lists take the model's dtype
    np.testing.assert_allclose(loss_list, loss, rtol=1e-6)


@pytest.mark.parametrize("call, pattern", [
    (lambda m, x, t: m(x), r"got 1 inputs.*\['x', 'target'\].*missing \['target'\]"),
    (lambda m, x, t: m(x, t, t), r"got 3 positional inputs.*\['x', 'target'\]"),
    (lambda m, x, t: m(x, label=t), r"unknown input 'label'"),
    (lambda m, x, t: m(x, t, x=x), r"'x' was given both"),
    (lambda m, x, t: m(x.astype(np.float64), t), r"input 'x' has dtype float64.*tensor\(float\) with shape \[batch, 3\]"),
    (lambda m, x, t: m(np.ones((4, 5), np.float32), t), r"input 'x' has shape \[4, 5\] \(dim 1 is 5, expected 3\)"),
    (lambda m, x, t: m(x[None], t), r"input 'x' has shape \[1, 4, 3\] \(rank 3\).*\[batch, 3\]"),
    (lambda m, x, t: m(x, t[:3]), r"input 'target' .*'batch'.* is 3 but input 'x' gave 'batch' = 4"),
    (lambda m, x, t: m(ort.OrtValue.ortvalue_from_numpy(x.astype(np.int64)), t), r"'x' is an OrtValue of tensor\(int64\)"),
    (lambda m, x, t: m(x, "abc"), r"'target' cannot be converted"),
])
def test_bad_inputs(module, call, pattern):
    x, t = batch()
    with pytest.raises(InputMismatchError, match=pattern):
        call(module, x, t)
    assert not any(g.any() for g in _grads(module).values())  # nothing ran: the gradients are still zeros


def test_failed_run_leaves_parameters_and_gradients_untouched(module, artifacts, monkeypatch):
    x1, t1 = batch(4, 1)
    x2, t2 = batch(4, 2)
    module(x1, t1)
    before = _grads(module)
    real_run = module._train_session.run_with_iobinding

    def run_then_fail(binding, *args):
        real_run(binding, *args)  # the outputs are written...
        raise RuntimeError("simulated failure after the kernels ran")

    monkeypatch.setattr(module._train_session, "run_with_iobinding", run_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        module(x2, t2)
    for name, grad in _grads(module).items():
        np.testing.assert_array_equal(grad, before[name])
    monkeypatch.undo()
    module(x2, t2)  # accumulation continues from the state before the failure
    g1, g2 = ref_grads(artifacts.params, x1, t1), ref_grads(artifacts.params, x2, t2)
    for name, grad in _grads(module).items():
        np.testing.assert_allclose(grad, g1[name] + g2[name], rtol=1e-5, atol=1e-6)


def test_contiguous_parameters(module, artifacts):
    p = artifacts.params
    assert module.get_parameters_size() == 3 * 2 + 2
    assert module.get_parameters_size(trainable_only=False) == 3 * 2 + 2 + 2
    flat = module.get_contiguous_parameters()
    assert isinstance(flat, ort.OrtValue)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([p["W"].ravel(), p["b"], p["scale"]]))
    np.testing.assert_array_equal(module.get_contiguous_parameters(trainable_only=True).numpy(),
                                  np.concatenate([p["W"].ravel(), p["b"]]))
    new = np.arange(8, dtype=np.float32)
    module.copy_buffer_to_parameters(ort.OrtValue.ortvalue_from_numpy(new))
    np.testing.assert_array_equal(module._state.parameters["W"].data, new[:6].reshape(3, 2))
    np.testing.assert_array_equal(module._state.parameters["b"].data, new[6:])
    np.testing.assert_array_equal(module._state.parameters["scale"].data, p["scale"])
    x, t = batch()
    loss, _ = module(x, t)
    np.testing.assert_allclose(loss, ref_forward({"W": new[:6].reshape(3, 2), "b": new[6:], "scale": p["scale"]},
                                                 x, t)[0], rtol=1e-5)
    with pytest.raises(InputMismatchError, match="8 elements"):
        module.copy_buffer_to_parameters(np.zeros(10, np.float32))
    with pytest.raises(InputMismatchError, match="float64"):
        module.copy_buffer_to_parameters(np.zeros(8, np.float64))
    module.copy_buffer_to_parameters(np.zeros(10, np.float32), trainable_only=False)
    assert not module._state.parameters["scale"].data.any()
    # Upstream's wrapper takes the C-level OrtValue (``OrtValue._ortvalue``): code written for it works.
    module.copy_buffer_to_parameters(ort.OrtValue.ortvalue_from_numpy(new)._ortvalue)
    np.testing.assert_array_equal(module._state.parameters["W"].data, new[:6].reshape(3, 2))
    with pytest.raises(InputMismatchError, match="an OrtValue or a numeric array, got dict"):
        module.copy_buffer_to_parameters({"W": new})


# ----------------------------------------------------------------------------- checkpoint/model mismatch

def _module_with(artifacts, tmp_path, params, requires_grad):
    write_checkpoint(tmp_path / "bad", params, requires_grad)
    return Module(artifacts.training, CheckpointState.load_checkpoint(tmp_path / "bad"), artifacts.eval)


def test_checkpoint_must_match_the_model(artifacts, tmp_path):
    p = artifacts.params
    with pytest.raises(CheckpointError, match=r"takes parameters \['scale'\].*does not hold"):
        _module_with(artifacts, tmp_path, {"W": p["W"], "b": p["b"]}, {"W", "b"})
    with pytest.raises(CheckpointError, match=r"holds parameters \['extra'\]"):
        _module_with(artifacts, tmp_path, {**p, "extra": p["b"]}, {"W", "b"})
    with pytest.raises(CheckpointError, match=r"'W' has shape \[2, 3\].*\[3, 2\]"):
        _module_with(artifacts, tmp_path, {**p, "W": p["W"].T.copy()}, {"W", "b"})
    with pytest.raises(CheckpointError, match="'b' is float64"):
        _module_with(artifacts, tmp_path, {**p, "b": p["b"].astype(np.float64)}, {"W", "b"})
    with pytest.raises(CheckpointError, match="'b' is trainable in the training model but frozen"):
        _module_with(artifacts, tmp_path, p, {"W"})
    with pytest.raises(CheckpointError, match="'scale' is frozen in the training model but trainable"):
        _module_with(artifacts, tmp_path, p, {"W", "b", "scale"})


def test_missing_model_file(artifacts, tmp_path):
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    with pytest.raises(ModelError, match="does not exist"):
        Module(tmp_path / "nope.onnx", state)
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelError, match="could not load"):
        Module(tmp_path / "bad.onnx", state)
    with pytest.raises(ValueError, match="unknown device"):
        Module(artifacts.training, state, device="tpu")


def test_a_model_path_that_is_not_a_regular_file_is_named(artifacts, tmp_path):
    """A folder, a FIFO (reading it would wait for a writer forever) or a device is named for
    what it is: the messages said "does not exist"."""
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    with pytest.raises(ModelError, match=r"training model file .* is a directory, expected an ONNX model file"):
        Module(tmp_path, state)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.onnx")
        with pytest.raises(ModelError, match="eval model file .* is not a regular file"):
            Module(artifacts.training, state, tmp_path / "fifo.onnx")
        with pytest.raises(ModelError, match="ONNX model file .* is not a regular file"):
            artifact_generation.generate_artifacts(str(tmp_path / "fifo.onnx"), artifact_directory=tmp_path / "out")


# ----------------------------------------------------------------------------- export

def test_export_model_for_inferencing(module, artifacts, tmp_path):
    x, t = batch()
    module(x, t)
    module._state.parameters["b"] = np.array([0.25, -1.0], np.float32)  # export uses current values
    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["pred"])

    model = onnx.load(path)
    assert [i.name for i in model.graph.input] == ["x"]  # no target, no parameters
    assert [o.name for o in model.graph.output] == ["pred"]
    assert {i.name for i in model.graph.initializer} == {"W", "b", "scale"}
    assert {n.op_type for n in model.graph.node} == {"MatMul", "Add", "Mul"}
    assert not any(p.key == "onnxtrain.training" for p in model.metadata_props)
    onnx.checker.check_model(model, full_check=True)

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    module.eval()
    for n in (4, 1, 9):
        x, t = batch(n, n)
        (pred,) = session.run(None, {"x": x})
        np.testing.assert_array_equal(pred, module(x, t)[1])


def test_export_intermediate_value_and_errors(module, tmp_path):
    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["z"])  # an intermediate value: x @ W + b, scale unused
    model = onnx.load(path)
    assert {i.name for i in model.graph.initializer} == {"W", "b"}
    x, _ = batch()
    p = {n: module._state.parameters[n].data for n in ("W", "b")}
    (z,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(z, x @ p["W"] + p["b"], rtol=1e-6)
    with pytest.raises(ModelError, match=r"\['logits'\] are not values"):
        module.export_model_for_inferencing(path, ["logits"])
    with pytest.raises(ModelError, match=r"depend on the loss inputs \['target'\]"):
        module.export_model_for_inferencing(path, ["loss"])
    with pytest.raises(ValueError):
        module.export_model_for_inferencing(path, [])


def test_export_keeps_an_input_requested_as_output_and_aliases_a_repeated_one(module, tmp_path):
    # the input stays "x" (it was renamed "x_orig", so feeding {"x": ...} failed)
    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["pred", "x", "pred"])
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x"]
    assert [o.name for o in model.graph.output] == ["pred", "x", "pred_alias_1"]
    x, _ = batch()
    pred, same_x, again = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(same_x, x)
    np.testing.assert_array_equal(again, pred)


def test_export_needs_eval_model(artifacts, tmp_path):
    module = Module(artifacts.training, CheckpointState.load_checkpoint(artifacts.checkpoint))
    with pytest.raises(ModelError, match="eval model"):
        module.export_model_for_inferencing(tmp_path / "m.onnx", ["pred"])


def test_default_cpu_sessions_run_without_memory_pattern(artifacts):
    """Every session of the runtime (training, eval, optimizer, fused step) leaves onnxruntime's
    memory pattern off by default (a quarter less peak memory); options given are kept as they are."""
    from onnxtrain.api import Optimizer

    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    module = Module(artifacts.training, state, artifacts.eval)
    optimizer = Optimizer(artifacts.optimizer, module, fused_step=True)
    sessions = [module._train_session, module._eval_session, optimizer._session, module._fused_step.session]
    assert [s.get_session_options().enable_mem_pattern for s in sessions] == [False] * 4
    x, t = batch()
    module(x, t)
    optimizer.step()  # trains as before
    assert np.isfinite(state.parameters["W"].data).all()

    given = ort.SessionOptions()
    given.enable_mem_pattern = True
    module = Module(artifacts.training, CheckpointState.load_checkpoint(artifacts.checkpoint), artifacts.eval,
                    session_options=given)
    assert module._train_session.get_session_options().enable_mem_pattern


def test_a_negative_class_label_fails_the_step_and_names_the_labels(tmp_path):
    # onnxruntime reads a negative class index from the end: a -1 silently trained as the last class
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain import artifacts as onnxtrain_artifacts
    from onnxtrain.errors import RunError

    rng = np.random.default_rng(0)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["scores"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnxtrain_artifacts.generate_artifacts(model, requires_grad=["w"], loss=onnxtrain_artifacts.LossType.CrossEntropyLoss,
                                           artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x = rng.standard_normal((4, 4)).astype(np.float32)
    module(x, np.array([0, 2, 2, 1]))
    before = state.parameters["w"].grad
    for labels in ([0, -1, 2, 1], [0, 3, 2, 1]):
        with pytest.raises(RunError, match=r"index was out of range: check the integer inputs \['labels'\]"):
            module(x, np.array(labels))
        np.testing.assert_array_equal(state.parameters["w"].grad, before)
    module.eval()
    with pytest.raises(RunError, match="eval step"):
        module(x, np.array([0, -1, 2, 1]))


def test_a_negative_label_of_the_models_own_loss_fails_the_step(tmp_path):
    # a model that brings its loss (NegativeLogLikelihoodLoss, as torch.onnx.export writes nll_loss)
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain import artifacts as onnxtrain_artifacts
    from onnxtrain.errors import RunError

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"]),
             helper.make_node("LogSoftmax", ["scores"], ["log_prob"], axis=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "labels"], ["loss"], ignore_index=-100)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                           helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")])
    onnxtrain_artifacts.generate_artifacts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                           requires_grad=["w"], artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    x = rng.standard_normal((4, 4)).astype(np.float32)
    scores = x @ state.parameters["w"].data
    log_prob = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(module(x, np.array([0, -100, 2, 1])), -log_prob[[0, 2, 3], [0, 2, 1]].mean(), rtol=1e-5)
    with pytest.raises(RunError, match=r"check the integer inputs \['labels'\]"):
        module(x, np.array([0, -1, 2, 1]))


def test_a_view_of_the_contiguous_parameters_outlives_its_ortvalue(module, artifacts):
    """``get_contiguous_parameters().numpy()`` on the returned value alone (the OrtValue dropped at
    once) read freed memory once anything else was allocated: onnxruntime borrowed the array."""
    import gc

    p = artifacts.params
    expected = np.concatenate([p["W"].ravel(), p["b"], p["scale"]])
    views = [module.get_contiguous_parameters().numpy() for _ in range(3)]
    gc.collect()
    clutter = [np.full(size, 7.0, np.float32) for size in (expected.size, expected.size * 64) for _ in range(200)]
    for view in views:
        np.testing.assert_array_equal(view, expected)
    assert clutter


def test_model_bytes_are_refused_as_paths_by_name(artifacts):
    """os.fspath takes bytes as a path: a model's bytes became a file name ("embedded null byte",
    after the session had loaded them). Paths only, said so."""
    state = CheckpointState.load_checkpoint(artifacts.checkpoint)
    model_bytes = artifacts.training.read_bytes()
    with pytest.raises(TypeError, match="Module train_model_uri must be the path of a file.*got bytes; write the"):
        Module(model_bytes, state)
    with pytest.raises(TypeError, match="Module eval_model_uri must be the path of a file.*got bytearray"):
        Module(artifacts.training, state, bytearray(artifacts.eval.read_bytes()))
    module = Module(str(artifacts.training), state)
    with pytest.raises(TypeError, match="Optimizer optimizer_uri must be the path of a file.*got bytes"):
        Optimizer(artifacts.optimizer.read_bytes(), module)
