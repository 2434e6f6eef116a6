"""The CUDA paths of the PyTorch-side pieces: FusedAdam's and LAMB's updates of CUDA parameters
against the same optimizers on the CPU, FP16_Optimizer over CUDA half parameters,
``onnxtrain.torch.amp.GradScaler("cuda")`` against ``torch.amp.GradScaler("cuda")``, and
ORTModule given CUDA tensors (trained through onnxruntime's CUDA provider where the installed
onnxruntime has it; else a clear error, or PyTorch when fallback is on).

Skipped without a CUDA device (CI has none): run on a GPU machine with
``pytest tests/ortmodule/test_cuda.py``.
"""

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import onnxruntime as ort  # noqa: E402

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402
from onnxtrain.torch.amp import GradScaler  # noqa: E402
from onnxtrain.torch.optim import LAMB, AdamWMode, FP16_Optimizer, FusedAdam  # noqa: E402
from tests.torch_models import MLP  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 20
SHAPES = [(64, 33), (33,), (7, 3, 5)]


def _params(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]


def _trajectory(make_optimizer, device, dtype=torch.float32):
    """The parameters after STEPS updates with the same seeded gradients, on ``device``."""
    params = _params(device, dtype)
    optimizer = make_optimizer(params)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device, dtype)
        optimizer.step()
    return [p.detach().float().cpu() for p in params]


def _assert_same_trajectory(make_optimizer, rtol=2e-5, atol=2e-6):
    for on_cuda, on_cpu in zip(_trajectory(make_optimizer, "cuda"), _trajectory(make_optimizer, "cpu")):
        torch.testing.assert_close(on_cuda, on_cpu, rtol=rtol, atol=atol)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "foreach"])
@pytest.mark.parametrize("mode", list(AdamWMode))
def test_fused_adam_on_cuda_tracks_the_cpu_update(mode, fused):
    _assert_same_trajectory(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=mode, fused=fused))


def test_fused_adam_in_torch_mode_tracks_torch_adamw_on_cuda():
    ours = _trajectory(lambda ps: FusedAdam(ps, lr=1e-2, eps=1e-8, weight_decay=0.1,
                                            adam_w_mode=AdamWMode.ADAMW_TORCH), "cuda")
    theirs = _trajectory(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), "cuda")
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kwargs", [{}, {"adam_w_mode": False}, {"max_grad_norm": None}],
                         ids=["default", "l2", "no-clip"])
def test_lamb_on_cuda_tracks_the_cpu_update(kwargs):
    _assert_same_trajectory(lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01, **kwargs))


def test_fp16_optimizer_on_cuda_half_parameters_skips_overflow_and_tracks_fp32():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)).cuda()
    model = copy.deepcopy(reference).half()
    optimizer = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3), dynamic_loss_scale=True,
                               dynamic_loss_args={"init_scale": 1024.0})
    reference_optimizer = FusedAdam(reference.parameters(), lr=1e-3)
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=gen).cuda(), torch.randn(16, 5, generator=gen).cuda()
        optimizer.zero_grad()
        optimizer.backward((model(x.half()).float() - y).square().mean())
        if step == 3:  # an overflow: the step is skipped, the scale halves, nothing moves
            next(model.parameters()).grad.view(-1)[7] = math.inf
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            assert optimizer.overflow and optimizer.loss_scale == 512.0
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            continue
        optimizer.step()
        assert not optimizer.overflow
        reference_optimizer.zero_grad()
        (reference(x) - y).square().mean().backward()
        reference_optimizer.step()
    masters = optimizer.state_dict()["fp32_masters"]
    for master, p in zip(masters, reference.parameters()):
        assert master.device.type == "cuda" and master.dtype == torch.float32
        torch.testing.assert_close(master, p.detach(), rtol=0, atol=2e-3)


def _scaled_run(scaler, device="cuda"):
    """Seven steps with an injected inf and one overflowing loss; per step (skipped, scale)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 5).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    record = []
    for step in range(7):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 12, generator=gen).to(device), torch.randn(6, 5, generator=gen).to(device)
        loss = (model(x) - y).square().mean() * (1e36 if step == 5 else 1.0)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if step == 2:
            model.weight.grad.view(-1)[3] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        record.append((all(torch.equal(b, p) for b, p in zip(before, model.parameters())), scaler.get_scale()))
    return record


def test_grad_scaler_on_cuda_decides_and_scales_as_torch():
    ours = _scaled_run(GradScaler("cuda", growth_interval=2))
    theirs = _scaled_run(torch.amp.GradScaler("cuda", growth_interval=2))
    assert ours == theirs
    assert [skipped for skipped, _ in ours] == [s in (2, 5) for s in range(7)]


def test_ortmodule_on_cuda_tensors():
    torch.manual_seed(0)
    model = MLP().cuda()
    x = torch.randn(8, 12, device="cuda")
    expected = model(x)
    if "CUDAExecutionProvider" in ort.get_available_providers():
        wrapped = ORTModule(copy.deepcopy(model), DebugOptions(fallback=False))
        out = wrapped(x)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        out.square().sum().backward()
        expected.square().sum().backward()
        for ours, theirs in zip(wrapped.parameters(), model.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
        return
    # this onnxruntime has no CUDA provider: a clear error naming the device, or PyTorch on fallback
    with pytest.raises(OnnxTrainError, match="cuda"):
        ORTModule(copy.deepcopy(model), DebugOptions(fallback=False))(x)
    wrapped = ORTModule(copy.deepcopy(model))
    with pytest.warns(ORTModuleFallbackWarning, match="cuda"):
        out = wrapped(x)
    assert out.device.type == "cuda" and wrapped.fallback_reason is not None
    torch.testing.assert_close(out, expected)
