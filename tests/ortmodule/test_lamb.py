"""LAMB against a plain per-tensor reference written from the paper / apex FusedLAMB formulas."""

import io
import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch.optim import LAMB, OptimizerConfigError  # noqa: E402

STEPS = 50
RTOL = 1e-6  # relative to each tensor's largest magnitude (see _assert_tracks)
SHAPES = [(7, 5), (5,), (3, 2, 4), (6,)]


def _params(dtype=torch.float32, zero_last=False):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in SHAPES]
    if zero_last:  # ||p|| = 0 at the first step: trust ratio 1
        params[-1].data.zero_()
    return params


def _grads(step, params, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return [scale * torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _groups(params, **second):
    """Two groups: the first two tensors with lr 0.01 / decay 0.05, the others as ``second`` says."""
    return [{"params": params[:2], "lr": 0.01, "weight_decay": 0.05},
            {"params": params[2:], "lr": 0.004, "weight_decay": 0.2, **second}]


class ReferenceLAMB:
    """One tensor at a time, straight from the formulas (no multi-tensor op, no shared code)."""

    def __init__(self, params, groups, betas=(0.9, 0.999), eps=1e-6, bias_correction=True, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=True):
        self.params = [p.detach().clone() for p in params]
        self.groups = groups  # list of (indices, lr, weight_decay, ratio_min, ratio_max)
        self.betas, self.eps, self.bias_correction = betas, eps, bias_correction
        self.adam_w_mode, self.grad_averaging = adam_w_mode, grad_averaging
        self.max_grad_norm, self.use_nvlamb = max_grad_norm, use_nvlamb
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        global_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        divisor = 1.0
        if self.max_grad_norm is not None and global_norm > self.max_grad_norm:
            divisor = global_norm / self.max_grad_norm
        c1 = 1 - b1 ** self.t if self.bias_correction else 1.0
        c2 = 1 - b2 ** self.t if self.bias_correction else 1.0
        for indices, lr, wd, ratio_min, ratio_max in self.groups:
            for i in indices:
                p = self.params[i]
                g = grads[i] / divisor
                if not self.adam_w_mode:
                    g = g + wd * p
                self.m[i] = b1 * self.m[i] + ((1 - b1) if self.grad_averaging else 1.0) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                u = (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + self.eps)
                if self.adam_w_mode:
                    u = u + wd * p
                w_norm, u_norm = p.norm().item(), u.norm().item()
                ratio = 1.0
                if (self.use_nvlamb or wd != 0) and w_norm > 0 and u_norm > 0:
                    ratio = min(max(w_norm / u_norm, ratio_min), ratio_max)
                self.params[i] = p - lr * ratio * u


def _assert_tracks(actual, expected, rtol=RTOL, what=""):
    for i, (a, e) in enumerate(zip(actual, expected)):
        scale = e.abs().max().item()
        torch.testing.assert_close(a.detach(), e, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what} tensor {i}: {m}")


def _run(kwargs, ref_kwargs=None, second=None, grad_scale=1.0, zero_last=False, steps=STEPS):
    second = second or {}
    params = _params(zero_last=zero_last)
    optimizer = LAMB(_groups(params, **second), **kwargs)
    g2 = {"weight_decay": 0.2, "ratio_min": float("-inf"), "ratio_max": float("inf"), **second}
    ref_groups = [([0, 1], 0.01, 0.05, float("-inf"), float("inf")),
                  ([2, 3], 0.004, g2["weight_decay"], g2["ratio_min"], g2["ratio_max"])]
    reference = ReferenceLAMB(params, ref_groups, **(ref_kwargs if ref_kwargs is not None else kwargs))
    _step_both(optimizer, reference, params, range(1, steps + 1), grad_scale)
    return params, reference, optimizer


def _step_both(optimizer, reference, params, steps, grad_scale=1.0):
    """Step ``optimizer`` and ``reference`` with the same gradients for each step in ``steps``."""
    for t in steps:
        grads = _grads(t, params, grad_scale)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        reference.step(grads)


@pytest.mark.parametrize("kwargs", [
    {},  # decoupled decay, bias correction, clipping at 1.0 (the gradients' norm is ~5: it clips)
    {"max_grad_norm": None},
    {"max_grad_norm": 100.0},  # above the norm: no clipping
    {"adam_w_mode": False},
    {"bias_correction": False, "grad_averaging": False},
    {"betas": (0.8, 0.95), "eps": 1e-4},
], ids=["default", "no-clip", "clip-inactive", "l2", "no-bias-correction-no-averaging", "betas-eps"])
def test_lamb_tracks_the_reference_over_50_float32_steps(kwargs):
    params, reference, optimizer = _run(kwargs)
    _assert_tracks(params, reference.params)
    assert [g["step"] for g in optimizer.param_groups] == [STEPS, STEPS]


def test_a_step_without_gradients_counts_as_apex_counts_it():
    # apex's FusedLAMB advances every group's step on every call: the bias correction of the
    # later steps (and a ZeRO rank whose parameters got no gradient) depends on it
    params = _params()
    optimizer = LAMB(_groups(params), max_grad_norm=None)
    ref_groups = [([0, 1], 0.01, 0.05, float("-inf"), float("inf")), ([2, 3], 0.004, 0.2, float("-inf"), float("inf"))]
    reference = ReferenceLAMB(params, ref_groups, max_grad_norm=None)
    optimizer.step()  # no parameter has a gradient yet
    reference.t += 1
    _step_both(optimizer, reference, params, range(1, 4))
    assert [g["step"] for g in optimizer.param_groups] == [4, 4]
    _assert_tracks(params, reference.params)


def test_trust_ratio_bounds_and_groups_without_decay():
    # second group: no decay, ratio clamped to [0.5, 2]; use_nvlamb=False: that group is plain Adam
    second = {"weight_decay": 0.0, "ratio_min": 0.5, "ratio_max": 2.0}
    for nvlamb in (True, False):
        params, reference, _ = _run({"use_nvlamb": nvlamb}, second=second)
        _assert_tracks(params, reference.params, what=f"use_nvlamb={nvlamb}")
    # one step where the bound bites
    p = torch.nn.Parameter(torch.full((4,), 10.0))
    p.grad = torch.ones(4)
    LAMB([p], lr=0.1, ratio_max=2.0, max_grad_norm=None).step()
    # u = m_hat / (sqrt(v_hat) + eps) = 1 / (1 + 1e-6) per element; ||p|| / ||u|| ~= 10 -> clamped to 2
    torch.testing.assert_close(p.detach(), torch.full((4,), 10.0 - 0.1 * 2.0 / (1 + 1e-6)))


def test_zero_parameter_norm_gives_ratio_one():
    params, reference, _ = _run({}, zero_last=True, steps=3)
    _assert_tracks(params, reference.params)
    # step 1 moved the zero tensor by exactly lr * u (ratio 1): compare with a one-step run
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.5, -2.0, 0.0])
    LAMB([p], lr=0.1, max_grad_norm=None).step()
    torch.testing.assert_close(p.detach(), -0.1 * torch.tensor([1 / (1 + 2e-6), -1 / (1 + 0.5e-6), 0.0]))


