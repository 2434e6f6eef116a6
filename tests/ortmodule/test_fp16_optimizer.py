"""FP16_Optimizer: skipped steps on overflow, fp32 masters against an fp32 run, bit-identical resume."""

import copy
import io
import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch.optim import FP16_Optimizer, FusedAdam, LAMB, OptimizerConfigError, ZeroOptimizer  # noqa: E402

INNER = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "LAMB": lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01),
    # keeps parameter references beside its groups: it rebuilds over the masters FP16_Optimizer puts there
    "ZeroOptimizer": lambda ps: ZeroOptimizer(ps, FusedAdam, lr=1e-3, weight_decay=0.01),
}


def _model(dtype=torch.float16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    return model.to(dtype)


def _batch(step, dtype):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=gen).to(dtype), torch.randn(16, 5, generator=gen)


def _loss(model, step, dtype):
    x, y = _batch(step, dtype)
    return (model(x).float() - y).square().mean()


def _train_step(model, optimizer, step, dtype, inject_inf=False):
    optimizer.zero_grad()
    optimizer.backward(_loss(model, step, dtype))
    if inject_inf:
        next(model.parameters()).grad.view(-1)[7] = math.inf
    optimizer.step()


@pytest.mark.parametrize("inner", list(INNER))
def test_overflow_skips_the_step_and_halves_the_scale(inner):
    model = _model()
    optimizer = FP16_Optimizer(INNER[inner](model.parameters()), dynamic_loss_scale=True,
                               dynamic_loss_args={"init_scale": 1024.0})
    for step in range(3):
        _train_step(model, optimizer, step, torch.float16)
        assert not optimizer.overflow
    params = [p.detach().clone() for p in model.parameters()]
    before = copy.deepcopy(optimizer.state_dict())
    _train_step(model, optimizer, 3, torch.float16, inject_inf=True)
    assert optimizer.overflow and optimizer.loss_scale == 512.0
    after = optimizer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before["fp32_masters"], after["fp32_masters"]))
    assert before["optimizer"]["param_groups"] == after["optimizer"]["param_groups"]  # step counts too
    for index, state in before["optimizer"]["state"].items():
        for key, value in state.items():
            now = after["optimizer"]["state"][index][key]
            assert torch.equal(value, now) if isinstance(value, torch.Tensor) else value == now, (index, key)
    _train_step(model, optimizer, 4, torch.float16)  # and training goes on
    assert not optimizer.overflow
    assert not all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


FP16_TOL = 1.5e-4  # measured ~4e-5..8e-5 after 20 steps; updating fp16 weights directly drifts ~1e-3
BF16_TOL = 3e-3  # bf16 keeps 8 bits: Adam's early sign-like updates flip on tiny gradients (~2 lr)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, FP16_TOL), (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("inner", list(INNER))
def test_masters_track_an_fp32_run_of_the_same_optimizer(inner, dtype, atol):
    half = _model(dtype)
    half[2].float()  # a layer kept in fp32: its parameters are their own masters
    reference = copy.deepcopy(half).float()  # from the same (rounded) starting point
    start = [p.detach().clone() for p in reference.parameters()]
    ref_optimizer = INNER[inner](reference.parameters())
    optimizer = FP16_Optimizer(INNER[inner](half.parameters()), dynamic_loss_scale=True)
    for step in range(20):
        ref_optimizer.zero_grad()
        _loss(reference, step, torch.float32).backward()
        ref_optimizer.step()
        x, y = _batch(step, dtype)
        optimizer.zero_grad()
        optimizer.backward((half[2](half[1](half[0](x)).float()) - y).square().mean())
        optimizer.step()
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert masters[2] is half[2].weight  # fp32 parameters are not copied
    moved = max((m.detach() - s).abs().max().item() for m, s in zip(masters, start))
    assert moved > 25 * FP16_TOL  # the run trained: the tolerance is small against the change
    for m, r in zip(masters, reference.parameters()):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=0, atol=atol)
    for p, m in zip(half.parameters(), masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))  # the model holds the rounded masters


