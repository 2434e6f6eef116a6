"""The fused training step: forward, backward and update in one session run.

Every test compares a fused Optimizer with an unfused one (``fused_step=False``: the
training model, then the optimizer model) doing the same calls from the same checkpoint,
so the reference is the two-session path the rest of tests/api checks against numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain import artifacts, names
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.errors import InputMismatchError, ModelError
from onnxtrain.fused_step import build_fused_step_model
from onnxtrain.ir import io

from ..test_artifacts import batches, regression_model
from .conftest import batch, make_artifacts

# the same arithmetic in one graph or two: ORT may order a reduction differently
RTOL, ATOL = 1e-6, 1e-7


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """onnxtrain's own artifacts (accumulation as an If), AdamW with weight decay and clipping."""
    folder = tmp_path_factory.mktemp("generated")
    from onnxtrain import onnxblock

    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss,
                                 optimizer=onnxblock.optim.AdamW(weight_decay=0.05,
                                                                 clip_grad=onnxblock.optim.ClipGradNorm(1.0)),
                                 artifact_directory=folder)
    return folder


def _pair(folder, **module_kwargs):
    """(state, module, optimizer) fused and unfused, from the same checkpoint."""
    out = {}
    for fused in (True, False):
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx", **module_kwargs)
        optimizer = Optimizer(folder / "optimizer_model.onnx", module, fused_step=fused)
        optimizer.set_learning_rate(0.05)
        out[fused] = (state, module, optimizer)
    return out[True], out[False]


def _assert_same_state(a: CheckpointState, b: CheckpointState):
    for name, param in a.parameters.items():
        np.testing.assert_allclose(param.data, b.parameters[name].data, rtol=RTOL, atol=ATOL, err_msg=name)
        if param.requires_grad:
            np.testing.assert_allclose(param.grad, b.parameters[name].grad, rtol=RTOL, atol=ATOL, err_msg=name)
    moments_a, moments_b = a._optimizer.values(), b._optimizer.values()
    for param, per in moments_a.items():
        for key, value in per.items():
            np.testing.assert_allclose(value, moments_b[param][key], rtol=RTOL, atol=ATOL, err_msg=f"{param}.{key}")
    assert a._optimizer.step == b._optimizer.step


def _count_runs(monkeypatch, session) -> list:
    calls = []
    real = session.run_with_iobinding

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(session, "run_with_iobinding", counted)
    return calls


def test_plain_loop_runs_one_session_per_step_and_matches(generated, monkeypatch):
    (state, module, optimizer), (ref_state, ref_module, ref_optimizer) = _pair(generated)
    assert optimizer.fused_step_error is None and ref_optimizer.fused_step_error == "fused_step=False"
    fused_runs = _count_runs(monkeypatch, optimizer._fused.session)
    other_runs = _count_runs(monkeypatch, optimizer._session) + _count_runs(monkeypatch, module._train_session)
    for x, y in batches(3, 6):
        losses = []
        for m, o in ((module, optimizer), (ref_module, ref_optimizer)):
            losses.append(float(m(x, y)))
            o.step()
            m.lazy_reset_grad()
        np.testing.assert_allclose(losses[0], losses[1], rtol=RTOL)
        _assert_same_state(state, ref_state)
    assert len(fused_runs) == 6 and not other_runs
    losses = [float(m.eval()(x, y)) for m in (module, ref_module) for x, y in batches(9, 1)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_gradient_accumulation_stops_computing_updates_it_throws_away(generated, monkeypatch):
    """Accumulating two micro-batches per step: the first cycle's fused update goes unused, so the
    next cycles run the training model alone; plain steps bring the fused step back after one."""
    (state, module, optimizer), (ref_state, ref_module, ref_optimizer) = _pair(generated)
    fused_runs = _count_runs(monkeypatch, optimizer._fused.session)
    training_runs = _count_runs(monkeypatch, module._train_session)
    optimizer_runs = _count_runs(monkeypatch, optimizer._session)
    data = list(batches(6, 8))
    for cycle in range(3):
        for m, o in ((module, optimizer), (ref_module, ref_optimizer)):
            m(*data[2 * cycle])
            m(*data[2 * cycle + 1])
            o.step()
            m.lazy_reset_grad()
        _assert_same_state(state, ref_state)
    assert (len(fused_runs), len(training_runs), len(optimizer_runs)) == (1, 5, 3)
    for x, y in data[6:]:
        for m, o in ((module, optimizer), (ref_module, ref_optimizer)):
            m(x, y)
            o.step()
            m.lazy_reset_grad()
        _assert_same_state(state, ref_state)
    assert (len(fused_runs), len(training_runs), len(optimizer_runs)) == (2, 6, 4)


@pytest.mark.parametrize("between", ["set_learning_rate", "assign_parameter", "accumulate", "copy_buffer",
                                     "reset_and_rerun"])
def test_update_is_recomputed_when_something_changed_before_step(generated, between):
    (state, module, optimizer), (ref_state, ref_module, ref_optimizer) = _pair(generated)
    (x1, y1), (x2, y2) = batches(4, 2)
    for s, m, o in ((state, module, optimizer), (ref_state, ref_module, ref_optimizer)):
        m(x1, y1)
        o.step()
        m.lazy_reset_grad()
        m(x2, y2)  # fused: the update for this batch waits in the spare buffers
        if between == "set_learning_rate":
            o.set_learning_rate(0.2)
        elif between == "assign_parameter":
            s.parameters["w1"] = s.parameters["w1"].data * 0.5
        elif between == "accumulate":
            m(x1, y1)
        elif between == "copy_buffer":
            m.copy_buffer_to_parameters(m.get_contiguous_parameters(trainable_only=True).numpy() + 0.25)
        elif between == "reset_and_rerun":
            m.lazy_reset_grad()
            m(x1, y1)
        o.step()
        m.lazy_reset_grad()
    _assert_same_state(state, ref_state)


@pytest.mark.parametrize("case", ["batchnorm", "fp16"])
def test_batchnorm_statistics_and_fp16_loss_scaling(tmp_path, case):
    from ..test_ort_format import batchnorm_cnn

    rng = np.random.default_rng(0)
    if case == "batchnorm":  # the training run also writes the running statistics back
        model, options = batchnorm_cnn(), {"loss": artifacts.LossType.CrossEntropyLoss,
                                           "frozen_params": ["bn.running_mean", "bn.running_var"],
                                           "requires_grad": ["conv.weight", "bn.weight", "bn.bias", "fc.weight"]}
        data = [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32))
                for _ in range(4)]
    else:  # loss_scale inputs, the optimizer's If on all_finite
        model, options, data = regression_model(), {"loss": artifacts.LossType.MSELoss, "precision": "fp16"}, \
            list(batches(5, 4))
    folder = tmp_path / case
    artifacts.generate_artifacts(model, optimizer=artifacts.OptimType.AdamW, artifact_directory=folder, **options)
    (state, module, optimizer), (ref_state, ref_module, ref_optimizer) = _pair(folder)
    assert optimizer.fused_step_error is None
    for x, y in data:
        for m, o in ((module, optimizer), (ref_module, ref_optimizer)):
            m(x, y)
            o.step()
            m.lazy_reset_grad()
    _assert_same_state(state, ref_state)
    if case == "batchnorm":
        assert not np.array_equal(state.parameters["bn.running_mean"].data, np.zeros(4, np.float32))
    else:  # an overflowing scale: the fused step is skipped and the scale backs off
        for s, m, o in ((state, module, optimizer), (ref_state, ref_module, ref_optimizer)):
            s.properties[names.LOSS_SCALE] = 2.0 ** 40
            steps = o.step_count
            m(*data[0])
            o.step()
            assert o.last_step_skipped and o.step_count == steps
        assert state.properties[names.LOSS_SCALE] == ref_state.properties[names.LOSS_SCALE] == 2.0 ** 39
        _assert_same_state(state, ref_state)


