"""``torch.slice_scatter`` (what ``y[..., a:b] = f(y[..., a:b])`` on a traced tensor captures
as) exports as a Concat of the parts before and after and the new slice (torch/_translations.py
``slice_scatter``), with eager's outputs and gradients; the exporter's ScatterND, with both
tensors transposed, is gone."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import assert_steps_match, exported_ops  # noqa: E402


class _ScaledSlice(torch.nn.Module):
    """Scales ``y[..., start:end]`` along ``dim`` by a weight."""

    def __init__(self, dim, start, end, width):
        super().__init__()
        self.dim, self.start, self.end = dim, start, end
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.mix = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = self.mix(x)
        index = [slice(None)] * y.dim()
        index[self.dim] = slice(self.start, self.end)
        scaled = y[tuple(index)] * self.weight.reshape([-1] + [1] * (y.dim() - 1 - self.dim % y.dim()))
        return torch.slice_scatter(y, scaled, self.dim, self.start, self.end)


@pytest.mark.parametrize(("dim", "start", "end", "width"), [
    (1, 1, 3, 2),  # inside
    (1, 0, 2, 2),  # from the start: no part before
    (1, -2, None, 2),  # to the end, counted from it: no part after
    (-1, 2, 100, 4),  # an end past the size, clamped
    (2, 1, 4, 3),  # the last axis by its positive number
])
def test_a_slice_scatter_is_a_concat_that_trains_as_eager(dim, start, end, width):
    _is_a_concat_that_trains_as_eager(lambda: _ScaledSlice(dim, start, end, width))


def _is_a_concat_that_trains_as_eager(factory):
    torch.manual_seed(0)
    eager = factory()
    wrapped = ORTModule(factory(), debug_options=DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    x = torch.randn(3, 5, 6)
    assert_steps_match(eager, wrapped, x)
    ops = exported_ops(eager, x)
    assert "ScatterND" not in ops and "Concat" in ops


class _AssignedSlice(torch.nn.Module):
    """``y[:, 1:3] = y[:, 1:3] * 2`` on a Linear's output of a 3-D input, which PyTorch makes a
    view (of the 2-D product): its ``grad_fn``, read after the write, is a replayed view."""

    def __init__(self, in_place):
        super().__init__()
        self.in_place = in_place
        self.mix = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = self.mix(x)
        if self.in_place:
            y[:, 1:3].mul_(2.0)
        else:
            y[:, 1:3] = y[:, 1:3] * 2.0
        return y


@pytest.mark.parametrize("in_place", [False, True])
def test_an_assignment_into_a_view_of_an_activation_trains_as_eager(in_place):
    # the export failed: "a fake tensor in the exported program constant's list"
    _is_a_concat_that_trains_as_eager(lambda: _AssignedSlice(in_place))