def test_a_group_added_later_gets_masters_as_the_first():
    """Fine-tuning that unfreezes a layer adds a parameter group: FP16_Optimizer had no
    add_param_group (and one added to the wrapped optimizer updated the fp16 parameters
    without masters). The added group's fp16 parameters train from fp32 masters."""
    half = _model()
    reference = copy.deepcopy(half).float()
    optimizer = FP16_Optimizer(torch.optim.SGD(half[0].parameters(), lr=0.05))
    ref_optimizer = torch.optim.SGD(reference[0].parameters(), lr=0.05)
    optimizer.add_param_group({"params": half[2].parameters(), "lr": 0.02})
    ref_optimizer.add_param_group({"params": reference[2].parameters(), "lr": 0.02})
    for step in range(5):
        ref_optimizer.zero_grad()
        _loss(reference, step, torch.float32).backward()
        ref_optimizer.step()
        _train_step(half, optimizer, step, torch.float16)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert [m.dtype for m in masters] == [torch.float32] * 4 and optimizer.param_groups[1]["lr"] == 0.02
    for m, r in zip(masters, [*reference[0].parameters(), *reference[2].parameters()]):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=0, atol=2e-3)
    for p, m in zip([*half[0].parameters(), *half[2].parameters()], masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
    with pytest.raises(OptimizerConfigError, match="some parameters are in an earlier group already"):
        optimizer.add_param_group({"params": [half[2].bias]})
    fp32 = torch.nn.Parameter(torch.ones(2))
    optimizer.add_param_group({"params": fp32})
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        optimizer.add_param_group({"params": [fp32]})  # the wrapped optimizer's own refusal
    assert len(optimizer._masters) == 4


def test_updates_below_fp16_resolution_accumulate_in_the_masters():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = FP16_Optimizer(torch.optim.SGD([w], lr=1e-4))
    plain_optimizer = torch.optim.SGD([plain], lr=1e-4)
    for _ in range(20):  # each step moves by 1e-4; fp16's spacing at 1.0 is ~9.8e-4
        optimizer.zero_grad()
        optimizer.backward(w.float().sum())
        optimizer.step()
        plain_optimizer.zero_grad()
        plain.float().sum().backward()
        plain_optimizer.step()
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.float16))  # fp16 alone never moves
    master = optimizer.param_groups[0]["params"][0]
    torch.testing.assert_close(master.detach(), torch.full((4,), 1.0 - 20 * 1e-4), rtol=0, atol=1e-6)
    assert torch.equal(w.detach(), master.detach().half())


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("inner", ["AdamW", "FusedAdam", "LAMB"])
def test_resume_from_state_dict_is_bit_identical(inner):
    def make(model):
        return FP16_Optimizer(INNER[inner](model.parameters()), dynamic_loss_scale=True,
                              dynamic_loss_args={"init_scale": 256.0, "growth_interval": 3}, clip_grad=1.0)

    uninterrupted, interrupted = _model(), _model()
    first, second = make(uninterrupted), make(interrupted)
    for step in range(12):
        for model, optimizer in ((uninterrupted, first), (interrupted, second)):
            _train_step(model, optimizer, step, torch.float16, inject_inf=step in (2, 4, 9))
        if step == 5:  # checkpoint to bytes; continue with a fresh model and fresh optimizers
            saved = _save_load({"model": interrupted.state_dict(), "optim": second.state_dict()})
            interrupted = _model()
            interrupted.load_state_dict(saved["model"])
            second = make(interrupted)
            second.load_state_dict(saved["optim"])
    assert first.loss_scale == second.loss_scale and first.loss_scale != 256.0
    for a, b in zip(uninterrupted.parameters(), interrupted.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(first.state_dict()["fp32_masters"], second.state_dict()["fp32_masters"]):
        assert torch.equal(a, b)


def test_static_scale_scales_the_loss_and_never_changes():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    optimizer = FP16_Optimizer(torch.optim.SGD([w], lr=0.5), static_loss_scale=128.0)
    optimizer.backward((w.float() * torch.tensor([1.0, 2.0, 3.0])).sum())
    assert torch.equal(w.grad, torch.tensor([128.0, 256.0, 384.0], dtype=torch.float16))
    optimizer.step()
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.0, -0.5], dtype=torch.float16))
    optimizer.zero_grad()
    optimizer.backward(w.float().sum())
    w.grad[0] = math.nan
    optimizer.step()  # skipped, scale kept
    assert optimizer.overflow and optimizer.loss_scale == 128.0
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.0, -0.5], dtype=torch.float16))


def test_apex_call_forms():
    """apex's argument names: scale_factor / scale_window, verbose, backward's update_master_grads,
    zero_grad's set_grads_to_None; dynamic_loss_args are ignored with a static scale, as apex."""
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    static = FP16_Optimizer(torch.optim.SGD([w], lr=0.1), static_loss_scale=8.0,
                            dynamic_loss_args={"init_scale": 1024.0}, verbose=False)
    static.backward(w.float().sum(), update_master_grads=False)
    assert torch.equal(w.grad, torch.full((2,), 8.0, dtype=torch.float16))
    static.zero_grad(set_grads_to_None=False)
    assert torch.equal(w.grad, torch.zeros(2, dtype=torch.float16))

    v = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    dynamic = FP16_Optimizer(torch.optim.SGD([v], lr=0.1), dynamic_loss_scale=True,
                             dynamic_loss_args={"init_scale": 64.0, "scale_factor": 4.0, "scale_window": 2})
    scales = []
    for overflow in (False, False, True, False):
        dynamic.zero_grad()
        dynamic.backward(v.float().sum())
        if overflow:
            v.grad[0] = math.inf
        dynamic.step()
        scales.append(dynamic.loss_scale)
    assert scales == [64.0, 256.0, 64.0, 64.0]
    dynamic.loss_scale = 8.0  # apex lets the scale be assigned
    dynamic.zero_grad()
    dynamic.backward(v.float().sum())
    assert torch.equal(v.grad, torch.full((2,), 8.0, dtype=torch.float16))
    static.loss_scale = 2.0
    static.zero_grad()
    static.backward(w.float().sum())
    static.step()
    assert torch.equal(w.grad, torch.full((2,), 2.0, dtype=torch.float16)) and static.loss_scale == 2.0
    with pytest.raises(OptimizerConfigError, match="loss_scale"):
        static.loss_scale = 0.0