def test_where_accumulation_and_failed_fused_run(tmp_path, monkeypatch):
    """Hand-built artifacts (accumulation as a Where); a failed run leaves the pending update unused."""
    arts = make_artifacts(tmp_path / "adamw", "adamw")
    (state, module, optimizer), (ref_state, ref_module, ref_optimizer) = _pair(arts.dir)
    assert optimizer.fused_step_error is None
    for m, o in ((module, optimizer), (ref_module, ref_optimizer)):
        m(*batch(4, 1))
        o.step()
        m.lazy_reset_grad()
        m(*batch(4, 2))
    before = {n: p.data.copy() for n, p in state.parameters.items()}
    with pytest.raises(InputMismatchError):
        module(np.zeros((4, 7), np.float32), batch(4, 2)[1])
    real_run = optimizer._fused.session.run_with_iobinding

    def fail(*args):
        real_run(*args)  # writes the spare buffers, then fails: nothing may become current
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(optimizer._fused.session, "run_with_iobinding", fail)
    module.lazy_reset_grad()
    with pytest.raises(RuntimeError, match="simulated"):
        module(*batch(4, 3))
    monkeypatch.undo()
    for name, value in before.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)
    optimizer.step()  # the gradients of batch(4, 2), from the last successful run
    ref_optimizer.step()
    _assert_same_state(state, ref_state)


def test_fused_step_needs_onnx_models(tmp_path):
    directory = tmp_path / "artifacts"
    artifacts.generate_artifacts(regression_model(), loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=directory, ort_format=True)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.ort", state)
    optimizer = Optimizer(directory / "optimizer_model.ort", module)
    assert "ORT format" in optimizer.fused_step_error and module._fused_step is None
    with pytest.raises(ModelError, match="ORT format"):
        Optimizer(directory / "optimizer_model.ort", module, fused_step=True)
    # an unfused Optimizer replaces a fused one: the module stops running the old fused step
    fused = Optimizer(directory / "optimizer_model.onnx", Module(directory / "training_model.onnx", state))
    assert fused.fused_step_error is None and fused._module._fused_step is fused._fused
    Optimizer(directory / "optimizer_model.onnx", fused._module, fused_step=False)
    assert fused._module._fused_step is None


def test_training_models_that_cannot_be_fused_are_named(tmp_path, generated):
    training = onnx.load(generated / "training_model.onnx")
    reset = names.LAZY_RESET_GRAD
    training.graph.node.append(onnx.helper.make_node("Not", [reset], ["flag_copy"]))
    training.graph.output.append(onnx.helper.make_tensor_value_info("flag_copy", onnx.TensorProto.BOOL, []))
    with pytest.raises(ModelError, match="other than as the condition"):
        build_fused_step_model(io.load_model(training), io.load_model(generated / "optimizer_model.onnx"))
    optimizer = onnx.load(generated / "optimizer_model.onnx")
    optimizer.opset_import[0].version = 19
    with pytest.raises(ModelError, match="opset"):
        build_fused_step_model(io.load_model(generated / "training_model.onnx"), io.load_model(optimizer))