def test_global_clipping_uses_all_groups_and_leaves_gradients_alone():
    params = _params()
    grads = _grads(1, params, scale=10.0)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    LAMB(_groups(params), max_grad_norm=1.0).step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    # a LAMB step is invariant to a uniform gradient scale once clipping is active
    a, b = _params(), _params()
    for scale, ps in ((10.0, a), (1000.0, b)):
        opt = LAMB(_groups(ps), max_grad_norm=1.0)
        for t in range(1, 4):
            for p, g in zip(ps, _grads(t, ps, scale)):
                p.grad = g
            opt.step()
    _assert_tracks(a, b)


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_resume_from_state_dict_is_bit_identical():
    kwargs = {"max_grad_norm": 1.0, "ratio_min": 0.01, "ratio_max": 10.0}
    uninterrupted = _params()
    first = LAMB(_groups(uninterrupted), **kwargs)
    interrupted = _params()
    opt = LAMB(_groups(interrupted), **kwargs)
    for t in range(1, 11):
        for ps, o in ((uninterrupted, first), (interrupted, opt)):
            for p, g in zip(ps, _grads(t, ps)):
                p.grad = g
            o.step()
        if t == 5:  # checkpoint, then continue in a fresh optimizer over fresh parameter objects
            saved = _save_load({"params": [p.detach() for p in interrupted], "optim": opt.state_dict()})
            interrupted = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
            opt = LAMB(_groups(interrupted), **kwargs)
            opt.load_state_dict(saved["optim"])
    for a, b in zip(uninterrupted, interrupted):
        assert torch.equal(a, b)
    assert [g["step"] for g in opt.param_groups] == [10, 10]


