"""FusedAdam: each mode against its own reference, on the fused kernel and on foreach ops."""

import copy
import io
import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch.optim import LAMB, AdamWMode, FusedAdam, OptimizerConfigError  # noqa: E402

STEPS = 6


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in [(7, 5), (5,), (3, 2, 4)]]


def _grads(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _reference_step(mode, params, grads, state, t, lr, betas, eps, wd, bias_correction):
    """Plain per-element formulas, one parameter at a time (independent of the optimizer's algebra)."""
    b1, b2 = betas
    bc1 = 1 - b1 ** t if bias_correction else 1.0
    bc2 = 1 - b2 ** t if bias_correction else 1.0
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        if mode == AdamWMode.ADAM_L2_REGULARIZATION:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        state[i] = (m, v)
        if mode == AdamWMode.ADAMW_TRANSFORMERS:
            step_size = lr * math.sqrt(bc2) / bc1
            new = p - step_size * m / (v.sqrt() + eps)
            new = new - lr * wd * new
        else:
            if mode == AdamWMode.ADAMW_TORCH:
                p = p * (1 - lr * wd)
            new = p - lr * (m / bc1) / ((v / bc2).sqrt() + eps)
        params[i] = new


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("mode", list(AdamWMode))
def test_each_mode_matches_its_reference(mode, bias_correction, fused):
    params = _params(torch.float64)
    reference = [p.detach().clone() for p in params]
    lr, betas, eps, wd = 0.05, (0.8, 0.95), 1e-3, 0.1
    optimizer = FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, adam_w_mode=mode,
                          bias_correction=bias_correction, fused=fused)
    state = {}
    for t in range(1, STEPS + 1):
        grads = _grads(t, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        _reference_step(mode, reference, grads, state, t, lr, betas, eps, wd, bias_correction)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r, rtol=1e-9, atol=1e-11)
    assert optimizer.param_groups[0]["step"] == STEPS


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode, torch_cls", [(AdamWMode.ADAMW_TORCH, torch.optim.AdamW),
                                             (AdamWMode.ADAM_L2_REGULARIZATION, torch.optim.Adam)])
def test_torch_modes_match_torch_optimizers_in_float32(mode, torch_cls, fused):
    ours, theirs = _params(), _params()
    groups = lambda ps: [{"params": ps[:2], "lr": 0.01}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.0}]
    optimizer = FusedAdam(groups(ours), eps=1e-8, weight_decay=0.05, adam_w_mode=mode, fused=fused)
    expected = torch_cls(groups(theirs), eps=1e-8, weight_decay=0.05)
    for t in range(1, STEPS + 1):
        for a, b, g in zip(ours, theirs, _grads(t, ours)):
            a.grad, b.grad = g.clone(), g.clone()
        optimizer.step()
        expected.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode, torch_cls", [(AdamWMode.ADAMW_TORCH, torch.optim.AdamW),
                                             (AdamWMode.ADAM_L2_REGULARIZATION, torch.optim.Adam)])
