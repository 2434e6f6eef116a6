"""A forward that changes its tensor arguments in place changes the caller's tensors under
ORTModule too, as in eager (training and inference, returned or not); one whose changed argument
requires grad runs in PyTorch, since autograd's history of that tensor cannot be rebuilt."""

import warnings

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import ORTModuleFallbackWarning  # noqa: E402

from ._parity import eager_and_wrapped  # noqa: E402


class Doubles(torch.nn.Module):
    """Doubles its input in place and clamps its token ids in place; returns neither."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(8, 4)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, ids):
        x.mul_(2.0)
        ids.clamp_(max=7)
        return self.linear(x + self.embedding(ids).sum(dim=1))


class ReturnsIt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.add_(1.0)
        return x, self.linear(x)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=generator), torch.randint(0, 12, (5, 3), generator=generator)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_the_callers_tensors_change_as_in_eager(grad):
    eager, wrapped = eager_and_wrapped(Doubles)
    for _ in range(2):  # the second call runs the built graphs again
        x, ids = _inputs()
        eager_x, eager_ids = x.clone(), ids.clone()
        with warnings.catch_warnings(), torch.set_grad_enabled(grad):
            warnings.simplefilter("error", ORTModuleFallbackWarning)
            out = wrapped(x, ids)
        expected = eager(eager_x, eager_ids)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x, eager_x)
        assert torch.equal(ids, eager_ids) and ids.max() == 7
        if grad:
            out.square().sum().backward()
    assert wrapped.fallback_reason is None and wrapped.export_count == 1


def test_gradients_see_the_changed_values():
    eager, wrapped = eager_and_wrapped(Doubles)
    x, ids = _inputs()
    grads = []
    for model in (wrapped, eager):
        model(x.clone(), ids.clone()).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_an_argument_changed_in_place_and_returned():
    eager, wrapped = eager_and_wrapped(ReturnsIt)
    x = torch.randn(5, 4)
    eager_x = x.clone()
    changed, out = wrapped(x)
    eager_changed, eager_out = eager(eager_x)
    torch.testing.assert_close(x, eager_x)
    torch.testing.assert_close(changed, eager_changed)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    eager_out.square().sum().backward()
    torch.testing.assert_close(wrapped.module.linear.weight.grad, eager.linear.weight.grad, rtol=1e-5, atol=1e-5)


def test_an_argument_that_requires_grad_changed_in_place_runs_in_pytorch():
    eager, wrapped = eager_and_wrapped(ReturnsIt)
    x = torch.randn(5, 4, requires_grad=True)
    h, eager_h = x * 1.0, x * 1.0  # non-leaf tensors that require grad: in-place changes are allowed
    with pytest.warns(ORTModuleFallbackWarning, match="changes its tensor argument 0 in place"):
        changed, out = wrapped(h)
    eager_changed, eager_out = eager(eager_h)
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(h, eager_h)


class _TwoInputs(torch.nn.Module):
    def __init__(self, writes: bool):
        super().__init__()
        self.a, self.b, self.writes = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), writes

    def forward(self, first, rest):
        if self.writes:
            first.mul_(2.0)
        return self.a(first).sum(0) * self.b(rest).sum(0)


@pytest.mark.parametrize("arguments", ["a view and its base", "one tensor twice", "two views"])
def test_arguments_that_share_memory(arguments):
    """model(x[:1], x): the export could not take inputs that alias each other (a ConversionError
    naming no argument, and the module ran in PyTorch for good). They run in ONNX Runtime, with
    gradients to the shared tensor; a forward that writes into one of them in place (which would
    show through the other in PyTorch) runs in PyTorch and says why."""
    split = {"a view and its base": lambda x: (x[:1], x), "one tensor twice": lambda x: (x, x),
             "two views": lambda x: (x[1:], x[:, :])}[arguments]
    eager, wrapped = eager_and_wrapped(lambda: _TwoInputs(writes=False))
    source = torch.randn(5, 4)
    x, eager_x = source.clone().requires_grad_(), source.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ORTModuleFallbackWarning)
        out = wrapped(*split(x))
    eager_out = eager(*split(eager_x))
    torch.testing.assert_close(out, eager_out)
    out.square().sum().backward()
    eager_out.square().sum().backward()
    torch.testing.assert_close(x.grad, eager_x.grad)
    torch.testing.assert_close(wrapped.module.a.weight.grad, eager.a.weight.grad)

    eager, wrapped = eager_and_wrapped(lambda: _TwoInputs(writes=True))
    x, eager_x = source.clone(), source.clone()
    with pytest.warns(ORTModuleFallbackWarning, match="changes its tensor argument 0 in place, and it shares memory"):
        out = wrapped(*split(x))
    torch.testing.assert_close(out, eager(*split(eager_x)))
    torch.testing.assert_close(x, eager_x)


class _SliceCopy(torch.nn.Module):
    """Writes a broadcast source into a slice of a new tensor (as ``torch.vander`` does)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        canvas = torch.ones(x.shape[0], 4)
        canvas.narrow(1, 1, 3).copy_((x * self.weight).unsqueeze(1))  # [5, 1] into [5, 3]
        return canvas * 2


class _Vandermonde(torch.nn.Module):
    def __init__(self, written_out=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.written_out = written_out

    def forward(self, x):
        scaled = x * self.weight
        if self.written_out:  # torch 2.13's own backward of torch.vander fails (an in-place copy)
            return torch.stack([scaled ** 3, scaled ** 2, scaled, torch.ones_like(scaled)], dim=1)
        return torch.vander(scaled, N=4)


def test_a_broadcast_copy_into_a_slice_trains_as_eager():
    """aten.copy broadcasts its source to the destination (the exporter's only cast it, and
    onnxruntime failed the run)."""
    from onnxtrain.torch import DebugOptions, ORTModule

    from ._parity import assert_steps_match
    eager, wrapped = eager_and_wrapped(_SliceCopy, debug_options=DebugOptions(fallback=False))
    assert_steps_match(eager, wrapped, torch.randn(5))
    wrapped = ORTModule(_Vandermonde(), debug_options=DebugOptions(fallback=False))
    assert_steps_match(_Vandermonde(written_out=True), wrapped, torch.randn(5))
