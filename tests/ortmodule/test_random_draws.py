"""Random draws inside a forward run in ONNX Runtime, fresh on every call, with PyTorch's
distributions (another stream than PyTorch's, so compared by their statistics): ``randint``
over its whole range and never ``high`` (the exporter's float32 draw skipped integers above
2^24 and could round up to ``high``), ``multinomial`` without replacement never repeating a
category (the exporter's ONNX ``Multinomial`` draws with replacement), ``uniform_`` and
``randperm`` (the exporter has none)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from onnxtrain.errors import ExportError  # noqa: E402
from onnxtrain.torch import DebugOptions, ORTModule  # noqa: E402

STRICT = DebugOptions(fallback=False)


class _Draw(torch.nn.Module):
    """``draw(x)`` times a parameter (so that there is a backward to run)."""

    def __init__(self, draw):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.draw = draw

    def forward(self, x):
        return self.draw(x) * self.scale


def _draws(draw, x, calls=2):
    """``calls`` results of ``draw`` run through ORTModule (strict: no PyTorch fallback), each
    backpropagated; the second call has another batch size (the dynamic re-export)."""
    wrapped = ORTModule(_Draw(draw), STRICT)
    results = []
    for call in range(calls):
        out = wrapped(x[call:])
        out.sum().backward()
        results.append(out.detach())
    assert wrapped.scale.grad is not None
    return results


def test_randint_draws_every_integer_of_its_range_and_never_high():
    small, large = _draws(lambda x: torch.stack([torch.randint(3, 9, x.shape), torch.randint(0, 2**26, x.shape)])
                          .double(), torch.zeros(60000))[1]
    assert small.min() == 3 and small.max() == 8
    counts = torch.bincount(small.long() - 3, minlength=6) / small.numel()
    torch.testing.assert_close(counts, torch.full((6,), 1 / 6, dtype=counts.dtype), atol=0.01, rtol=0)
    assert large.max() < 2**26 and large.min() >= 0
    # a float32 draw in [0.5, 1) times 2^26 is a multiple of 4: every residue must show up up there too
    upper_half = large[large >= 2**25].long()
    assert set((upper_half % 4).tolist()) == {0, 1, 2, 3}
    assert abs(large.mean().item() / 2**26 - 0.5) < 0.01


@pytest.mark.parametrize("form", ["randint_like_low", "randint_like_high", "randint_high", "randint_int32"])
def test_randint_forms(form):
    draw = {
        "randint_like_low": lambda x: torch.randint_like(x, -2, 2),
        "randint_like_high": lambda x: torch.randint_like(x, 4),
        "randint_high": lambda x: torch.randint(4, x.shape).float(),
        "randint_int32": lambda x: torch.randint(-2, 2, x.shape, dtype=torch.int32).float(),
    }[form]
    first, second = _draws(draw, torch.zeros(20000))
    low = -2 if form in ("randint_like_low", "randint_int32") else 0
    assert first.dtype == torch.float32
    assert set(second.unique().tolist()) == set(range(low, low + 4))
    assert not torch.equal(first[1:], second)  # a fresh draw on each call


def test_multinomial_without_replacement_never_repeats_a_category():
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]).expand(20000, 5).contiguous()
    _, samples = _draws(lambda w: torch.multinomial(w, 2).double(), weights)
    samples = samples.long()
    assert (samples[:, 0] != samples[:, 1]).all()
    assert (samples != 4).all()  # a zero weight is never drawn
    # the first sample is drawn with the weights' probabilities, the second from what is left
    first = torch.bincount(samples[:, 0], minlength=5) / len(samples)
    torch.testing.assert_close(first, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], dtype=first.dtype), atol=0.015, rtol=0)
    after_the_last = samples[samples[:, 0] == 3, 1]
    second = torch.bincount(after_the_last, minlength=5) / len(after_the_last)
    torch.testing.assert_close(second, torch.tensor([1 / 6, 2 / 6, 3 / 6, 0.0, 0.0], dtype=second.dtype), atol=0.03,
                               rtol=0)


def test_multinomial_with_replacement_and_one_distribution():
    (first,) = _draws(lambda w: torch.multinomial(w, 3, replacement=True).float(), torch.tensor([0.5, 0.5]), calls=1)
    assert first.shape == (3,) and set(first.unique().tolist()) <= {0.0, 1.0}
    (samples,) = _draws(lambda w: torch.multinomial(w[0], 30000, replacement=True).float(), torch.tensor([[1.0, 3.0]]),
                        calls=1)
    assert abs(samples.mean().item() - 0.75) < 0.015


def test_uniform_and_randperm():
    uniform, _ = _draws(lambda x: torch.empty_like(x).uniform_(-1.0, 3.0), torch.zeros(40000))
    assert uniform.min() >= -1.0 and uniform.max() < 3.0
    assert abs(uniform.mean().item() - 1.0) < 0.03 and abs(uniform.var().item() - 16 / 12) < 0.05
    x = torch.arange(1000.0)
    first, second = _draws(lambda x: x[torch.randperm(x.shape[0])], x)
    assert torch.equal(first.sort().values, x) and torch.equal(second.sort().values, x[1:])
    assert not torch.equal(first, x)


def test_an_op_without_translation_names_itself_in_the_export_error():
    wrapped = ORTModule(_Draw(lambda x: torch.poisson(x)), STRICT)
    with pytest.raises(ExportError, match=r"DispatchError: No ONNX function found for .*aten\.poisson") as info:
        wrapped(torch.ones(4))
    assert "\x1b[" not in str(info.value)  # no terminal colours
