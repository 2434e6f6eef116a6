"""``torch.hstack``, ``column_stack`` and ``atleast_2d`` of several tensors train in ORTModule
(passes/sequence_map.py, torch/_export.py): the exporter writes them as a SequenceMap over the
tensors, which has no gradient rule, and an argument they return as it is was taken for one the
forward changed in place ("changes its tensor argument in place, and it requires grad")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402


class _Stacks(torch.nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.stack = stack
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, a, b, c):
        out = self.stack(a * self.scale, b, c)
        return tuple(o * 2 for o in out) if isinstance(out, tuple) else out.square()


@pytest.mark.parametrize("stack", [
    lambda a, b, c: torch.hstack([a, b, c.reshape(2, 2)]),
    lambda a, b, c: torch.column_stack([a, b, c[:2]]),
    lambda a, b, c: torch.atleast_2d(a, c),
    lambda a, b, c: torch.vstack([a.T, b.T]),
], ids=["hstack", "column_stack", "atleast_2d", "vstack"])
def test_stacks_of_several_tensors_train_like_eager(stack):
    torch.manual_seed(0)
    tensors = (torch.randn(2, 3), torch.randn(2, 2), torch.randn(4))
    results = []
    for module in (_Stacks(stack), ORTModule(_Stacks(stack), DebugOptions(fallback=False))):
        inputs = [t.clone().requires_grad_() for t in tensors]
        out = module(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        sum((o * torch.linspace(-1.0, 1.0, o.numel()).reshape(o.shape)).sum() for o in outs).backward()
        scale = module.scale if isinstance(module, _Stacks) else module.module.scale
        results.append([*(o.detach() for o in outs), *(t.grad for t in inputs), scale.grad])
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs)


def test_an_argument_changed_in_place_is_still_refused_when_it_requires_grad():
    class _Doubles(torch.nn.Module):
        def forward(self, a, b):
            a.mul_(2)
            return torch.hstack([a, b])

    a = torch.randn(2, 3).requires_grad_() * 1.0  # not a leaf: eager may write to it
    with pytest.raises(ExportError, match="changes its tensor argument 0 in place"):
        ORTModule(_Doubles(), DebugOptions(fallback=False))(a, torch.randn(2, 1))


def test_inference_tensors_which_have_no_version_counter():
    """Under ``torch.inference_mode`` (Lightning's validation) the call's tensors have no version
    counter to read: the graph decides which arguments the forward changed."""
    class _Stack(torch.nn.Module):
        def forward(self, a, b):
            return torch.hstack([a, b]).sum(1)

    a, b = torch.randn(2, 3), torch.randn(2, 1)
    wrapped = ORTModule(_Stack(), DebugOptions(fallback=False))
    with torch.inference_mode():
        torch.testing.assert_close(wrapped(a.clone(), b.clone()), _Stack()(a, b))

