"""A forward that changes a trained parameter in place (under ``torch.no_grad()``) trains in ONNX
Runtime as in eager: ``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up, weight
clipping or normalization inside the forward. The parameter comes out changed, and the gradients
of the ops after the change are the parameter's (PyTorch's autograd sees one leaf); before, the
graph's stop-gradient left such a parameter without its gradient (the module ran in PyTorch), or
returned it as a tensor that did not require grad."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule, ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402


class MaxNormEmbedding(torch.nn.Module):
    def __init__(self, bag=False):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(12, 4, max_norm=1.0, mode="mean") if bag \
            else torch.nn.Embedding(12, 4, max_norm=1.0)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.embedding(ids)))


class ClippedInForward(torch.nn.Module):
    """Reads its weight (in a product that does not save it), halves and clips it in place, reads
    it again and returns it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        before = x @ self.weight
        with torch.no_grad():
            self.weight.mul_(0.5).clamp_(-0.4, 0.4)
        return before + torch.sin(h @ self.weight), self.weight


class ClampedThroughData(torch.nn.Module):
    """Weight clipping written with ``.data`` (a WGAN critic's, inside its forward)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        self.linear.weight.data.clamp_(-0.3, 0.3)
        return torch.tanh(self.linear(x))


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _train(model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    results = []
    for batch in batches:
        optimizer.zero_grad()
        outputs = _outputs(model(batch))
        sum(o.square().sum() for o in outputs).backward()
        results.append(([o.detach().clone() for o in outputs], [o.requires_grad for o in outputs],
                        {n: p.grad.clone() for n, p in model.named_parameters()},
                        {n: p.detach().clone() for n, p in model.named_parameters()}))
        optimizer.step()
    return results


@pytest.mark.parametrize("factory, batches", [
    (MaxNormEmbedding, [torch.tensor([[1, 2, 3], [3, 4, 1]]), torch.tensor([[5, 1, 5], [0, 2, 11]])] * 2),
    (lambda: MaxNormEmbedding(bag=True), [torch.tensor([[1, 2, 3], [3, 4, 1]]), torch.tensor([[5, 1, 5], [0, 2, 11]])]),
    (ClippedInForward, [torch.randn(5, 4) for _ in range(3)]),
    (ClampedThroughData, [torch.randn(5, 4) for _ in range(3)]),
], ids=["embedding_max_norm", "embedding_bag_max_norm", "clipped_in_forward", "clamped_through_data"])
def test_a_parameter_changed_in_the_forward_trains_as_in_eager(factory, batches):
    eager, wrapped = eager_and_wrapped(factory, debug_options=DebugOptions(fallback=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        got = _train(wrapped, batches)
    expected = _train(eager, batches)
    for (outputs, flags, grads, params), (e_outputs, e_flags, e_grads, e_params) in zip(got, expected):
        assert flags == e_flags
        for output, e_output in zip(outputs, e_outputs):
            torch.testing.assert_close(output, e_output, rtol=1e-4, atol=1e-5)
        for name in e_grads:  # the parameters as the forward left them, and their gradients
            torch.testing.assert_close(params[name], e_params[name], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(grads[name], e_grads[name], rtol=1e-4, atol=1e-5)


def test_an_inference_call_changes_the_parameter_too():
    torch.manual_seed(0)
    eager = MaxNormEmbedding()
    with torch.no_grad():
        eager.embedding.weight.mul_(3.0)  # every row beyond max_norm
    wrapped = ORTModule(MaxNormEmbedding(), DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids), eager(ids))
    torch.testing.assert_close(wrapped.module.embedding.weight, eager.embedding.weight)
    norms = wrapped.module.embedding.weight.norm(dim=1)
    assert torch.all(norms[[1, 2, 3]] <= 1.0 + 1e-6) and torch.all(norms[[0, 4]] > 1.0)


class SetsWithoutReading(torch.nn.Module):
    """Sets a trained parameter it never reads (a running mean kept as a parameter)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.center = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        y = self.linear(x)
        with torch.no_grad():
            self.center.copy_(y.mean(0))
        return y


def test_a_parameter_set_but_not_read_comes_back_without_gradient():
    eager, wrapped = eager_and_wrapped(SetsWithoutReading, debug_options=DebugOptions(fallback=False))
    x = torch.randn(5, 4)
    for model in (eager, wrapped):
        model(x).square().sum().backward()
    torch.testing.assert_close(wrapped.module.center, eager.center)
    assert wrapped.module.center.grad is None and eager.center.grad is None
    torch.testing.assert_close(wrapped.module.linear.weight.grad, eager.linear.weight.grad)
