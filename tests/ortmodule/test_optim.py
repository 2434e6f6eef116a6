"""FusedAdam: each mode against its own reference, on the fused kernel and on foreach ops."""

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import OnnxTrainError  # noqa: E402
from onnxtrain.torch.optim import AdamWMode, FusedAdam, OptimizerConfigError  # noqa: E402

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
    assert set(optimizer.state[params[0]]) == {"exp_avg", "exp_avg_sq"}


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


def test_state_dict_round_trip_continues_identically():
    a, b = _params(), _params()
    first = FusedAdam(a, lr=0.02, weight_decay=0.01)
    for t in range(1, 4):
        for p, g in zip(a, _grads(t, a)):
            p.grad = g
        first.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    second = FusedAdam(b, lr=0.02, weight_decay=0.01)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    assert second.param_groups[0]["step"] == 3
    for t in range(4, 7):
        for p, q, g in zip(a, b, _grads(t, a)):
            p.grad, q.grad = g.clone(), g.clone()
        first.step()
        second.step()
    for p, q in zip(a, b):
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