def test_a_parameter_without_gradient_at_some_steps_is_corrected_for_its_own_count(mode, torch_cls, fused):
    """Bias correction counts each parameter's own updates, as PyTorch's (an unused branch or
    expert skips steps); counting the group's steps for every parameter, as upstream did, moved
    the skipping parameter 0.07 away from torch.optim.AdamW's in 6 steps."""
    ours, theirs = _params(), _params()
    optimizer = FusedAdam(ours, lr=0.1, eps=1e-8, weight_decay=0.05, adam_w_mode=mode, fused=fused)
    expected = torch_cls(theirs, lr=0.1, eps=1e-8, weight_decay=0.05)
    for t in range(1, STEPS + 1):
        for i, (a, b, g) in enumerate(zip(ours, theirs, _grads(t, ours))):
            skips = i == 1 and t % 2 == 1  # parameter 1 has a gradient at even steps only
            a.grad, b.grad = (None, None) if skips else (g.clone(), g.clone())
        optimizer.step()
        expected.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    assert [int(optimizer.state[p]["step"]) for p in ours] == [STEPS, STEPS // 2, STEPS]
    # PyTorch's state dict loads: its per-parameter counts are ours
    copies = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    resumed = FusedAdam(copies, lr=0.1, adam_w_mode=mode)
    resumed.load_state_dict(expected.state_dict())
    assert [int(resumed.state[p]["step"]) for p in copies] == [STEPS, STEPS // 2, STEPS]


def test_a_state_dict_that_counts_steps_per_group_only_continues_from_the_groups_count():
    """Upstream's FusedAdam kept no per-parameter count: such a state resumes at the group's."""
    params = _params()
    optimizer = FusedAdam(params, lr=0.1)
    for t in range(1, 4):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g
        optimizer.step()
    saved = _save_load(optimizer.state_dict())
    for state in saved["state"].values():
        del state["step"]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(twin, lr=0.1)
    resumed.load_state_dict(saved)
    for group_params, opt in ((params, optimizer), (twin, resumed)):
        for p, g in zip(group_params, _grads(4, group_params)):
            p.grad = g
        opt.step()
    assert [int(resumed.state[p]["step"]) for p in twin] == [4, 4, 4]
    for p, q in zip(params, twin):
        assert torch.equal(p, q)


def test_fused_and_foreach_agree_on_a_model_and_train_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    twin = copy.deepcopy(model)
    x = torch.randn(64, 8)
    y = x[:, :3].argmax(dim=1)  # a learnable rule
    optimizers = [FusedAdam(model.parameters(), lr=0.01, weight_decay=0.01, fused=True),
                  FusedAdam(twin.parameters(), lr=0.01, weight_decay=0.01, fused=False)]
    losses = []
    for _ in range(40):
        for net, optimizer in zip((model, twin), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_parameters_without_gradient_keep_value_and_state():
    params = _params()
    frozen = params[1].detach().clone()
    optimizer = FusedAdam(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    params[2].grad = torch.ones_like(params[2])
    optimizer.step()
    assert torch.equal(params[1].detach(), frozen)
    assert params[1] not in optimizer.state
    assert set(optimizer.state[params[0]]) == {"exp_avg", "exp_avg_sq", "step"}


def test_zero_grad_follows_set_grad_none():
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    FusedAdam(params, set_grad_none=True).zero_grad(set_to_none=False)
    assert all(p.grad is None for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    FusedAdam(params, set_grad_none=False).zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    # the call's default too (torch.optim's is set_to_none=True): upstream zero-filled
    for optimizer_class in (FusedAdam, LAMB):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer_class(params, set_grad_none=False).zero_grad()
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode", list(AdamWMode))
def test_resume_from_saved_state_dict_is_bit_identical(mode, fused):
    groups = lambda ps: [{"params": ps[:2], "lr": 0.02}, {"params": ps[2:], "lr": 0.005, "weight_decay": 0.1}]
    kwargs = dict(weight_decay=0.01, adam_w_mode=mode, fused=fused)
    uninterrupted, interrupted = _params(), _params()
    first = FusedAdam(groups(uninterrupted), **kwargs)
    second = FusedAdam(groups(interrupted), **kwargs)
    for t in range(1, 9):
        for ps, optimizer in ((uninterrupted, first), (interrupted, second)):
            for p, g in zip(ps, _grads(t, ps)):
                p.grad = g
            optimizer.step()
        if t == 4:  # checkpoint to bytes; continue in a fresh optimizer over fresh parameter objects
            saved = _save_load({"params": [p.detach() for p in interrupted], "optim": second.state_dict()})
            interrupted = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
            second = FusedAdam(groups(interrupted), **kwargs)
            second.load_state_dict(saved["optim"])
            assert [g["step"] for g in second.param_groups] == [4, 4]
    for p, q in zip(uninterrupted, interrupted):
        assert torch.equal(p, q)


def test_closure_loss_is_returned():
    w = torch.nn.Parameter(torch.tensor([2.0]))
    optimizer = FusedAdam([w], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 4.0
    assert w.item() < 2.0


@pytest.mark.parametrize("kwargs, words", [
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"adam_w_mode": 7}, "adam_w_mode"),
])
def test_bad_hyperparameters_are_named(kwargs, words):
    with pytest.raises(OptimizerConfigError, match=words) as info:
        FusedAdam(_params(), **kwargs)
    assert isinstance(info.value, OnnxTrainError)


@pytest.mark.parametrize("grouped", [False, True])
def test_sparse_gradient_is_refused_and_nothing_changes(grouped):
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.ones(2))
    before = [embedding.weight.detach().clone(), dense.detach().clone()]
    # grouped: the dense parameter's group comes first and must not be updated either
    optimizer = FusedAdam([{"params": [dense]}, {"params": [embedding.weight]}] if grouped
                          else [dense, embedding.weight])
    embedding(torch.tensor([1, 2])).sum().backward()
    dense.grad = torch.ones(2)
    with pytest.raises(OptimizerConfigError, match="sparse"):
        optimizer.step()
    assert torch.equal(embedding.weight.detach(), before[0]) and torch.equal(dense.detach(), before[1])
    assert "step" not in optimizer.param_groups[0]


@pytest.mark.parametrize("fused", [True, False])
def test_transformers_decay_of_exactly_one_zeroes_the_parameter(fused):
    # lr * weight_decay == 1: the update is (p - step) * 0; the fused kernel cannot express it
    params = _params()
    optimizer = FusedAdam(params, lr=0.5, weight_decay=2.0, fused=fused)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(torch.equal(p.detach(), torch.zeros_like(p)) for p in params)


# -- 50 float32 steps, two parameter groups with weight decay ----------------------------------
LONG_STEPS = 50
LONG_RTOL = 1e-6  # relative to each tensor's largest magnitude
LONG_GROUPS = [([0, 1], 0.01, 0.05), ([2], 0.003, 0.2)]  # (indices, lr, weight_decay)


def _long_groups(params):
    return [{"params": [params[i] for i in idx], "lr": lr, "weight_decay": wd} for idx, lr, wd in LONG_GROUPS]


def _assert_tracks(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        scale = e.detach().abs().max().item()
        torch.testing.assert_close(a.detach(), e.detach(), rtol=LONG_RTOL, atol=LONG_RTOL * scale,
                                   msg=lambda m: f"{what}, tensor {i}: {m}")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode", list(AdamWMode))
def test_each_mode_tracks_its_reference_over_50_float32_steps(mode, fused):
    params = _params()
    reference = [p.detach().clone() for p in params]
    betas, eps = (0.9, 0.99), 1e-8
    optimizer = FusedAdam(_long_groups(params), betas=betas, eps=eps, adam_w_mode=mode, fused=fused)
    states = [{} for _ in LONG_GROUPS]
    for t in range(1, LONG_STEPS + 1):
        grads = _grads(t, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        for (idx, lr, wd), state in zip(LONG_GROUPS, states):
            sub = [reference[i] for i in idx]
            _reference_step(mode, sub, [grads[i] for i in idx], state, t, lr, betas, eps, wd, True)
            for i, r in zip(idx, sub):
                reference[i] = r
    _assert_tracks(params, reference, f"{mode.name} vs its reference")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("torch_fused", [True, False])
@pytest.mark.parametrize("mode, torch_cls", [(AdamWMode.ADAMW_TORCH, torch.optim.AdamW),
                                             (AdamWMode.ADAM_L2_REGULARIZATION, torch.optim.Adam)])
def test_torch_modes_track_torch_over_50_float32_steps(mode, torch_cls, torch_fused, fused):
    ours, theirs = _params(), _params()
    optimizer = FusedAdam(_long_groups(ours), eps=1e-8, adam_w_mode=mode, fused=fused)
    expected = torch_cls(_long_groups(theirs), eps=1e-8, **({"fused": True} if torch_fused else {"foreach": True}))
    for t in range(1, LONG_STEPS + 1):
        for a, b, g in zip(ours, theirs, _grads(t, ours)):
            a.grad, b.grad = g.clone(), g.clone()
        optimizer.step()
        expected.step()
    _assert_tracks(ours, theirs, f"{mode.name} vs {torch_cls.__name__}")


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_a_gradient_laid_out_unlike_its_parameter_gets_the_right_update(layout):
    """PyTorch's fused CPU kernel walks parameter, gradient and moments as one layout (AdamW(fused=True)
    is 5e-2 off here); such parameters take the foreach ops."""
    gen = torch.Generator().manual_seed(0)
    if layout == "transposed":
        value = torch.randn(6, 4, generator=gen).t()
    else:
        value = torch.randn(2, 3, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    ours, theirs = torch.nn.Parameter(value.clone()), torch.nn.Parameter(value.clone())
    optimizers = [FusedAdam([ours], lr=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01, eps=1e-8),
                  torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.01, foreach=False)]
    for _ in range(3):
        grad = torch.randn(value.shape, generator=gen).contiguous()  # a hand-set, contiguous .grad
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_torch_adamw_state_dict_resumes_as_torch_adamw_would():
    params = _params()
    reference = torch.optim.AdamW(params, lr=0.01, eps=1e-8, weight_decay=0.1)
    for t in range(1, 4):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g
        reference.step()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = FusedAdam(ours, adam_w_mode=AdamWMode.ADAMW_TORCH)
    # (a copy: a loaded state shares the saved tensors, which the reference's next steps change)
    optimizer.load_state_dict(copy.deepcopy(reference.state_dict()))  # its groups have no bias_correction
    assert optimizer.param_groups[0]["bias_correction"] is True and optimizer.param_groups[0]["lr"] == 0.01
    for t in range(4, 6):
        for p, q, g in zip(params, ours, _grads(t, params)):
            p.grad, q.grad = g, g.clone()
        reference.step()
        optimizer.step()
    for p, q in zip(params, ours):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    amsgrad = torch.optim.Adam(_params(), amsgrad=True).state_dict()
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(OptimizerConfigError, match=r"state dict's parameter group 0 asks for \['amsgrad'\]"):
        optimizer.load_state_dict(amsgrad)
    assert optimizer.state_dict()["param_groups"] == before["param_groups"]


@pytest.mark.parametrize("optimizer_class", [FusedAdam, LAMB])
@pytest.mark.parametrize("option", ["maximize", "amsgrad"])
def test_a_group_asking_for_an_option_not_implemented_is_refused(optimizer_class, option):
    # given in a group dict (not as an argument) it was accepted and silently ignored
    params = _params()
    with pytest.raises(OptimizerConfigError, match=rf"parameter group 0 asks for \['{option}'\]"):
        optimizer_class([{"params": params[:1], option: True}], lr=1e-3)
    optimizer = optimizer_class([{"params": params[:1]}], lr=1e-3)
    with pytest.raises(OptimizerConfigError, match=option):
        optimizer.add_param_group({"params": params[1:], option: True})


@pytest.mark.parametrize("optimizer_class", [FusedAdam, LAMB])
def test_a_learning_rate_from_a_numpy_scalar_or_tensor_trains_as_the_number(optimizer_class):
    # a LambdaLR returning np.float32 (or a tensor lr) was refused in the middle of training
    np = pytest.importorskip("numpy")
    results = []
    for lr in (0.01, np.float32(0.01), torch.tensor(0.01)):
        params = _params()
        optimizer = optimizer_class(params, lr=lr)
        for step in range(3):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
        results.append([p.detach().clone() for p in params])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
