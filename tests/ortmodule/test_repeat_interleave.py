"""``repeat_interleave`` with a tensor of repeats repeats along the given dim
(torch/_translations.py): torchlib's repeated along the first axis whatever ``dim`` was, and
failed on ``output_size``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

from ._parity import assert_steps_match  # noqa: E402


class _Repeat(torch.nn.Module):
    def __init__(self, dim, output_size=None):
        super().__init__()
        self.dim, self.output_size = dim, output_size
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        repeats = torch.tensor([1, 0, 3])
        axis = self.dim % x.dim() if self.dim is not None else x.dim() - 1  # the axis of length 3
        shape = [3 if d == axis else 1 for d in range(x.dim())]
        scaled = x * self.weight.reshape(shape)
        return torch.repeat_interleave(scaled, repeats, dim=self.dim, output_size=self.output_size)


@pytest.mark.parametrize(("shape", "dim", "output_size"), [
    ((3, 2), 0, None), ((2, 3), 1, None), ((2, 3), -1, 4), ((2, 4, 3), 2, None), ((2, 3, 5), 1, 4), ((3,), None, None),
])
def test_repeats_along_the_given_dim_as_eager(shape, dim, output_size):
    torch.manual_seed(0)
    eager = _Repeat(dim, output_size)
    wrapped = ORTModule(_Repeat(dim, output_size), debug_options=DebugOptions(fallback=False))
    assert_steps_match(eager, wrapped, torch.randn(*shape))


class _Positions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(4, 2))

    def forward(self, counts):
        return self.table[torch.repeat_interleave(counts)]


def test_repeated_positions_from_counts_given_at_run_time():
    torch.manual_seed(0)
    eager, wrapped = _Positions(), ORTModule(_Positions(), debug_options=DebugOptions(fallback=False))
    wrapped.module.load_state_dict(eager.state_dict())
    assert_steps_match(eager, wrapped, torch.tensor([2, 0, 1, 3]))


class _RepeatBySize(torch.nn.Module):
    """Each entry repeated as often as the sequence is long (a count known at run time only when
    the graph's dims are symbolic), along each dim and flattened; and a constant count."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x):
        h = self.lin(x)
        repeated = sum((k + 1) * h.repeat_interleave(h.shape[1], dim=dim).pow(2).sum()
                       for k, dim in enumerate((0, 1, -1, None)))
        return repeated + h.repeat_interleave(2).sum()


def test_a_count_known_at_run_time_repeats_along_the_given_dim():
    """torchlib's translation of an int count that is a symbolic size expanded the wrong axis:
    the rows came back unrepeated (where the sizes matched) or the run failed."""
    torch.manual_seed(0)
    eager = _RepeatBySize()
    wrapped = ORTModule(_RepeatBySize(), debug_options=DebugOptions(fallback=False), dynamic=True)
    wrapped.module.load_state_dict(eager.state_dict())
    for shape in ((2, 4, 3), (3, 3, 3)):
        x = torch.randn(*shape)
        for module in (eager, wrapped):
            module.zero_grad()
        loss, expected = wrapped(x), eager(x)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(wrapped.module.lin.weight.grad, eager.lin.weight.grad, rtol=1e-5, atol=1e-4)


class _RepeatAll(torch.nn.Module):
    def __init__(self, repeats, dim):
        super().__init__()
        self.repeats, self.dim = repeats, dim
        self.weight = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.repeat_interleave(x * self.weight, torch.tensor(self.repeats), dim=self.dim)


@pytest.mark.parametrize(("repeats", "dim"), [(2, 1), ([3], 0), (2, None), (2, -1)])
def test_one_count_in_a_tensor_repeats_every_entry(repeats, dim):
    """``repeat_interleave(x, torch.tensor(2), dim)``: one count for every entry, as PyTorch
    broadcasts it (the graph repeated the first entry only, silently: (2, 2) for (2, 6))."""
    eager = _RepeatAll(repeats, dim)
    wrapped = ORTModule(_RepeatAll(repeats, dim), debug_options=DebugOptions(fallback=False))
    assert_steps_match(eager, wrapped, torch.randn(2, 3))
