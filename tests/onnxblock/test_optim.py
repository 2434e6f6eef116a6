"""Optimizer graphs against independent references: torch.optim and a numpy HF-AdamW."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxtrain import names
from onnxtrain.ir import io
from onnxtrain.onnxblock import empty_base, optim

torch = pytest.importorskip("torch")

# a matrix, small vectors that the optimizer updates jointly, and a vector too long to join
SHAPES = {"w": (3, 4), "b": (4,), "norm_w": (5,), "norm_b": (5,), "long": (optim.JOINT_UPDATE_MAX_ELEMENTS + 1,)}


def _run_steps(block, grads_per_step, lr, init):
    with empty_base():
        block(list(init.items()))
    session = ort.InferenceSession(io.serialize(block.to_ir_model()), providers=["CPUExecutionProvider"])
    params = {k: v.copy() for k, v in init.items()}
    states = {(k, s): np.zeros_like(v) for k, v in init.items() for s in block.states}
    for t, grads in enumerate(grads_per_step, start=1):
        feeds = {names.LEARNING_RATE: np.array(lr, np.float32), names.STEP: np.array(t, np.int64)}
        for k in params:
            feeds[k], feeds[names.grad_name(k)] = params[k], grads[k]
            for s in block.states:
                feeds[names.state_name(k, s)] = states[(k, s)]
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for k in params:
            params[k] = out[names.updated_name(k)]
            for s in block.states:
                states[(k, s)] = out[names.updated_name(names.state_name(k, s))]
    return params


def _data(steps=6, seed=0):
    rng = np.random.default_rng(seed)
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]
    return init, grads


def _torch_steps(make_opt, init, grads_per_step, clip=None):
    params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    opt = make_opt(list(params.values()))
    for grads in grads_per_step:
        for k, p in params.items():
            p.grad = torch.tensor(grads[k])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
    return {k: p.detach().numpy() for k, p in params.items()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_torch_mode_matches_torch(weight_decay):
    init, grads = _data()
    ours = _run_steps(optim.AdamW(betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, mode="torch"),
                      grads, 0.01, init)
    ref = _torch_steps(lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.9, 0.99), eps=1e-8,
                                                   weight_decay=weight_decay), init, grads)
    for k in init:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-6)


def _hf_adamw_numpy(init, grads_per_step, lr, betas, eps, weight_decay, correct_bias=True):
    """The Hugging Face transformers AdamW update, written out independently."""
    params = {k: v.astype(np.float64) for k, v in init.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        for k in params:
            g = grads[k].astype(np.float64)
            m[k] = betas[0] * m[k] + (1 - betas[0]) * g
            v2[k] = betas[1] * v2[k] + (1 - betas[1]) * g * g
            step_size = lr
            if correct_bias:
                step_size = lr * np.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
            params[k] = params[k] - step_size * m[k] / (np.sqrt(v2[k]) + eps)
            params[k] = params[k] - lr * weight_decay * params[k]
    return params


@pytest.mark.parametrize("correct_bias", [True, False])
def test_adamw_default_is_transformers_adamw(correct_bias):
    init, grads = _data(seed=1)
    block = optim.AdamW(bias_correction=correct_bias, weight_decay=0.01)
    assert block.betas == (0.9, 0.999) and block.eps == 1e-6  # upstream defaults
    ours = _run_steps(block, grads, 0.005, init)
    ref = _hf_adamw_numpy(init, grads, 0.005, (0.9, 0.999), 1e-6, 0.01, correct_bias)
    for k in init:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["transformers", "torch"])
def test_adamw_bias_corrections_are_computed_in_float64(mode):
    """1 - 0.999**t in float32 loses ~1.3e-5 relative to cancellation at t=1 (PyTorch and upstream
    compute it in float64): from zero parameters the first updates are the step sizes themselves."""
    init = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    _, grads = _data(steps=3, seed=2)
    for steps in (1, 3):
        ours = _run_steps(optim.AdamW(eps=1e-8, mode=mode), grads[:steps], 1e-3, init)
        ref = _hf_adamw_numpy(init, grads[:steps], 1e-3, (0.9, 0.999), 1e-8, 0.0) if mode == "transformers" else \
            _torch_steps(lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-8, weight_decay=0.0), init, grads[:steps])
        for k in init:
            np.testing.assert_allclose(ours[k], ref[k], rtol=1e-6, atol=1e-9, err_msg=f"{k}, {steps} steps")


@pytest.mark.parametrize("kwargs", [
    {}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    {"momentum": 0.8, "nesterov": True, "weight_decay": 0.1},
])
def test_sgd_matches_torch(kwargs):
    init, grads = _data(seed=2)
    ours = _run_steps(optim.SGD(**kwargs), grads, 0.1, init)
    ref = _torch_steps(lambda p: torch.optim.SGD(p, lr=0.1, **kwargs), init, grads)
    for k in init:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_matches_torch():
    init, grads = _data(seed=3)
    ours = _run_steps(optim.SGD(momentum=0.9, clip_grad=optim.ClipGradNorm(0.5)), grads, 0.1, init)
    ref = _torch_steps(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), init, grads, clip=0.5)
    for k in init:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-6)


def test_optimizer_model_uses_standard_ops_only():
    init, _ = _data()
    block = optim.AdamW(clip_grad=optim.ClipGradNorm(1.0))
    with empty_base():
        block(list(init.items()))
    model = block.to_ir_model()
    assert {n.domain for n in model.graph} == {""}


def test_upstreams_accessor_flow_saves_the_optimizer_model(tmp_path):
    """Upstream's documented flow: ``with empty_base() as accessor``, build, ``onnx.save(accessor.model)``."""
    import onnx

    init, _ = _data(steps=2)
    with empty_base() as accessor:
        optim.SGD()(list(init.items()))
        onnx.save(accessor.model, tmp_path / "optimizer_model.onnx")
    session = ort.InferenceSession(tmp_path / "optimizer_model.onnx", providers=["CPUExecutionProvider"])
    assert {i.name for i in session.get_inputs()} >= set(init) | {names.grad_name(k) for k in init}


@pytest.mark.parametrize("block", [
    lambda: optim.AdamW(weight_decay=0.01), lambda: optim.AdamW(mode="torch", weight_decay=0.01),
    lambda: optim.SGD(momentum=0.9, nesterov=True, weight_decay=0.1)], ids=["adamw", "adamw-torch", "sgd"])
def test_small_vectors_updated_jointly_give_bit_identical_results(block, monkeypatch):
    """The joined update (one Concat per input, one Split per output) against one update per
    parameter: the same elementwise arithmetic, so the same bits."""
    init, grads = _data(steps=3, seed=4)
    joined_block = block()
    joined = _run_steps(joined_block, grads, 0.01, init)
    ops = [n.op_type for n in joined_block.to_ir_model().graph]
    assert ops.count("Split") == 1 + len(joined_block.states)  # b, norm_w and norm_b: one group
    monkeypatch.setattr(optim, "JOINT_UPDATE_MAX_ELEMENTS", 0)
    separate_block = block()
    separate = _run_steps(separate_block, grads, 0.01, init)
    assert "Split" not in [n.op_type for n in separate_block.to_ir_model().graph]
    assert len(ops) < len(list(separate_block.to_ir_model().graph))
    for k in init:
        np.testing.assert_array_equal(joined[k], separate[k])