def test_lamb_trains_a_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x = torch.randn(64, 8)
    y = x[:, :3].argmax(dim=1)
    optimizer = LAMB(model.parameters(), lr=0.02, weight_decay=0.01)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("kwargs, words", [
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"ratio_min": 2.0, "ratio_max": 1.0}, "ratio_min"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(OptimizerConfigError, match=words) as info:
        LAMB(_params(), **kwargs)
    assert isinstance(info.value, OnnxTrainError)


def test_sparse_gradient_is_refused_before_any_update():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.ones(2))
    before = dense.detach().clone()
    optimizer = LAMB([{"params": [dense]}, {"params": [embedding.weight]}])
    embedding(torch.tensor([1, 2])).sum().backward()
    dense.grad = torch.ones(2)
    with pytest.raises(OptimizerConfigError, match="sparse"):
        optimizer.step()
    assert torch.equal(dense.detach(), before) and "step" not in optimizer.param_groups[0]


def test_fp16_parameters_with_norms_beyond_fp16_range():
    # ||g|| = 300 * sqrt(1e5) ~ 9.5e4 > 65504: the norms must not overflow to inf
    p = torch.nn.Parameter(torch.full((100_000,), 2.0, dtype=torch.float16))
    p.grad = torch.full((100_000,), 300.0, dtype=torch.float16)
    LAMB([p], lr=0.01, max_grad_norm=1.0).step()
    # u is uniform, so lr * r * u = lr * ||p|| / ||u|| * u = lr * p: p = 2 - 0.01 * 2 (and finite)
    torch.testing.assert_close(p.detach().float(), torch.full((100_000,), 1.98), rtol=1e-3, atol=0)


@pytest.mark.parametrize(("scalar", "others"), [(torch.bfloat16, None), (torch.float16, torch.float32),
                                                (torch.float32, torch.float64)])
def test_a_clipped_scalar_parameter_keeps_its_type(scalar, others):
    """A 0-dim gradient divided by the 0-dim clipping divisor took the divisor's type (fp32, or
    fp64 beside fp64 gradients), and the moment update refused it ("expected dtype BFloat16")."""
    params = [torch.nn.Parameter(torch.tensor(0.5, dtype=scalar))]
    params[0].grad = torch.tensor(40.0, dtype=scalar)  # above max_grad_norm: clipped
    if others is not None:
        params.append(torch.nn.Parameter(torch.ones(3, dtype=others)))
        params[1].grad = torch.full((3,), 30.0, dtype=others)
    LAMB(params, lr=0.01, max_grad_norm=1.0).step()
    assert params[0].dtype == scalar and torch.isfinite(params[0]).all() and params[0].item() != 0.5


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_float64_parameters_track_the_reference(max_grad_norm):
    params = _params(torch.float64)
    optimizer = LAMB(params, lr=0.01, weight_decay=0.1, max_grad_norm=max_grad_norm)
    reference = ReferenceLAMB(params, [([0, 1, 2, 3], 0.01, 0.1, float("-inf"), float("inf"))],
                              max_grad_norm=max_grad_norm)
    _step_both(optimizer, reference, params, range(1, 11))
    _assert_tracks(params, reference.params, rtol=1e-12)


def test_a_nan_gradient_spoils_its_own_tensor_only_as_in_apex():
    """apex clips by ``norm > max ? norm / max : 1``: a NaN global norm clips nothing."""
    for max_grad_norm in (1.0, None):
        params = _params()
        before = [p.detach().clone() for p in params]
        grads = _grads(1, params)
        grads[0][0, 0] = float("nan")
        for p, g in zip(params, grads):
            p.grad = g
        LAMB(params, lr=0.01, weight_decay=0.1, max_grad_norm=max_grad_norm).step()
        assert params[0].isnan().all()
        reference = ReferenceLAMB(before[1:], [([0, 1, 2], 0.01, 0.1, float("-inf"), float("inf"))],
                                  max_grad_norm=None)
        reference.step(grads[1:])
        _assert_tracks(params[1:], reference.params)


def test_apexs_positional_arguments_and_group_step_counts():
    params = _params()
    # apex FusedLAMB(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, ...)
    optimizer = LAMB([{"params": params[:2]}, {"params": params[2:]}], 1e-3, True, (0.9, 0.999), 1e-6, 0.01,
                     False, True)
    assert optimizer.adam_w_mode
    with pytest.raises(OptimizerConfigError, match="AMSGrad"):
        LAMB(params, amsgrad=True)
    # as apex: every group counts every step, also one whose parameters had no gradient
    for t in range(1, 4):
        for p, g in zip(params[:2], _grads(t, params[:2])):
            p.grad = g
        optimizer.step()
    assert [g["step"] for g in optimizer.param_groups] == [3, 3]