def test_clip_grad_clips_the_unscaled_master_gradients():
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    optimizer = FP16_Optimizer(torch.optim.SGD([w], lr=1.0), dynamic_loss_scale=True, clip_grad=0.5,
                               dynamic_loss_args={"init_scale": 1024.0})
    optimizer.backward((w.float() * torch.tensor([3.0, 4.0])).sum())  # gradient (3, 4), norm 5
    optimizer.step()
    master = optimizer.param_groups[0]["params"][0]
    torch.testing.assert_close(master.detach(), torch.tensor([-0.3, -0.4]))


@pytest.mark.parametrize("kwargs, words", [
    ({"static_loss_scale": 0.0}, "static_loss_scale"), ({"clip_grad": -1.0}, "clip_grad"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"min_scale": 1}}, "dynamic_loss_args"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_factor": 1.0}}, "scale_factor"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"growth_factor": 0.5}}, "growth_factor"),
])
def test_bad_arguments_are_named(kwargs, words):
    model = _model()
    with pytest.raises(OptimizerConfigError, match=words) as info:
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert isinstance(info.value, OnnxTrainError)


def test_wrapping_something_else_or_a_stepped_optimizer_is_refused():
    model = _model()
    with pytest.raises(OptimizerConfigError, match="torch.optim.Optimizer"):
        FP16_Optimizer(model)
    stepped = torch.optim.AdamW(model.parameters(), lr=0.1)
    _loss(model, 0, torch.float16).backward()
    stepped.step()
    with pytest.raises(OptimizerConfigError, match="state"):
        FP16_Optimizer(stepped)


def test_an_ortmodule_fp16_model_trains_and_skips_like_the_fp32_reference():
    from onnxtrain.torch import DebugOptions, ORTModule

    half = _model()
    reference = copy.deepcopy(half).float()
    wrapped = ORTModule(half, DebugOptions(fallback=False))  # fp16 forward and backward in ONNX Runtime
    ref_optimizer = INNER["FusedAdam"](reference.parameters())
    optimizer = FP16_Optimizer(INNER["FusedAdam"](wrapped.parameters()), dynamic_loss_scale=True)
    for step in range(10):
        _train_step(wrapped, optimizer, step, torch.float16, inject_inf=step == 3)
        assert optimizer.overflow == (step == 3)
        if step != 3:  # the skipped step is skipped in the reference too
            ref_optimizer.zero_grad()
            _loss(reference, step, torch.float32).backward()
            ref_optimizer.step()
    assert optimizer.loss_scale == 2.0 ** 15
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    for m, r in zip(masters, reference.parameters()):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=0, atol=FP16_TOL)


def test_a_failing_wrapped_step_leaves_the_model_alone_and_the_next_step_runs():
    class FailsOnce(torch.optim.SGD):
        failed = False

        def step(self, closure=None):
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("boom")
            return super().step(closure)

    model = _model()
    optimizer = FP16_Optimizer(FailsOnce(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        _train_step(model, optimizer, 0, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _train_step(model, optimizer, 1, torch.float16)
    assert not optimizer.overflow and optimizer.loss_scale == 2.0 ** 16
    assert not all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_optimizers_that_keep_their_own_masters_are_returned_as_they_are():
    """Upstream's guide wraps what deepspeed.initialize returns: optimizer = FP16_Optimizer(optimizer).
    DeepSpeed's, apex amp's and Megatron-LM's mixed-precision optimizers keep fp32 masters and
    scale the loss themselves (upstream swapped fused kernels into them): returned unchanged."""
    deepspeed_like = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})()
    assert FP16_Optimizer(deepspeed_like) is deepspeed_like
    amp_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    amp_optimizer._amp_stash = object()  # what apex.amp.initialize marks its optimizers with
    assert FP16_Optimizer(amp_optimizer, dynamic_loss_scale=True) is amp_optimizer
    with pytest.raises(OptimizerConfigError, match="must be a torch.optim.Optimizer"):
        FP16_Optimizer(type("Elsewhere", (), {})())
