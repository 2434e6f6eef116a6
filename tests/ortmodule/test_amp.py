"""onnxtrain.torch.amp.GradScaler against torch.amp.GradScaler("cpu"): the same skip decisions and
the same scale sequence on runs with injected overflows, with a plain model and an ORTModule one."""

import copy
import math
import warnings

import pytest

from tests.torch_models import MLP, torch

from onnxtrain.errors import OnnxTrainError
from onnxtrain.torch import DebugOptions, ORTModule
from onnxtrain.torch.amp import GradScaler
from onnxtrain.torch.optim import OptimizerConfigError, ScalerStateError

STEPS = 24
GROWTH_INTERVAL = 3  # small, so that the scale also grows during the run
INF_GRAD_STEPS = {2: math.inf, 9: -math.inf, 13: math.nan}  # step -> value written into one gradient
HUGE_LOSS_STEPS = {18}  # the loss times 1e36: the scaled loss overflows float32


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 12, generator=gen), torch.randn(6, 5, generator=gen)


def _run(model, scaler, optimizer):
    """Train with injected overflows; per step: (skipped, scale after update())."""
    record = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = (model(x) - y).square().mean()
        if step in HUGE_LOSS_STEPS:
            loss = loss * 1e36
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if step in INF_GRAD_STEPS:
            next(model.parameters()).grad.view(-1)[3] = INF_GRAD_STEPS[step]
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        record.append((skipped, scaler.get_scale()))
    return record


def _expected_skips():
    return [s in INF_GRAD_STEPS or s in HUGE_LOSS_STEPS for s in range(STEPS)]


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_same_decisions_and_scales_as_torch_on_a_plain_model(optimizer_cls):
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ours = _run(model, GradScaler("cpu", growth_interval=GROWTH_INTERVAL), optimizer_cls(model.parameters(), lr=0.01))
    theirs = _run(twin, torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL),
                  optimizer_cls(twin.parameters(), lr=0.01))
    assert ours == theirs
    assert [skipped for skipped, _ in ours] == _expected_skips()
    scales = [s for _, s in ours]
    assert min(scales) < 2.0 ** 16 < max(scales)  # it backed off and grew
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_same_decisions_and_scales_as_torch_with_an_ortmodule_model():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    wrapped = ORTModule(model, DebugOptions(fallback=False))
    ours = _run(wrapped, GradScaler("cpu", growth_interval=GROWTH_INTERVAL),
                torch.optim.AdamW(wrapped.parameters(), lr=0.01))
    theirs = _run(twin, torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL),
                  torch.optim.AdamW(twin.parameters(), lr=0.01))
    assert ours == theirs
    assert [skipped for skipped, _ in ours] == _expected_skips()
    for a, b in zip(wrapped.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # ORT's kernels, not bit-identical


def test_defaults_and_state_dict_are_torchs_and_interchangeable():
    assert GradScaler("cpu").state_dict() == torch.amp.GradScaler("cpu").state_dict()
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ours = GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    theirs = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    first = _run(model, ours, torch.optim.SGD(model.parameters(), lr=0.01))
    _run(twin, theirs, torch.optim.SGD(twin.parameters(), lr=0.01))
    assert ours.state_dict() == theirs.state_dict()
    # a torch checkpoint resumes in ours and the other way round
    resumed, back = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    resumed.load_state_dict(theirs.state_dict())
    back.load_state_dict(ours.state_dict())
    assert resumed.state_dict() == back.state_dict() == ours.state_dict()
    assert resumed.get_scale() == first[-1][1]


def test_fp16_and_bf16_gradients_are_unscaled_in_place_and_checked():
    for dtype in (torch.float16, torch.bfloat16):
        w = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        optimizer = torch.optim.SGD([w], lr=1.0)
        scaler = GradScaler("cpu", init_scale=8.0)
        scaler.scale((w * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)).sum()).backward()
        assert torch.equal(w.grad, torch.tensor([8.0, 16.0, 24.0, 32.0], dtype=dtype))
        scaler.unscale_(optimizer)
        assert torch.equal(w.grad, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype))
        assert not scaler.found_inf(optimizer)
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(w.detach(), torch.tensor([0.0, -1.0, -2.0, -3.0], dtype=dtype))
        # an inf in a low-precision gradient: skipped, scale halved
        scaler.scale(w.sum()).backward()
        w.grad[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 4.0
        assert torch.equal(w.detach(), torch.tensor([0.0, -1.0, -2.0, -3.0], dtype=dtype))


def test_unscale_then_clip_then_step():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    optimizer = torch.optim.SGD([w], lr=1.0)
    scaler = GradScaler("cpu")
    scaler.scale((w * w).sum() / 2).backward()  # grad = w, times 2**16
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_([w], 1.0)
    assert norm.item() == pytest.approx(5.0)
    scaler.step(optimizer)  # does not unscale again
    scaler.update()
    torch.testing.assert_close(w.detach(), torch.tensor([3.0 - 0.6, 4.0 - 0.8]))


def test_calls_out_of_order_raise_typed_errors():
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu")
    with pytest.raises(ScalerStateError, match="scale"):
        scaler.step(optimizer)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(ScalerStateError, match="unscale_"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(ScalerStateError, match="step"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError):  # also a RuntimeError, as PyTorch's
        scaler.unscale_(optimizer)
    scaler.update()
    with pytest.raises(ScalerStateError, match="no inf checks"):
        scaler.update()
    with pytest.raises(ScalerStateError, match="closure"):
        scaler.step(optimizer, closure=lambda: None)


def test_update_with_a_new_scale_and_disabled_scaler():
    w = torch.nn.Parameter(torch.ones(2))
    scaler = GradScaler("cpu")
    scaler.scale(w.sum())
    scaler.update(128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(torch.tensor(32.0))
    assert scaler.get_scale() == 32.0

    off = GradScaler("cpu", enabled=False)
    loss = w.sum()
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
    loss.backward()
    off.step(torch.optim.SGD([w], lr=1.0))
    assert torch.equal(w.detach(), torch.zeros(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_scaler_without_cuda_warns_and_disables_itself():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = GradScaler()
    assert not scaler.is_enabled()
    assert any("CUDA is not available" in str(w.message) for w in caught)


@pytest.mark.parametrize("kwargs, words", [
    ({"init_scale": 0.0}, "init_scale"), ({"growth_factor": 1.0}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"), ({"growth_interval": 0}, "growth_interval"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(OptimizerConfigError, match=words) as info:
        GradScaler("cpu", **kwargs)
    assert isinstance(info.value, OnnxTrainError)
