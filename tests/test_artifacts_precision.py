"""generate_artifacts(precision=...): bf16/fp16 training on the on-device API, against the
fp32 artifacts of the same model; fp16 dynamic loss scaling against GradScaler's rules."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.torch_models import MLP, export, torch

from onnxtrain import artifacts, names
from onnxtrain.api import CheckpointState, Module, Optimizer
from onnxtrain.errors import ArtifactError, CheckpointError
from onnxtrain.onnxblock.loss_scale import DynamicLossScale

STEPS = 30
# bf16 keeps 8 significant bits, fp16 11: losses of the low-precision runs stay within this
# relative distance of the fp32 run over STEPS steps (measured: ~1e-3 bf16, ~1e-4 fp16)
LOW_PRECISION_RTOL = {"bf16": 2e-2, "fp16": 5e-3}


@pytest.fixture(scope="module")
def mlp_onnx():
    torch.manual_seed(0)
    return export(MLP(), (torch.randn(8, 12),), ["x"], ({0: torch.export.Dim("batch", min=2, max=64)},))


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 12)).astype(np.float32), rng.integers(0, 5, 64).astype(np.int32)


def _artifacts(model, tmp_path, precision, **kwargs):
    folder = tmp_path / precision
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 precision=precision, **kwargs)
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    optimizer = Optimizer(folder / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(1e-2)
    return folder, state, module, optimizer


def _train(module, optimizer, x, y, steps=STEPS):
    losses = []
    for i in range(steps):
        rows = slice((i * 16) % len(x), (i * 16) % len(x) + 16)
        losses.append(float(module(x[rows], y[rows])))
        optimizer.step()
        module.lazy_reset_grad()
    return np.array(losses)


def test_bf16_and_fp16_artifacts_train_like_fp32_with_fp32_master_weights(mlp_onnx, tmp_path):
    x, y = _data()
    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        folder, state, module, optimizer = _artifacts(mlp_onnx, tmp_path, precision)
        curves[precision] = _train(module, optimizer, x, y)
        for name, param in state.parameters:
            assert param.data.dtype == np.float32 and param.grad.dtype == np.float32, (precision, name)
        CheckpointState.save_checkpoint(state, tmp_path / f"{precision}.ckpt")
        reloaded = CheckpointState.load_checkpoint(tmp_path / f"{precision}.ckpt")
        assert all(p.data.dtype == np.float32 for _, p in reloaded.parameters)
        if precision != "fp32":  # the graphs really compute in the low dtype
            low = {"bf16": onnx.TensorProto.BFLOAT16, "fp16": onnx.TensorProto.FLOAT16}[precision]
            for graph_file in ("training_model.onnx", "eval_model.onnx"):
                graph = onnx.load(folder / graph_file).graph
                assert any(n.op_type == "Cast" and n.attribute[0].i == low for n in graph.node), graph_file
    fp32 = curves["fp32"]
    assert fp32[-5:].mean() < fp32[:5].mean() - 0.1  # it learns
    for precision in ("bf16", "fp16"):
        relative = np.abs(curves[precision] - fp32) / fp32
        assert relative.max() < LOW_PRECISION_RTOL[precision], (precision, relative.max())
        assert not np.array_equal(curves[precision], fp32)  # rounding happened


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(mlp_onnx, tmp_path):
    x, y = _data()
    _, state, module, optimizer = _artifacts(mlp_onnx, tmp_path, "fp16")
    assert state.properties[names.LOSS_SCALE] == 2.0 ** 16  # GradScaler's initial scale
    _train(module, optimizer, x, y, steps=3)
    assert not optimizer.last_step_skipped and optimizer.step_count == 3
    assert state.properties[names.LOSS_SCALE_GROWTH_TRACKER] == 3
    before = {n: p.data.copy() for n, p in state.parameters}

    # a scale that makes the fp16 gradients overflow: the loss gradient (seeded with the
    # scale) is inf once cast to fp16
    state.properties[names.LOSS_SCALE] = 2.0 ** 40
    loss = module(x[:16], y[:16])
    assert np.isfinite(loss)  # the loss itself is not scaled
    grads = [p.grad for _, p in state.parameters]
    assert not all(np.isfinite(g).all() for g in grads)
    optimizer.step()
    module.lazy_reset_grad()
    assert optimizer.last_step_skipped and optimizer.step_count == 3
    for name, param in state.parameters:
        np.testing.assert_array_equal(param.data, before[name], err_msg=name)
    assert state.properties[names.LOSS_SCALE] == 2.0 ** 39  # backoff_factor 0.5
    assert state.properties[names.LOSS_SCALE_GROWTH_TRACKER] == 0

    CheckpointState.save_checkpoint(state, tmp_path / "scaled.ckpt")  # the scale state is saved
    reloaded = CheckpointState.load_checkpoint(tmp_path / "scaled.ckpt")
    assert reloaded.properties[names.LOSS_SCALE] == 2.0 ** 39
    assert reloaded.properties[names.LOSS_SCALE_GROWTH_TRACKER] == 0

    state.properties[names.LOSS_SCALE] = 2.0 ** 10
    _train(module, optimizer, x, y, steps=1)
    assert not optimizer.last_step_skipped and optimizer.step_count == 4
    assert not all(np.array_equal(p.data, before[n]) for n, p in state.parameters)

    # a scale or tracker that is not a count is refused by name, before anything runs
    for name, value, message in [(names.LOSS_SCALE, "65536x", "'loss_scale' is '65536x'; .*positive finite"),
                                 (names.LOSS_SCALE, 0.0, "'loss_scale' is 0.0"),
                                 (names.LOSS_SCALE_GROWTH_TRACKER, 2.5, "'loss_scale_growth_tracker' is 2.5; .*>= 0")]:
        kept = state.properties[name]
        state.properties[name] = value
        with pytest.raises(CheckpointError, match=message):
            module(x[:16], y[:16])
        state.properties[name] = kept
    module(x[:16], y[:16])
    del state.properties[names.LOSS_SCALE]
    with pytest.raises(CheckpointError, match="'loss_scale' is None"):
        optimizer.step()
    assert optimizer.step_count == 4


def test_fp16_scale_follows_grad_scaler(mlp_onnx, tmp_path):
    """The same sequence of finite/overflowing steps through torch.amp.GradScaler and through
    the optimizer model: the same scales."""
    x, y = _data()
    config = DynamicLossScale(init_scale=2.0 ** 8, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    _, state, module, optimizer = _artifacts(mlp_onnx, tmp_path, "fp16", loss_scale=config)
    param = torch.nn.Parameter(torch.zeros(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_factor=config.growth_factor,
                                  backoff_factor=config.backoff_factor, growth_interval=config.growth_interval)
    sgd = torch.optim.SGD([param], lr=0.1)
    scaler.scale(torch.zeros(()))  # GradScaler creates its scale tensor on first use
    for overflow in (False, False, False, True, False, False, True, True, False):
        # an input beyond fp16's range (65504) overflows the first MatMul's fp16 input
        module(x[:16] * (1e5 if overflow else 1.0), y[:16])
        optimizer.step()
        module.lazy_reset_grad()
        param.grad = torch.full((1,), float("inf") if overflow else 1.0)
        scaler.step(sgd)
        scaler.update()
        assert optimizer.last_step_skipped == overflow
        assert state.properties[names.LOSS_SCALE] == scaler.get_scale()
        assert state.properties[names.LOSS_SCALE_GROWTH_TRACKER] == scaler._get_growth_tracker()


def test_precision_arguments_are_checked(mlp_onnx, tmp_path):
    with pytest.raises(ArtifactError, match="precision must be one of"):
        artifacts.generate_artifacts(mlp_onnx, loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path, precision="fp8")
    with pytest.raises(ArtifactError, match="precision='fp16' only"):
        artifacts.generate_artifacts(mlp_onnx, loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path, precision="bf16", loss_scale=DynamicLossScale())
    with pytest.raises(ArtifactError, match="growth_factor > 1"):
        DynamicLossScale(growth_factor=0.5)


@pytest.mark.slow  # ~20 s: three exports' worth of artifacts and 60 GPT steps
def test_gpt_artifacts_in_bf16_and_fp16_track_fp32(tmp_path):
    from bench.cell import flat_cross_entropy_block
    from tests.torch_models import examples

    ex = examples()["gpt"]
    rng = np.random.default_rng(0)
    onnx_model = export(ex.model.eval(), tuple(torch.tensor(a) for a in ex.inputs(4, rng)), ex.input_names,
                        ex.dynamic())
    inputs, labels = ex.inputs(6, rng), ex.labels(6, rng).astype(np.int32)
    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        folder = tmp_path / precision
        artifacts.generate_artifacts(onnx_model, loss=flat_cross_entropy_block(), optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=folder, precision=precision)
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state)
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        optimizer.set_learning_rate(1e-2)
        losses = []
        for _ in range(20):  # one fixed batch: the loss must fall
            losses.append(float(module(*inputs, labels)))
            optimizer.step()
            module.lazy_reset_grad()
        curves[precision] = np.array(losses)
        assert all(p.data.dtype == np.float32 for _, p in state.parameters)
    assert curves["fp32"][-1] < 0.7 * curves["fp32"][0]
    for precision in ("bf16", "fp16"):
        relative = np.abs(curves[precision] - curves["fp32"]) / curves["fp32"]
        assert relative.max() < LOW_PRECISION_RTOL[precision], (precision, relative.max())


def test_a_bfloat16_model_is_refused_before_any_file_is_written(tmp_path):
    """A checkpoint stores no bfloat16: the error (which says what to do instead) comes before the
    training and eval models are written, not after (they were left behind)."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((4, 3), np.float32).astype(ml_dtypes.bfloat16), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N", 3])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ArtifactError, match=r"parameter 'w'.*bfloat16.*float32 model.*precision='bf16'"):
        artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _loop_model():
    """y = Loop n times: h <- tanh(h @ W), from h = x @ V: one product at the top, one in the body."""
    from onnx import TensorProto, helper, numpy_helper

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    body = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Tanh", ["hw"], ["h2"]),
                              helper.make_node("Identity", ["c"], ["c2"])], "body",
                             [info("i", TensorProto.INT64, []), info("c", TensorProto.BOOL, []),
                              info("h", TensorProto.FLOAT, ["N", 3])],
                             [info("c2", TensorProto.BOOL, []), info("h2", TensorProto.FLOAT, ["N", 3])])
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "V"], ["xv"]), helper.make_node("Loop", ["n", "", "xv"], ["y"], body=body)],
        "g", [info("x", TensorProto.FLOAT, ["N", 3]), info("n", TensorProto.INT64, [])],
        [info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.normal(0, 0.5, (3, 3)).astype(np.float32), name) for name in ("W", "V")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_products_inside_a_loop_body_compute_in_low_precision_too(tmp_path):
    """The precision pass converted the main graph only: a MatMul in a Loop body (or If branch)
    stayed float32, silently."""
    rng = np.random.default_rng(1)
    x, target, n = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32), np.array(3)
    losses = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        artifacts.generate_artifacts(_loop_model(), requires_grad=["W", "V"], loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=out, precision=precision)
        body = next(node for node in onnx.load(out / "training_model.onnx").graph.node if node.op_type == "Loop")
        body_casts = [node for node in body.attribute[0].g.node if node.op_type == "Cast"
                      and node.attribute[0].i == onnx.TensorProto.BFLOAT16]
        assert bool(body_casts) == (precision == "bf16")
        state = CheckpointState.load_checkpoint(out / "checkpoint")
        module = Module(out / "training_model.onnx", state, out / "eval_model.onnx")
        optimizer = Optimizer(out / "optimizer_model.onnx", module)
        losses[precision] = []
        for _ in range(5):
            losses[precision].append(float(module(x, n, target)))
            optimizer.step()
            module.lazy_reset_grad()
    assert losses["bf16"] != losses["fp32"]
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=LOW_PRECISION_RTOL["bf16"])
